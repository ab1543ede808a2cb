"""Benchmarks (`shoal bench ...`, `make gpu-check`), as vLLM keeps vllm/benchmarks/: args.py the
CLI flags; offline.py engine throughput and latency; serve.py load on a running server; step.py
the host work of a decode step; models.py random-weight models; workloads.py named workloads;
gpu_check.py the GPU figures in one command (docs/gpu.md)."""

"""`shoal bench throughput | latency | step | make-model | serve | kernels`: flags only (cheap to import)."""

from __future__ import annotations

import argparse

from shoal.runtime.config import add_engine_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", required=True)

    tp = sub.add_parser("throughput", help="offline throughput on a named workload")
    add_engine_args(tp)
    tp.add_argument("--workload", default="public", choices=["public", "sharegpt", "shared-prefix", "gpu"],
                    help="gpu: PERFORMANCE.md's GPU workload (256 requests; --num-prompts keeps the first N)")
    tp.add_argument("--num-prompts", type=int)
    _random_model_arg(tp)
    tp.add_argument("--workload-seed", type=int, default=0)
    tp.add_argument("--compare-hf", action="store_true", help="also run transformers' static batching in this run")
    tp.add_argument("--hf-batch-size", type=int, default=8, help="transformers' static batch (64 on a GPU, as PERFORMANCE.md)")
    tp.add_argument("--structured", choices=["json"],
                    help="also run the same requests under a JSON schema (structured outputs) in this run; prints both and the ratio")
    tp.add_argument("--lora-adapters", type=int, metavar="N",
                    help="also run the same requests spread over N random LoRA adapters (rank --max-lora-rank, every "
                         "projection) in this run, alternated with the base model; prints both and the ratio")
    tp.add_argument("--compare-gguf", action="store_true",
                    help="a GGUF model (the built-in one): the C decode step on float32 panels and on the file's quantized "
                         "blocks, alternated in this run; prints both, the ratio and the greedy tokens' match rate")
    tp.add_argument("--repeat", type=int, default=1,
                    help="runs of the engine on the workload, one after another (the first is the cold one; default: 1)")
    tp.add_argument("--rounds", type=int, default=2, help="--compare-gguf: runs of each, alternated (default: 2)")
    tp.add_argument("--json", help="write the results as JSON to this file")
    tp.set_defaults(func=_run("throughput"))

    lat = sub.add_parser("latency", help="batch-1 time to first token, decode and prefill speed")
    add_engine_args(lat)
    lat.add_argument("--input-len", type=int, default=128)
    lat.add_argument("--output-len", type=int, default=128)
    lat.add_argument("--prefill-len", type=int, default=512)
    lat.add_argument("--iters", type=int, default=3)
    lat.add_argument("--compare-hf", action="store_true")
    lat.add_argument("--compare-llama-cpp", action="store_true",
                     help="a GGUF model: also llama.cpp (llama-cpp-python, installed apart) on the same file and thread count")
    lat.add_argument("--compare-gguf", action="store_true",
                     help="a GGUF model: batch-1 TTFT and decode on float32 panels and on the file's quantized blocks, alternated")
    lat.add_argument("--json")
    lat.set_defaults(func=_run("latency"))

    st = sub.add_parser("step", help="host and device cost of one steady decode step (torch.profiler)")
    add_engine_args(st)
    _random_model_arg(st)
    st.add_argument("--tiny", action="store_true",
                    help="the random tiny-step model (2 layers, hidden 256, vocab 512): issue 17's CPU host-work figure")
    st.add_argument("--num-seqs", type=int, default=256, help="sequences running (decoding) at once")
    st.add_argument("--prompt-len", type=int, default=32)
    st.add_argument("--warmup-steps", type=int, default=3, help="decode steps run before timing")
    st.add_argument("--steps", type=int, default=20, help="decode steps timed")
    st.add_argument("--profile-steps", type=int, default=10, help="decode steps under torch.profiler (0: none)")
    st.add_argument("--trace", help="keep the profiler's chrome trace here (.json or .json.gz)")
    st.add_argument("--json", help="write the results as JSON to this file")
    st.add_argument("--temperature", type=float, help="every sequence samples with this temperature (default: greedy)")
    st.add_argument("--top-p", type=float)
    st.add_argument("--top-k", type=int)
    st.add_argument("--min-p", type=float)
    st.add_argument("--output-kind", choices=["cumulative", "delta", "final_only"],
                    help="what each sequence's outputs hold (default: cumulative). final_only: text once at the end, "
                         "as LLM.generate and the engine-core process; delta: the server's streams in one process")
    st.add_argument("--lora-adapters", type=int, metavar="N",
                    help="the sequences spread over N random LoRA adapters (rank --max-lora-rank, every projection): "
                         "the profile reports the LoRA hooks' share of a step")
    st.set_defaults(func=_run_step)

    mm = sub.add_parser("make-model", help="write a random-weight HF model directory (prints its path)")
    from shoal.runtime.bench import models as bench_models

    bench_models.add_arguments(mm)

    serve = sub.add_parser("serve", help="load test a running server (Poisson arrivals)")
    from shoal.runtime.bench import serve as bench_serve

    bench_serve.add_arguments(serve)

    kern = sub.add_parser("kernels", help="check and time the Triton kernels on a GPU")
    kern.add_argument("rest", nargs=argparse.REMAINDER)
    kern.set_defaults(func=_run_kernels)


def _run(name):
    def run(args):
        from shoal.runtime.bench import offline as bench

        return getattr(bench, name)(args)

    return run


def _run_kernels(args):
    from shoal.kernels import bench as kernels_bench

    return kernels_bench.main(args.rest)


def _run_step(args):
    from shoal.runtime.bench import step as bench_step

    return bench_step.step(args)


def _random_model_arg(p: argparse.ArgumentParser) -> None:
    from shoal.runtime.bench.models import PRESETS

    p.add_argument("--random-model", choices=sorted(PRESETS),
                   help="instead of MODEL: a random-weight model of this shape in --dtype (made once, in the cache); "
                        "llama-1b is PERFORMANCE.md's GPU model")

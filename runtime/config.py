"""Engine options: one dataclass, shared by the CLI (`--max-num-seqs`) and `LLM(max_num_seqs=...)`."""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field

DEFAULT_MODEL = "builtin://smollm2-135m-instruct"


QUANTIZATIONS = ("fp8", "awq", "gptq", "compressed-tensors", "gguf")  # --quantization (docs/quantization.md)


@dataclass
class EngineConfig:
    model: str = DEFAULT_MODEL
    served_model_name: str | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's own context length
    block_size: int = 16
    # Bytes of KV cache, or a fraction (0, 1] of free device memory (GPU only).
    # None: enough for max_num_seqs sequences of max_model_len, capped at 4 GiB on CPU.
    kv_cache_memory: float | None = None
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    # "auto": float32 (the checkpoint's float weights upcast), and on the CPU a GGUF model (the
    # built-in one, a .gguf file) serves its decode steps from the file's quantized blocks
    # (quantization "gguf", see gguf_by_default); "float32" keeps the dequantized weights.
    dtype: str = "auto"
    device: str = "cpu"
    seed: int = 0
    attention_backend: str = "auto"  # auto | torch | triton
    # Batches the engine keeps in the pipe at once; None: one per pipeline stage (1 = serial).
    batches_in_flight: int | None = None
    # CPU, float32, one process: decode-only steps of at most this many sequences run in the
    # C decode step (runtime/models/cpu_llama.c) instead of the torch model; 0 turns it off.
    cpu_decode_max_seqs: int = 256
    # GPU, one process: decode-only steps replay CUDA graphs captured at start-up (vLLM's
    # default); True runs every step eagerly.
    enforce_eager: bool = False
    # Schedule and prepare step N+1 while the device runs step N, its input tokens filled in on
    # the device (vLLM's --async-scheduling). None: on where it pays, a GPU in one process.
    async_scheduling: bool | None = None
    # CPU threads of each process (torch, OpenMP, the C decode step). None: SHOAL_NUM_THREADS,
    # else the CPUs the process may use, the smaller of its affinity mask and cgroup quota.
    num_threads: int | None = None
    # A quantized checkpoint's format is read from its config.json (quantization_config); this
    # forces one: "fp8" quantizes a float checkpoint's linear weights at load (W8A8); "gguf": a
    # GGUF model's C decode step reads its quantized blocks as the file stores them (gguf_by_default).
    quantization: str | None = None
    # "fp8": the KV cache in float8 e4m3 with per-tensor scales (twice the blocks); "auto": the model's dtype.
    kv_cache_dtype: str = "auto"
    # LoRA adapters (vLLM's flags): served unmerged, many in one batch (docs/lora.md)
    enable_lora: bool = False
    lora_modules: list = field(default_factory=list)  # {"name", "path", "base_model_name"?} loaded at start
    max_loras: int = 1  # adapters on the device at once (slots)
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept in host memory (None: max_loras)
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', not {self.scheduling_policy!r}")
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "max_num_seqs", "max_num_batched_tokens", "block_size",
                     "batches_in_flight", "num_threads", "max_loras", "max_lora_rank", "max_cpu_loras"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not 0 <= self.cpu_decode_max_seqs <= 256:
            raise ValueError(f"cpu_decode_max_seqs must be in [0, 256], got {self.cpu_decode_max_seqs}")
        if self.dtype not in ("float32", "float16", "bfloat16", "auto"):
            raise ValueError(f"dtype must be one of float32, float16, bfloat16, auto; got {self.dtype!r}")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {self.quantization!r}")
        if self.kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3"):
            raise ValueError(f"kv_cache_dtype must be auto or fp8; got {self.kv_cache_dtype!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be auto, torch or triton; got {self.attention_backend!r}")
        if self.quantization is None and self.gguf_by_default():
            self.quantization = "gguf"
        self.lora_modules = [parse_lora_module(m) if isinstance(m, str) else dict(m) for m in self.lora_modules]
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora")

    def gguf_by_default(self) -> bool:
        """A GGUF model named as one (builtin://NAME or a .gguf file), with no dtype asked for, in
        one CPU process with the C decode step on: its decode reads the file's quantized blocks
        (llama.cpp's own speed and bytes). Not with LoRA adapters, whose deltas the C step adds
        to float32 weights."""
        model = str(self.model).strip()
        named_gguf = model.startswith("builtin://") or model.endswith(".gguf") or model == DEFAULT_MODEL.split("//")[1]
        return (named_gguf and self.dtype == "auto" and self.device == "cpu" and self.cpu_decode_max_seqs > 0
                and self.tensor_parallel_size * self.pipeline_parallel_size == 1 and not self.enable_lora)

    @property
    def name(self) -> str:
        return self.served_model_name or self.model.rstrip("/").split("/")[-1]

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(kwargs) - known
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
        return cls(**kwargs)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "EngineConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in known and v is not None})


def parse_lora_module(text: str) -> dict:
    """'name=path', or vLLM's JSON form {"name": ..., "path": ..., "base_model_name": ...}."""
    text = text.strip()
    if text.startswith("{"):
        try:
            module = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules: bad JSON {text!r}: {e}") from None
        if not isinstance(module, dict) or not module.get("name") or not module.get("path"):
            raise ValueError(f"--lora-modules: {text!r} needs a name and a path")
        return module
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules takes name=path (or JSON), not {text!r}")
    return {"name": name, "path": path}


def parse_memory(text: str) -> float:
    """'2GiB', '512MiB', '1e9' or a fraction like '0.9' -> bytes or fraction."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 1e3, "mb": 1e6, "gb": 1e9}
    low = text.strip().lower()
    for unit, scale in units.items():
        if low.endswith(unit):
            return float(low[: -len(unit)]) * scale
    return float(low)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The vLLM-style flags of docs/design.md; defaults live in EngineConfig (and are shown in --help)."""
    d = EngineConfig()
    g = parser.add_argument_group("engine")
    g.add_argument("model", nargs="?", default=DEFAULT_MODEL, help=f"HF directory, .gguf file or builtin://NAME (default: {DEFAULT_MODEL})")
    g.add_argument("--served-model-name", help="the model name clients send and /v1/models lists (default: the last part of MODEL)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, help=f"tensor-parallel ranks per group (default: {d.tensor_parallel_size})")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, help=f"pipeline stages per group (default: {d.pipeline_parallel_size})")
    g.add_argument("--max-num-seqs", type=int, help=f"most sequences in the running batch (default: {d.max_num_seqs})")
    g.add_argument("--max-num-batched-tokens", type=int, help=f"token budget of one step (default: {d.max_num_batched_tokens})")
    g.add_argument("--max-model-len", type=int, help="context length: prompt plus output tokens (default: the model's own, capped by the KV cache)")
    g.add_argument("--block-size", type=int, help=f"tokens per KV-cache block (default: {d.block_size})")
    g.add_argument("--kv-cache-memory", type=parse_memory,
                   help="KV cache: bytes (e.g. 2GiB) or a fraction (0, 1] of free GPU memory "
                        "(default: enough for max-num-seqs sequences of max-model-len, at most 4 GiB on CPU)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help=f"reuse the KV blocks of shared prompt prefixes (default: {'on' if d.enable_prefix_caching else 'off'})")
    g.add_argument("--scheduling-policy", choices=["fcfs", "priority"], help=f"fcfs, or priority (lower 'priority' runs first) (default: {d.scheduling_policy})")
    g.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"],
                   help=f"weights and activations; auto: float32, and a GGUF model on the CPU decodes from its quantized "
                        f"blocks (float32 keeps the dequantized weights) (default: {d.dtype})")
    g.add_argument("--quantization", "-q", choices=QUANTIZATIONS,
                   help="the checkpoint's quantization (default: read from its config.json); fp8 quantizes a float checkpoint "
                        "at load; gguf: the CPU decode step reads a GGUF model's Q4_0/Q4_1/Q8_0/K-quant blocks as stored "
                        "(the default for a GGUF model with --dtype auto)")
    g.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3"], help=f"KV cache storage: auto (the model's dtype) or fp8 e4m3 (default: {d.kv_cache_dtype})")
    g.add_argument("--device", help=f"cpu or cuda (default: {d.device})")
    g.add_argument("--seed", type=int, help=f"seed of the engine's random state (default: {d.seed})")
    g.add_argument("--attention-backend", choices=["auto", "torch", "triton"], help=f"attention kernels (default: {d.attention_backend})")
    g.add_argument("--batches-in-flight", type=int, help="pipeline parallel: batches in the pipe at once (default: one per stage)")
    g.add_argument("--cpu-decode-max-seqs", type=int, help=f"CPU: decode steps of up to this many sequences run in C, 0: off (default: {d.cpu_decode_max_seqs})")
    g.add_argument("--num-threads", type=int, help="CPU threads per process (default: SHOAL_NUM_THREADS, else the CPUs "
                   "the process may use: the smaller of its affinity mask and its cgroup CPU quota)")
    g.add_argument("--enforce-eager", action="store_true", default=None, help="GPU: no CUDA graphs; every step runs eagerly (default: off)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule each step while the device runs the previous one (default: on for one GPU process, else off)")
    g.add_argument("--enable-lora", action="store_true", default=None, help="serve LoRA adapters beside the base model (default: off)")
    g.add_argument("--lora-modules", nargs="+", type=parse_lora_module, metavar="NAME=PATH",
                   help='adapters loaded at start: name=path or JSON {"name", "path", "base_model_name"} (default: none)')
    g.add_argument("--max-loras", type=int, help=f"LoRA adapters on the device at once (default: {d.max_loras})")
    g.add_argument("--max-lora-rank", type=int, help=f"the highest adapter rank accepted (default: {d.max_lora_rank})")
    g.add_argument("--max-cpu-loras", type=int, help="LoRA adapters kept in host memory (default: max-loras)")

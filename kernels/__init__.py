"""Device kernels for the paged KV cache, each a Triton kernel beside a plain-torch reference.

    ops = get_ops("auto", device)    # "torch" | "triton" | "auto"
    ops.paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale)

Both backends expose the same functions (OPS) with the same signatures and return values
(see reference.py for shapes and the cache layout). Importing this package never imports
triton: a CPU server never needs it.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

OPS = ("write_kv_cache", "paged_attention_decode", "paged_attention_prefill", "rms_norm", "rotary_embedding", "silu_and_mul",
       "gelu_tanh_and_mul", "fused_moe", "lora_delta")
BACKENDS = ("torch", "triton", "auto")

__all__ = ["OPS", "BACKENDS", "get_ops", "triton_available"]


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # ImportError, or a broken install raising anything else
        return False
    return True


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def get_ops(backend: str, device) -> SimpleNamespace:
    """The kernel functions (OPS) for `device`, as a namespace with a `.backend` name.

    "torch": the references (any device). "triton": the Triton kernels; on a CUDA device, or on
    CPU tensors when TRITON_INTERPRET=1 was set before this first loads them (tests, debugging).
    "auto": Triton on a CUDA device when triton imports, torch otherwise.
    """
    if backend not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    device = torch.device(device)
    if backend == "auto":
        backend = "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend == "torch":
        from shoal.kernels import reference as mod

        return SimpleNamespace(backend="torch", **{name: getattr(mod, name) for name in OPS})
    if not triton_available():
        raise RuntimeError("kernel backend 'triton' needs the triton package (pip install 'shoal[triton]')")
    if device.type != "cuda" and not _interpreting():
        raise RuntimeError(
            f"kernel backend 'triton' on a {device.type} device runs only in Triton's interpreter: "
            "set TRITON_INTERPRET=1 in the environment before starting, or use backend 'torch'"
        )
    from shoal.kernels import activation, cache_write, fused_moe, lora, norm, paged_attention, rotary

    return SimpleNamespace(
        backend="triton",
        write_kv_cache=cache_write.write_kv_cache,
        paged_attention_decode=paged_attention.paged_attention_decode,
        paged_attention_prefill=paged_attention.paged_attention_prefill,
        rms_norm=norm.rms_norm,
        rotary_embedding=rotary.rotary_embedding,
        silu_and_mul=activation.silu_and_mul,
        gelu_tanh_and_mul=activation.gelu_tanh_and_mul,
        fused_moe=fused_moe.fused_moe,
        lora_delta=lora.lora_delta,
    )

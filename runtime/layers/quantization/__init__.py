"""Quantized checkpoints: which LinearMethod each linear layer gets, from config.json's
quantization_config (or --quantization). One file per format: fp8.py (W8A8 and fp8 at
load), awq.py, gptq.py, compressed_tensors.py (its fp8 and W4A16 schemes), int4.py (the one
int4 layout the three int4 formats repack into). gpt-oss's MXFP4 checkpoints quantize only
their experts, which layers/moe.py dequantizes at load: every linear layer stays plain."""

from __future__ import annotations

import re
from typing import Callable

from shoal.runtime.layers.linear import PLAIN, LinearMethod

# a fused layer of the decoder -> the checkpoint's projections it holds
UNFUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def quantization_config(hf_config) -> dict | None:
    qc = getattr(hf_config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict()
    return qc


def methods_for(hf_config, forced: str | None = None) -> Callable[[str], LinearMethod]:
    """`method_for(fused layer name)` for DecoderForCausalLM: a new method per layer."""
    qc = quantization_config(hf_config)
    method = forced or (qc or {}).get("quant_method")
    if method is None:
        return lambda name: PLAIN
    if qc is not None and forced and qc.get("quant_method") != forced:
        raise ValueError(f"--quantization {forced} but the checkpoint is quantized as {qc.get('quant_method')!r}")
    qc = qc or {}
    if method == "fp8":
        return _fp8(qc)
    if method == "awq":
        from shoal.runtime.layers.quantization.awq import AwqLinear

        _int4_only(qc, "awq")
        if str(qc.get("version", "gemm")).lower() != "gemm" or not qc.get("zero_point", True):
            raise ValueError("AWQ: only the GEMM layout with zero points is supported")
        return lambda name: AwqLinear(qc.get("group_size", 128))
    if method == "gptq":
        from shoal.runtime.layers.quantization.gptq import GptqLinear

        _int4_only(qc, "gptq")
        minus_one = qc.get("checkpoint_format", "gptq") != "gptq_v2"
        return lambda name: GptqLinear(qc.get("group_size", 128), bool(qc.get("desc_act")), minus_one)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "mxfp4" and not forced:  # gpt-oss: only its experts are MXFP4, dequantized as the MoE block loads them
        return lambda name: PLAIN
    raise ValueError(f"quantization {method!r} is not supported (fp8, awq, gptq, compressed-tensors; mxfp4 experts)")


def _int4_only(qc: dict, name: str) -> None:
    if qc.get("bits", 4) != 4:
        raise ValueError(f"{name}: only 4-bit weights are supported, not {qc.get('bits')}")


def _fp8(qc: dict):
    from shoal.runtime.layers.quantization.fp8 import Fp8Linear

    if qc.get("weight_block_size"):
        raise ValueError("block-wise fp8 (weight_block_size) is not supported")
    serialized = bool(qc)  # a checkpoint with quant_method fp8 holds fp8 weights; --quantization fp8 alone: at load
    activations = qc.get("activation_scheme", "dynamic")
    return lambda name: Fp8Linear(per_channel=False, activations=activations, serialized=serialized)


def _ignored(name: str, patterns: list[str]) -> bool:
    """Whether every checkpoint projection of a fused layer is in the ignore list (exact names
    or "re:" patterns); a fused layer with only some of them ignored cannot be held."""
    prefix, leaf = name.rsplit(".", 1)
    parts = [f"{prefix}.{p}" for p in UNFUSED.get(leaf, (leaf,))]
    hits = [any(p == pat or (pat.startswith("re:") and re.match(pat[3:], p)) for pat in patterns) for p in parts]
    if any(hits) and not all(hits):
        raise ValueError(f"{name}: some of its fused projections are quantized and some are not")
    return all(hits)


def _compressed_tensors(qc: dict):
    from shoal.runtime.layers.quantization.compressed_tensors import scheme_method

    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1 or "Linear" not in groups[0].get("targets", []):
        raise ValueError("compressed-tensors: one config group targeting Linear is supported")
    ignore = qc.get("ignore") or []
    fmt = qc.get("format")
    scheme_method(groups[0], fmt)  # refuse an unsupported scheme before building anything

    def method_for(name: str) -> LinearMethod:
        return PLAIN if _ignored(name, ignore) else scheme_method(groups[0], fmt)

    return method_for

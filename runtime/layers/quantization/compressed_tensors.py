"""compressed-tensors (llm-compressor's checkpoints): the scheme of each linear layer from
quantization_config's config_groups. FP8 W8A8 ("float-quantized": weight float8 with a
per-tensor or per-channel weight_scale, input activations static per tensor or dynamic per
token) and W4A16 ("pack-quantized": weight_packed [out, in / 8] int32 packed along the
inputs, values offset by 8, weight_scale [out, groups], weight_zero_point [out / 8, groups]
when asymmetric, weight_shape)."""

from __future__ import annotations

import torch

from shoal.runtime.layers.linear import Layout, LinearMethod
from shoal.runtime.layers.quantization.fp8 import Fp8Linear, projections
from shoal.runtime.layers.quantization.int4 import Int4Linear, float_param, group_count, int_param, is_row, unpack_columns


class PackedInt4Linear(Int4Linear):
    def __init__(self, group_size: int, symmetric: bool = True):
        super().__init__(group_size)
        self.symmetric = symmetric

    def create_weights(self, layer, out_features, in_features):
        layer.weight_rows = out_features
        groups = group_count(in_features, self.group(in_features))
        layer.weight_packed = int_param(out_features, in_features // 8)
        layer.weight_scale = float_param(out_features, groups)
        layer.weight_shape = int_param(2) if is_row(layer) else int_param(len(projections(layer)), 2)
        if not self.symmetric:
            layer.weight_zero_point = int_param(out_features // 8, groups)

    def checkpoint_names(self):
        return ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")

    def layout(self, name):
        g = self.group_size if self.group_size > 0 else 1
        layouts = {"weight_packed": Layout(0, 1, in_pack=8), "weight_scale": Layout(0, 1, in_pack=g),
                   "weight_zero_point": Layout(0, 1, out_pack=8, in_pack=g), "weight_shape": Layout(None, None),
                   "bias": Layout(0, None)}
        if name not in layouts or (name == "weight_zero_point" and self.symmetric):
            raise ValueError(f"a pack-quantized layer holds no tensor {name!r}")
        return layouts[name]

    def canonical(self, layer):
        q = unpack_columns(layer.weight_packed.data).t()  # [in, out]
        scales = layer.weight_scale.data.t()
        if self.symmetric:
            zeros = torch.full_like(scales, 8.0)
        else:
            zeros = unpack_columns(layer.weight_zero_point.data.t().contiguous()).float()  # [groups, out]
        K = q.shape[0]
        return q, scales, zeros, torch.arange(K, device=q.device) // self.group(K)


def scheme_method(scheme: dict, fmt: str | None) -> LinearMethod:
    """One config_group's {weights, input_activations} -> its LinearMethod."""
    w, a = scheme.get("weights") or {}, scheme.get("input_activations")
    bits, kind, strategy = w.get("num_bits"), w.get("type", "int"), w.get("strategy", "tensor")
    if bits == 8 and kind == "float":
        if strategy not in ("tensor", "channel"):
            raise ValueError(f"compressed-tensors fp8 weights by {strategy!r} are not supported (tensor or channel)")
        if a is None:
            activations = None
        elif a.get("num_bits") == 8 and a.get("type") == "float":
            activations = "dynamic" if a.get("dynamic") else "static"
            if activations == "static" and a.get("strategy", "tensor") != "tensor":
                raise ValueError("static fp8 activations must be per tensor")
        else:
            raise ValueError(f"compressed-tensors activations {a} with fp8 weights are not supported")
        return Fp8Linear(per_channel=strategy == "channel", activations=activations)
    if bits == 4 and kind == "int" and a is None:
        if fmt not in (None, "pack-quantized"):
            raise ValueError(f"compressed-tensors int4 format {fmt!r} is not supported (pack-quantized)")
        group = w.get("group_size") if strategy == "group" else -1
        if strategy not in ("group", "channel"):
            raise ValueError(f"compressed-tensors int4 weights by {strategy!r} are not supported (group or channel)")
        return PackedInt4Linear(group, symmetric=w.get("symmetric", True))
    raise ValueError(f"compressed-tensors scheme {scheme} is not supported (fp8 W8A8/W8A16, int4 W4A16)")

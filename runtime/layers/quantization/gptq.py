"""GPTQ (AutoGPTQ / GPTQModel, 4 bits): qweight [in / 8, out] int32 packed along the inputs,
qzeros [groups, out / 8] packed along the outputs and stored minus one (checkpoint_format
"gptq"; "gptq_v2" stores them as they are), scales [groups, out], g_idx [in] each input's
group. With act-order (desc_act) g_idx is a permutation's groups: a row-parallel layer then
keeps every group's scales and zeros (its inputs' groups lie anywhere), as vLLM does."""

from __future__ import annotations

import torch

from shoal.kernels.quant_reference import unpack_int4_rows
from shoal.runtime.layers.linear import Layout
from shoal.runtime.layers.quantization.fp8 import projections
from shoal.runtime.layers.quantization.int4 import Int4Linear, float_param, group_count, int_param, is_row, unpack_columns


class GptqLinear(Int4Linear):
    def __init__(self, group_size: int, desc_act: bool = False, zeros_minus_one: bool = True):
        super().__init__(group_size)
        self.desc_act, self.zeros_minus_one = desc_act, zeros_minus_one
        self.full_groups = False  # set per layer: scales not split along the inputs

    def create_weights(self, layer, out_features, in_features):
        layer.weight_rows = out_features
        self.row = is_row(layer)
        self.full_groups = self.row and self.desc_act and layer.state.tp_size > 1
        total_in = in_features * layer.state.tp_size if self.full_groups else in_features
        groups = group_count(total_in, self.group(total_in))
        layer.qweight = int_param(in_features // 8, out_features)
        layer.qzeros = int_param(groups, out_features // 8)
        layer.scales = float_param(groups, out_features)
        layer.g_idx = int_param(in_features) if self.row else int_param(len(projections(layer)), in_features)

    def checkpoint_names(self):
        return ("qweight", "qzeros", "scales", "g_idx")

    def layout(self, name):
        g = self.group_size if self.group_size > 0 else 1
        in_dim = None if self.full_groups else 0
        layouts = {"qweight": Layout(1, 0, in_pack=8), "qzeros": Layout(1, in_dim, out_pack=8, in_pack=g),
                   "scales": Layout(1, in_dim, in_pack=g), "bias": Layout(0, None),
                   "g_idx": Layout(None, 0) if self.row else Layout(None, None)}
        if name not in layouts:
            raise ValueError(f"a gptq layer holds no tensor {name!r}")
        return layouts[name]

    def canonical(self, layer):
        q = unpack_int4_rows(layer.qweight.data)
        zeros = unpack_columns(layer.qzeros.data) + (1 if self.zeros_minus_one else 0)
        K = q.shape[0]
        if not self.desc_act:  # groups in input order: this rank's own (its scales are its slice)
            g_idx = torch.arange(K, device=q.device) // self.group(K)
        else:
            g_idx = layer.g_idx.data.reshape(-1, K)
            if not (g_idx == g_idx[:1]).all():
                raise ValueError("the fused projections' g_idx differ (act-order over different inputs)")
            g_idx = g_idx[0]
        return q, layer.scales.data, zeros & 0xF, g_idx

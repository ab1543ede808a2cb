"""AWQ (GEMM layout, AutoAWQ's `version: gemm`): qweight [in, out / 8] int32 packed along the
outputs in AWQ's interleaved order, qzeros [in / group, out / 8] the same, scales
[in / group, out]. W = (q - zero) * scale."""

from __future__ import annotations

import torch

from shoal.runtime.layers.linear import Layout
from shoal.runtime.layers.quantization.int4 import Int4Linear, float_param, group_count, int_param, unpack_columns

# AutoAWQ puts column (0, 2, 4, 6, 1, 3, 5, 7)[i] of each eight in nibble i: column j lies in nibble UNPACK_ORDER[j]
UNPACK_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """[R, C / 8] -> [R, C] in column order."""
    nibbles = unpack_columns(packed).reshape(packed.shape[0], -1, 8)
    return nibbles[..., list(UNPACK_ORDER)].reshape(packed.shape[0], -1)


class AwqLinear(Int4Linear):
    def create_weights(self, layer, out_features, in_features):
        groups = group_count(in_features, self.group(in_features))
        layer.qweight = int_param(in_features, out_features // 8)
        layer.qzeros = int_param(groups, out_features // 8)
        layer.scales = float_param(groups, out_features)

    def checkpoint_names(self):
        return ("qweight", "qzeros", "scales")

    def layout(self, name):
        g = self.group_size if self.group_size > 0 else 1  # one group: nothing to split (TP needs groups)
        layouts = {"qweight": Layout(1, 0, out_pack=8), "qzeros": Layout(1, 0, out_pack=8, in_pack=g),
                   "scales": Layout(1, 0, in_pack=g), "bias": Layout(0, None)}
        if name not in layouts:
            raise ValueError(f"an awq layer holds no tensor {name!r}")
        return layouts[name]

    def canonical(self, layer):
        q = awq_unpack(layer.qweight.data)
        zeros = awq_unpack(layer.qzeros.data)
        K = q.shape[0]
        g_idx = torch.arange(K, device=q.device) // self.group(K)
        return q, layer.scales.data, zeros, g_idx

"""The linear-method seam: a method that stores its weight transposed and packed still shards
and loads through the layers' one Layout-driven path, and its layers compute what plain ones do."""

from __future__ import annotations

import torch

from shoal.runtime.distributed import ParallelState
from shoal.runtime.layers.linear import PLAIN, Layout, LinearMethod, MergedColumnLinear, QKVLinear, RowLinear, _param


class TransposedPairs(LinearMethod):
    """A stand-in for a quantized format's layout: weight stored [in, out / 2, 2] (output
    features packed two to an element along dim 1), plus a per-projection scale."""

    def create_weights(self, layer, out_features, in_features):
        layer.weight = _param(in_features, out_features // 2, 2)
        layer.weight_scale = _param(3)

    def layout(self, name):
        if name == "weight_scale":
            return Layout(None, None)
        return Layout(out_dim=1, in_dim=0, out_pack=2) if name == "weight" else Layout(0, None)

    def apply(self, layer, x, bias):
        return x @ layer.weight.reshape(layer.weight.shape[0], -1)


def _packed(w: torch.Tensor) -> torch.Tensor:
    return w.t().reshape(w.shape[1], w.shape[0] // 2, 2)


def test_a_method_with_its_own_layout_shards_like_the_plain_one():
    torch.manual_seed(0)
    hidden, d, heads, kv = 16, 4, 4, 2
    full = [torch.randn(n * d, hidden) for n in (heads, kv, kv)]
    x = torch.randn(3, hidden)
    for rank in range(2):
        state = ParallelState(tp_rank=rank, tp_size=2)
        plain = QKVLinear(hidden, d, heads, kv, state)
        other = QKVLinear(hidden, d, heads, kv, state, method=TransposedPairs())
        for shard, w in enumerate(full):
            plain.load(w, shard)
            other.load(_packed(w), shard)
            other.load(torch.tensor(float(shard + 1)), shard, "weight_scale")
        torch.testing.assert_close(other(x), plain(x))
        assert other.weight_scale.tolist() == [1.0, 2.0, 3.0]


def test_row_parallel_shards_inputs_by_layout():
    torch.manual_seed(1)
    w = torch.randn(6, 8)
    x = torch.randn(2, 8)
    parts = []
    for rank in range(2):
        state = ParallelState(tp_rank=rank, tp_size=2)
        layer = RowLinear(8, 6, state)  # no all-reduce is run in one process: compare partial sums
        layer.load(w)
        parts.append(layer.method.apply(layer, x[:, rank * 4 : rank * 4 + 4], None))
    torch.testing.assert_close(parts[0] + parts[1], x @ w.t())
    assert MergedColumnLinear(8, [4, 4]).method is PLAIN


def test_lora_hook_adds_before_the_reduce():
    layer = RowLinear(4, 3)
    layer.load(torch.eye(3, 4))
    layer.lora = lambda lyr, x, out: out + 1.0
    torch.testing.assert_close(layer(torch.zeros(2, 4)), torch.ones(2, 3))

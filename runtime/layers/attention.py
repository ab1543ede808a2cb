"""Attention over the paged KV cache, behind one small interface.

The model runner builds one AttentionMetadata per step; every layer calls `attend`, which
writes the step's new keys/values into the cache and attends with the chosen backend's
kernels (shoal.kernels: Triton on CUDA, the torch references on CPU). A step's tokens are
ordered decodes first (one query token each) then prefill chunks, so each group runs as
one batched call: no loop over sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from shoal.runtime.layers.decode_workspace import DecodePlan, decode_attention


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T]
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None  # [Bd, nb]
    decode_context_lens: torch.Tensor | None  # [Bd]
    prefill_block_tables: torch.Tensor | None  # [Bp, nb]
    prefill_query_start_loc: torch.Tensor | None  # [Bp + 1], offsets within the prefill tokens
    prefill_context_lens: torch.Tensor | None  # [Bp]
    decode_plan: DecodePlan | None = None  # torch backend: decode from the workspace mirror
    # several KV-cache groups (full and sliding-window layers, models/kv_groups.py): each group's
    # slots [G, T] and tables [G, B, nb]; the fields above are then group 0's
    group_slot_mapping: torch.Tensor | None = None
    group_decode_block_tables: torch.Tensor | None = None
    group_prefill_block_tables: torch.Tensor | None = None

    def per_group(self) -> list["AttentionMetadata"]:
        """One metadata per KV-cache group, each with only its own slots and tables."""
        if self.group_slot_mapping is None:
            return [self]
        none = dict(group_slot_mapping=None, group_decode_block_tables=None, group_prefill_block_tables=None)
        return [replace(self, slot_mapping=self.group_slot_mapping[g],
                        decode_block_tables=None if self.group_decode_block_tables is None else self.group_decode_block_tables[g],
                        prefill_block_tables=None if self.group_prefill_block_tables is None else self.group_prefill_block_tables[g],
                        **none)
                for g in range(self.group_slot_mapping.shape[0])]


def attend(ops, q, k, v, layer_cache, meta: AttentionMetadata, scale: float, window: int = 0,
           softcap: float = 0.0, kv_scales: tuple[float, float] = (1.0, 1.0), sinks=None) -> torch.Tensor:
    """q [T, h, d], k/v [T, kvh, d] -> [T, h, d]. layer_cache is (kv, workspace): kv is
    [2, num_blocks, block_size, kvh, d]; workspace is the decode mirror, or None. `window`
    (a sliding window) and `softcap` (Gemma 2) go to the kernels only when set, so kernels
    that know neither (the C step's prefill, the workspace) serve the models without them.
    A float8 cache (--kv-cache-dtype fp8) stores k / k_scale and v / v_scale (kv_scales);
    neither the C step nor the workspace reads one. `sinks` [h] (gpt-oss): each head's logit in
    its softmax's denominator, given to the kernels only when set, as the window."""
    kv, workspace = layer_cache
    k_cache, v_cache = kv[0], kv[1]
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    scales = dict(k_scale=kv_scales[0], v_scale=kv_scales[1]) if fp8 else {}
    ops.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, **scales)
    options = scales | ({"sinks": sinks} if sinks is not None else {})  # the attention kernels' keywords
    nd = meta.num_decode_tokens
    extra = (window, softcap) if window or softcap or fp8 else ()

    def decode():
        if meta.decode_plan is not None:
            assert not extra and sinks is None, "the decode workspace attends over whole contexts, uncapped, sinkless"
            return decode_attention(q[:nd], k[:nd], v[:nd], k_cache, v_cache, workspace, meta.decode_plan, scale)
        return ops.paged_attention_decode(q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                                          scale, *extra, **options)

    if nd == q.shape[0]:
        return decode()
    prefill = ops.paged_attention_prefill(
        q[nd:], k_cache, v_cache, meta.prefill_block_tables, meta.prefill_query_start_loc, meta.prefill_context_lens, scale,
        *extra, **options
    )
    if nd == 0:
        return prefill
    return torch.cat((decode(), prefill))


def attend_latent(ops, q, latent, layer_cache, meta: AttentionMetadata, scale: float, value_width: int) -> torch.Tensor:
    """Multi-query attention over a latent cache (DeepSeek's MLA, models/deepseek.py): q [T, h, w]
    and the new tokens' latents [T, 1, w] -> [T, h, value_width]. layer_cache's kv is ONE plane
    [1, num_blocks, block_size, 1, w]: the keys, whose first value_width features are also the
    values. The kernels read the plane as both K and V and the output's last features are dropped."""
    kv, _ = layer_cache
    cache = kv[0]
    fp8 = cache.dtype == torch.float8_e4m3fn
    extra = (0, 0.0) if fp8 else ()  # a float8 cache: scales of 1 (no checkpoint scales for a latent)
    ops.write_kv_cache(latent, latent, cache, cache, meta.slot_mapping)  # the same plane twice: no separate V
    nd = meta.num_decode_tokens
    outs = []
    if nd:
        outs.append(ops.paged_attention_decode(q[:nd], cache, cache, meta.decode_block_tables, meta.decode_context_lens,
                                               scale, *extra))
    if nd < q.shape[0]:
        outs.append(ops.paged_attention_prefill(q[nd:], cache, cache, meta.prefill_block_tables,
                                                meta.prefill_query_start_loc, meta.prefill_context_lens, scale, *extra))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out[..., :value_width]

"""DeepSeek-V2/V3's multi-head latent attention (MLA) over a compressed paged KV cache.

Each token's keys and values are made from one latent: kv_a_proj_with_mqa gives c (kv_lora_rank
features, then RMSNorm) and k_pe (qk_rope_head_dim features, roped, shared by every head); the
per-head keys and values are kv_b_proj(c). The cache holds only [c, k_pe] per token: one "KV
head" of width kv_lora_rank + qk_rope_head_dim (vLLM's MLA), in one plane instead of a K and a
V plane. Attention runs on it as multi-query attention, for prefill and decode alike, with kv_b
absorbed (vLLM's weight absorption): each head's nope query goes into the latent space through
its W_UK (q_nope @ W_UK), so q·k = [q_nope W_UK, q_pe]·[c, k_pe]; the values are c itself (the
kernels read the same cache as V and the k_pe columns of the output are dropped), and each
head's W_UV maps its output back. The paged-attention kernels (torch and Triton) run unchanged.

Tensor parallel: the heads (q_proj/q_b_proj, kv_b_proj, o_proj) split over the ranks; the
latent projections, their norms and the cache are replicated. Interleaved RoPE (V2; V3's
rope_interleave) is turned into the half-split layout at load time by permuting the rope rows of
the query and latent projections, which changes neither q·k nor anything cached's meaning.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_rope_utils import yarn_apply_mscale

from shoal.runtime.distributed import SINGLE, ParallelState
from shoal.runtime.layers.attention import AttentionMetadata, attend_latent
from shoal.runtime.layers.linear import MergedColumnLinear, RowLinear


def _param(*shape) -> nn.Parameter:
    return nn.Parameter(torch.ones(*shape), requires_grad=False)


def rope_interleaved(cfg) -> bool:
    """V2 always rotates interleaved pairs (its complex RoPE); V3 when rope_interleave is set."""
    return cfg.model_type == "deepseek_v2" or bool(getattr(cfg, "rope_interleave", True))


def latent_cache_width(cfg) -> int:
    return cfg.kv_lora_rank + cfg.qk_rope_head_dim


class MlaAttention(nn.Module):
    def __init__(self, cfg, layer: int, state: ParallelState = SINGLE):
        super().__init__()
        heads, tp = cfg.num_attention_heads, state.tp_size
        if heads % tp:
            raise ValueError(f"{heads} attention heads cannot be split across {tp} tensor-parallel ranks")
        self.heads = heads // tp
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rank, self.eps = cfg.kv_lora_rank, cfg.rms_norm_eps
        qk = self.nope + self.rope_dim
        bias = bool(getattr(cfg, "attention_bias", False))
        self.q_lora_rank = cfg.q_lora_rank
        if self.q_lora_rank:  # replicated down-projection and norm, heads split in q_b_proj
            self.q_a_proj = MergedColumnLinear(cfg.hidden_size, [self.q_lora_rank], SINGLE, bias)
            self.q_a_layernorm = _param(self.q_lora_rank)
            self.q_b_proj = MergedColumnLinear(self.q_lora_rank, [heads * qk], state)
        else:  # V2-Lite: one plain query projection
            self.q_proj = MergedColumnLinear(cfg.hidden_size, [heads * qk], state)
        self.kv_a_proj_with_mqa = MergedColumnLinear(cfg.hidden_size, [self.rank + self.rope_dim], SINGLE, bias)
        self.kv_a_layernorm = _param(self.rank)
        # kv_b_proj split into its key half (absorbed into the query) and value half, per local head
        self.w_uk = _param(self.heads, self.nope, self.rank)
        self.w_uv = _param(self.heads, self.v_dim, self.rank)
        self.o_proj = RowLinear(heads * self.v_dim, cfg.hidden_size, state)
        self.o_bias = nn.Parameter(torch.zeros(cfg.hidden_size), requires_grad=False) if bias else None  # after the reduce
        self.scale = yarn_apply_mscale(cfg.rope_parameters or {}, qk**-0.5)
        self.interleaved = rope_interleaved(cfg)
        self.state = state

    def forward(self, ops, positions, x, kv_cache, meta: AttentionMetadata, rope):
        T, h = x.shape[0], self.heads
        if self.q_lora_rank:
            q = self.q_b_proj(ops.rms_norm(self.q_a_proj(x), self.q_a_layernorm, self.eps))
        else:
            q = self.q_proj(x)
        q = q.view(T, h, self.nope + self.rope_dim)
        q_nope, q_pe = q.split((self.nope, self.rope_dim), dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split((self.rank, self.rope_dim), dim=-1)
        c = ops.rms_norm(c.contiguous(), self.kv_a_layernorm, self.eps)
        q_pe, k_pe = ops.rotary_embedding(positions, q_pe, k_pe.reshape(T, 1, self.rope_dim), rope[""])
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)  # [T, h, rank]
        out = attend_latent(ops, torch.cat((q_latent, q_pe), -1), torch.cat((c[:, None], k_pe), -1), kv_cache, meta,
                            self.scale, self.rank)  # [T, h, rank]
        out = torch.bmm(out.transpose(0, 1), self.w_uv.transpose(1, 2)).transpose(0, 1)  # [T, h, v]
        out = self.o_proj(out.reshape(T, h * self.v_dim))
        return out if self.o_bias is None else out + self.o_bias

    def load(self, name: str, tensor: torch.Tensor) -> None:
        """`name` relative to self_attn, e.g. "kv_b_proj.weight" (the transformers names)."""
        module, kind = name.rsplit(".", 1)
        if kind not in ("weight", "bias"):  # e.g. V3's fp8 weight_scale_inv: its block scales are not read here
            raise ValueError(f"attention weight self_attn.{name!r}: quantized DeepSeek checkpoints are not supported")
        if module == "kv_b_proj":
            heads = self.w_uk.shape[0]
            first = self.state.tp_rank * heads
            per_head = tensor.view(-1, self.nope + self.v_dim, self.rank)[first : first + heads]
            self.w_uk.data.copy_(per_head[:, : self.nope])
            self.w_uv.data.copy_(per_head[:, self.nope :])
        elif module == "o_proj" and kind == "bias" and self.o_bias is not None:
            self.o_bias.data.copy_(tensor)
        elif module in ("q_a_layernorm", "kv_a_layernorm"):
            getattr(self, module).data.copy_(tensor)
        elif module in ("q_proj", "q_b_proj", "q_a_proj", "kv_a_proj_with_mqa", "o_proj") and hasattr(self, module):
            if self.interleaved and module in ("q_proj", "q_b_proj"):
                tensor = self._deinterleave(tensor.view(-1, self.nope + self.rope_dim, *tensor.shape[1:]), self.nope)
            elif self.interleaved and module == "kv_a_proj_with_mqa":
                tensor = self._deinterleave(tensor[None], self.rank)
            target = getattr(self, module)
            target.load(tensor, kind) if module == "o_proj" else target.load(tensor, 0, kind)
        else:
            raise ValueError(f"unexpected attention weight self_attn.{name!r}")

    def _deinterleave(self, rows: torch.Tensor, start: int) -> torch.Tensor:
        """rows [n, features, ...]: features from `start` on are rope pairs (x0, x1), (x2, x3), ...;
        reorder them as (x0, x2, ..., x1, x3, ...), the layout the half-split rotation expects."""
        order = torch.cat((torch.arange(0, self.rope_dim, 2), torch.arange(1, self.rope_dim, 2))) + start
        rows = rows.clone()
        rows[:, start:] = rows[:, order]
        return rows.flatten(0, 1)

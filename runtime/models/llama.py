"""Llama-family decoder (Llama, Mistral, Qwen2) over the paged KV cache.

Fused QKV and gate/up projections, RoPE with the config's scaling, RMSNorm with fused
residual adds, tied embeddings. Inputs are a flat batch of T tokens (no padding); a
pipeline stage holds only its own layers and passes (hidden, residual) on.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from shoal.runtime.distributed import SINGLE, ParallelState
from shoal.runtime.layers.attention import AttentionMetadata, attend
from shoal.runtime.layers.linear import MergedColumnLinear, QKVLinear, RowLinear, VocabEmbedding


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def rope_cache(cfg, max_positions: int) -> torch.Tensor:
    """[max_positions, head_dim] with cos in the first half and sin in the second, as
    transformers computes them (same inv_freq, same float32 product, same scaling)."""
    params = getattr(cfg, "rope_parameters", None) or {"rope_type": "default", "rope_theta": getattr(cfg, "rope_theta", 10000.0)}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        dim = int(head_dim_of(cfg) * getattr(cfg, "partial_rotary_factor", 1.0))
        inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        scaling = 1.0
    elif rope_type in ROPE_INIT_FUNCTIONS and rope_type != "dynamic":
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, torch.device("cpu"))
    else:
        raise ValueError(f"RoPE type {rope_type!r} is not supported")
    freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, ops, x, residual=None):
        return ops.rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(self, cfg, state: ParallelState):
        super().__init__()
        d = head_dim_of(cfg)
        bias = getattr(cfg, "attention_bias", cfg.model_type == "qwen2")
        self.qkv_proj = QKVLinear(cfg.hidden_size, d, cfg.num_attention_heads, cfg.num_key_value_heads, state, bias)
        self.o_proj = RowLinear(cfg.num_attention_heads * d, cfg.hidden_size, state)
        self.head_dim, self.scale = d, d**-0.5
        self.splits = self.qkv_proj.local_sizes

    def forward(self, ops, positions, x, kv_cache, meta: AttentionMetadata, cos_sin):
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.splits, dim=-1)
        q, k = ops.rotary_embedding(positions, q.view(T, -1, self.head_dim), k.view(T, -1, self.head_dim), cos_sin)
        out = attend(ops, q, k, v.view(T, -1, self.head_dim), kv_cache, meta, self.scale)
        return self.o_proj(out.view(T, -1))


class MLP(nn.Module):
    def __init__(self, cfg, state: ParallelState):
        super().__init__()
        bias = getattr(cfg, "mlp_bias", False)
        if cfg.hidden_act != "silu":
            raise ValueError(f"activation {cfg.hidden_act!r} is not supported (silu only)")
        self.gate_up_proj = MergedColumnLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, state, bias)
        self.down_proj = RowLinear(cfg.intermediate_size, cfg.hidden_size, state)

    def forward(self, ops, x):
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, state: ParallelState):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, state)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, state)

    def forward(self, ops, positions, x, residual, kv_cache, meta, cos_sin):
        if residual is None:
            residual, x = x, self.input_layernorm(ops, x)
        else:
            x, residual = self.input_layernorm(ops, x, residual)
        x = self.self_attn(ops, positions, x, kv_cache, meta, cos_sin)
        x, residual = self.post_attention_layernorm(ops, x, residual)
        return self.mlp(ops, x), residual


def balanced_split(cfg, pp_size: int) -> list[int]:
    """Layers per stage such that every stage holds about the same weights, the last one
    counting its LM head: a decode step reads them all, so that is what a stage's time
    follows. (The built-in model's LM head weighs as much as 8 of its layers: 19 + 11,
    which ran the public workload ~20% faster than 15 + 15 on PP2.)"""
    n = cfg.num_hidden_layers
    if pp_size == 1:
        return [n]
    heads = cfg.num_attention_heads + 2 * cfg.num_key_value_heads
    layer = cfg.hidden_size * (head_dim_of(cfg) * (heads + cfg.num_attention_heads) + 3 * cfg.intermediate_size)
    head = cfg.vocab_size * cfg.hidden_size
    share = (n * layer + head) / pp_size
    last = min(max(1, round((share - head) / layer)), n - (pp_size - 1))
    base, extra = divmod(n - last, pp_size - 1)  # the other stages: even
    return [base + (1 if s < extra else 0) for s in range(pp_size - 1)] + [last]


def stage_layers(cfg, state: ParallelState, split: list[int] | None = None) -> range:
    """The layers a pipeline stage holds: `split` layer counts per stage, else balanced_split."""
    num_layers = cfg.num_hidden_layers
    if split is None:
        split = balanced_split(cfg, state.pp_size)
    if len(split) != state.pp_size or sum(split) != num_layers or min(split) < 1:
        raise ValueError(f"cannot split {num_layers} layers as {split} over {state.pp_size} stages")
    start = sum(split[: state.pp_rank])
    return range(start, start + split[state.pp_rank])


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg, state: ParallelState = SINGLE, max_positions: int | None = None, layer_split=None):
        super().__init__()
        self.cfg, self.state = cfg, state
        self.layer_range = stage_layers(cfg, state, layer_split)
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, state) if state.is_first_stage else None
        self.layers = nn.ModuleList(DecoderLayer(cfg, state) for _ in self.layer_range)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if state.is_last_stage else None
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = None
        if state.is_last_stage:
            if self.tied and self.embed_tokens is not None:
                self.lm_head = self.embed_tokens
            else:
                self.lm_head = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, state)
        self.register_buffer("cos_sin", rope_cache(cfg, max_positions or cfg.max_position_embeddings), persistent=False)
        self.num_kv_heads = self.layers[0].self_attn.qkv_proj.local_kv_heads
        self.head_dim = head_dim_of(cfg)

    def forward(self, ops, input_ids, positions, kv_caches, meta, hidden=None, residual=None):
        """First stage: from token ids; later stages: from the previous stage's (hidden, residual).
        Returns (hidden, residual); the last stage's hidden is normed, ready for logits."""
        x = self.embed_tokens(input_ids) if hidden is None else hidden
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(ops, positions, x, residual, kv_cache, meta, self.cos_sin)
        if self.norm is not None:
            x, _ = self.norm(ops, x, residual)
            residual = None
        return x, residual

    def compute_logits(self, hidden):
        return self.lm_head.logits(hidden)

    def load_weights(self, weights) -> None:
        """Take (Hugging Face name, full tensor) pairs; keep only this rank's shard."""
        first = self.layer_range.start
        fused = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "gate_proj": 0, "up_proj": 1}
        loaded = set()
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            if name == "model.embed_tokens.weight":
                if self.embed_tokens is not None:
                    self.embed_tokens.load(tensor)
                if self.lm_head is not None and self.tied and self.lm_head is not self.embed_tokens:
                    self.lm_head.load(tensor)
            elif name == "lm_head.weight":
                if self.lm_head is not None and not self.tied:
                    self.lm_head.load(tensor)
            elif name == "model.norm.weight":
                if self.norm is not None:
                    self.norm.weight.data.copy_(tensor)
            elif name.startswith("model.layers."):
                index, rest = name[len("model.layers.") :].split(".", 1)
                if int(index) not in self.layer_range:
                    continue
                layer = self.layers[int(index) - first]
                module_name, kind = rest.rsplit(".", 1)  # e.g. self_attn.q_proj, weight
                parent, leaf = module_name.rsplit(".", 1) if "." in module_name else ("", module_name)
                if leaf in fused:
                    target = layer.self_attn.qkv_proj if parent == "self_attn" else layer.mlp.gate_up_proj
                    target.load(tensor, fused[leaf], is_bias=kind == "bias")
                elif leaf in ("o_proj", "down_proj"):
                    layer.get_submodule(module_name).load(tensor)
                else:  # the two layer norms
                    layer.get_submodule(module_name).weight.data.copy_(tensor)
            else:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            loaded.add(name)
        if not any(n.startswith("model.layers.") for n in loaded):
            raise ValueError("the checkpoint held no decoder layer weights")

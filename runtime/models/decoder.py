"""The decoder-only transformer over the paged KV cache, for every dense family Shoal runs.

Llama's shape (fused QKV and gate/up projections, RoPE, RMSNorm with fused residual adds,
tied or untied embeddings), with what each family changes read from its DecoderSpec
(families.py): Gemma's sandwich norms as (1 + w), GeGLU and soft-caps, q/k norms (Qwen3,
Gemma 3, OLMo 2), OLMo 2's post-norms, Granite's multipliers, Phi-3's fused checkpoint
and LongRoPE, sliding windows per layer with their own RoPE (Gemma 3), and mixture-of-experts
blocks in place of the MLP (Mixtral, Qwen2/3-MoE, gpt-oss, DeepSeek: layers/moe.py), gpt-oss's
attention sinks and o_proj bias, DeepSeek's latent attention over a one-plane latent cache
(deepseek.py). Inputs are a flat
batch of T tokens (no padding); a pipeline stage holds only its own layers and passes
(hidden, residual) on.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from shoal.runtime.distributed import SINGLE, ParallelState, tp_all_reduce
from shoal.runtime.layers.attention import AttentionMetadata, attend
from shoal.runtime.layers.linear import PLAIN, MergedColumnLinear, QKVLinear, RowLinear, VocabEmbedding
from shoal.runtime.layers.moe import SparseMoeBlock
from shoal.runtime.models.deepseek import MlaAttention, latent_cache_width
from shoal.runtime.models.families import DecoderSpec, spec_of
from shoal.runtime.models.kv_groups import layer_places


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _rope_params(cfg, layer_type: str) -> dict:
    params = getattr(cfg, "rope_parameters", None) or {"rope_type": "default", "rope_theta": getattr(cfg, "rope_theta", 10000.0)}
    return params[layer_type] if layer_type else params


def _table(inv_freq: torch.Tensor, scaling: float, max_positions: int) -> torch.Tensor:
    freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1)


def rope_cache(cfg, max_positions: int, layer_type: str = "") -> torch.Tensor:
    """[max_positions, rotary_dim] with cos in the first half and sin in the second, as
    transformers computes them (same inv_freq, same float32 product, same scaling).

    LongRoPE (Phi-3) switches to its long factors once a sequence passes the original
    context, as transformers' dynamic update does at each step: rows from that position on
    come from the long table. (transformers also re-rotates a whole prompt longer than the
    original context with the long factors; here its first rows keep the short ones.)"""
    params = _rope_params(cfg, layer_type)
    rope_type = params.get("rope_type", "default")
    kwargs = {"layer_type": layer_type} if layer_type else {}
    if rope_type == "default":
        factor = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
        dim = int(head_dim_of(cfg) * factor)
        inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return _table(inv_freq, 1.0, max_positions)
    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
        raise ValueError(f"RoPE type {rope_type!r} is not supported")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, torch.device("cpu"), **kwargs)
    table = _table(inv_freq, scaling, max_positions)
    if rope_type == "longrope":
        original = params.get("original_max_position_embeddings") or cfg.original_max_position_embeddings
        if max_positions > original:
            long_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](cfg, torch.device("cpu"), seq_len=original + 1, **kwargs)
            table[original:] = _table(long_freq, scaling, max_positions)[original:]
    return table


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, ops, x, residual=None):
        return ops.rms_norm(x, self.weight, self.eps, residual)


class AllHeadsNorm(nn.Module):
    """OLMo 2's q/k norm: RMSNorm over every head of the projection at once, so with tensor
    parallelism the mean square is summed over the ranks (`replicas`: ranks holding the same
    KV head count it once)."""

    def __init__(self, local_size: int, total_size: int, eps: float, state: ParallelState, replicas: int = 1):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(local_size), requires_grad=False)
        self.eps, self.total, self.state, self.replicas = eps, total_size, state, replicas

    def forward(self, x):
        xf = x.float()
        squares = xf.pow(2).sum(-1, keepdim=True)
        if self.state.tp_size > 1:
            squares = tp_all_reduce(squares, self.state) / self.replicas
        return (xf * torch.rsqrt(squares / self.total + self.eps)).to(x.dtype) * self.weight


def plain_methods(name: str):
    """Every linear layer unquantized (`method_for` of an unquantized model)."""
    return PLAIN


class Attention(nn.Module):
    def __init__(self, cfg, spec: DecoderSpec, layer: int, state: ParallelState, method_for=plain_methods):
        super().__init__()
        d = head_dim_of(cfg)
        prefix = f"model.layers.{layer}.self_attn"
        self.qkv_proj = QKVLinear(cfg.hidden_size, d, cfg.num_attention_heads, cfg.num_key_value_heads, state, spec.qkv_bias,
                                  method=method_for(f"{prefix}.qkv_proj"))
        self.o_proj = RowLinear(cfg.num_attention_heads * d, cfg.hidden_size, state, method=method_for(f"{prefix}.o_proj"),
                                bias=spec.o_bias)
        self.head_dim = d
        self.scale = spec.attn_scale if spec.attn_scale is not None else d**-0.5
        self.window, self.softcap = spec.windows[layer], spec.attn_softcap
        self.kv_scales = (1.0, 1.0)  # a float8 KV cache's (k_scale, v_scale): the checkpoint's, else 1.0 as vLLM
        self.rope_key = spec.rope_keys[layer]
        self.splits = self.qkv_proj.local_sizes
        # gpt-oss: one sink logit per query head; this rank's heads (loaded as q_proj's rows)
        self.sinks = nn.Parameter(torch.zeros(self.splits[0] // d), requires_grad=False) if spec.attn_sinks else None
        self.qk_norm = spec.qk_norm
        eps = cfg.rms_norm_eps
        if spec.qk_norm == "head":
            self.q_norm, self.k_norm = RMSNorm(d, eps), RMSNorm(d, eps)
        elif spec.qk_norm == "all":
            kvh, tp = cfg.num_key_value_heads, state.tp_size
            self.q_norm = AllHeadsNorm(self.splits[0], cfg.num_attention_heads * d, eps, state)
            self.k_norm = AllHeadsNorm(self.splits[1], kvh * d, eps, state, replicas=max(1, tp // kvh))

    def forward(self, ops, positions, x, kv_cache, meta: AttentionMetadata, rope):
        T, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split(self.splits, dim=-1)
        if self.qk_norm == "all":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.view(T, -1, d), k.view(T, -1, d)
        if self.qk_norm == "head":
            q, k = self.q_norm(ops, q), self.k_norm(ops, k)
        cos_sin = rope[self.rope_key]
        rd = cos_sin.shape[-1]
        if rd == d:
            q, k = ops.rotary_embedding(positions, q, k, cos_sin)
        else:  # partial rotary (Phi-4-mini): the first rd features of each head turn
            qr, kr = ops.rotary_embedding(positions, q[..., :rd], k[..., :rd], cos_sin)
            q, k = torch.cat((qr, q[..., rd:]), -1), torch.cat((kr, k[..., rd:]), -1)
        out = attend(ops, q, k, v.view(T, -1, d), kv_cache, meta, self.scale, self.window, self.softcap, self.kv_scales,
                     self.sinks)
        return self.o_proj(out.view(T, -1))


class MLP(nn.Module):
    def __init__(self, cfg, spec: DecoderSpec, layer: int, state: ParallelState, method_for=plain_methods):
        super().__init__()
        prefix = f"model.layers.{layer}.mlp"
        self.gate_up_proj = MergedColumnLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, state, spec.mlp_bias,
                                               method=method_for(f"{prefix}.gate_up_proj"))
        self.down_proj = RowLinear(cfg.intermediate_size, cfg.hidden_size, state, method=method_for(f"{prefix}.down_proj"))
        self.gelu = spec.activation == "gelu_tanh"

    def forward(self, ops, x):
        h = self.gate_up_proj(x)
        return self.down_proj(ops.gelu_tanh_and_mul(h) if self.gelu else ops.silu_and_mul(h))


class DecoderLayer(nn.Module):
    """(x, residual) in and out: the residual stream is x + residual, added lazily by the next
    norm (RMSNorm's fused add); residual None means x is the stream itself."""

    def __init__(self, cfg, spec: DecoderSpec, layer: int, state: ParallelState, method_for=plain_methods):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.norms, self.residual_scale = spec.norms, spec.residual_scale
        if spec.norms != "post":
            self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.self_attn = MlaAttention(cfg, layer, state) if spec.mla else Attention(cfg, spec, layer, state, method_for)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        if spec.norms == "sandwich":
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)
        if spec.norms != "pre":
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.mlp = (SparseMoeBlock.from_config(cfg, state, method_for=method_for, prefix=f"model.layers.{layer}.mlp")
                    if spec.moe_layers[layer]
                    else MLP(cfg, spec, layer, state, method_for))

    def forward(self, ops, positions, x, residual, kv_cache, meta, rope):
        if self.norms == "post":  # OLMo 2: stream + norm(attn(stream)), then the same with the MLP
            stream = x if residual is None else x + residual
            h = self.post_attention_layernorm(ops, self.self_attn(ops, positions, stream, kv_cache, meta, rope))
            stream = stream + h
            return self.post_feedforward_layernorm(ops, self.mlp(ops, stream)), stream
        if residual is None:
            residual, x = x, self.input_layernorm(ops, x)
        else:
            x, residual = self.input_layernorm(ops, x, residual)
        x = self.self_attn(ops, positions, x, kv_cache, meta, rope)
        if self.norms == "sandwich":  # Gemma: norm the block's output before it joins the stream
            x = self.post_attention_layernorm(ops, x)
            x, residual = self.pre_feedforward_layernorm(ops, x, residual)
            return self.post_feedforward_layernorm(ops, self.mlp(ops, x)), residual
        if self.residual_scale != 1.0:
            x = x * self.residual_scale
        x, residual = self.post_attention_layernorm(ops, x, residual)
        x = self.mlp(ops, x)
        return (x * self.residual_scale if self.residual_scale != 1.0 else x), residual


def balanced_split(cfg, pp_size: int) -> list[int]:
    """Layers per stage such that every stage holds about the same weights, the last one
    counting its LM head: a decode step reads them all, so that is what a stage's time
    follows. (The built-in model's LM head weighs as much as 8 of its layers: 19 + 11,
    which ran the public workload ~20% faster than 15 + 15 on PP2.)"""
    n = cfg.num_hidden_layers
    if pp_size == 1:
        return [n]
    heads = cfg.num_attention_heads + 2 * cfg.num_key_value_heads
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None) or 0  # MoE: all experts held
    width = experts * getattr(cfg, "moe_intermediate_size", cfg.intermediate_size) if experts else cfg.intermediate_size
    layer = cfg.hidden_size * (head_dim_of(cfg) * (heads + cfg.num_attention_heads) + 3 * width)
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


KV_SCALES = {"k_scale": (0,), "v_scale": (1,), "kv_scale": (0, 1)}  # checkpoint name -> which of (k, v) it scales


class DecoderForCausalLM(nn.Module):
    """`method_for(name)` gives each linear layer its LinearMethod by its fused name (e.g.
    model.layers.3.self_attn.qkv_proj): how a quantized checkpoint's tensors are held."""

    def __init__(self, cfg, state: ParallelState = SINGLE, max_positions: int | None = None, layer_split=None,
                 method_for=plain_methods):
        super().__init__()
        self.cfg, self.state = cfg, state
        self.spec = spec = spec_of(cfg)
        self.layer_range = stage_layers(cfg, state, layer_split)
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, state) if state.is_first_stage else None
        self.layers = nn.ModuleList(DecoderLayer(cfg, spec, i, state, method_for) for i in self.layer_range)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if state.is_last_stage else None
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = None
        if state.is_last_stage:
            if self.tied and self.embed_tokens is not None:
                self.lm_head = self.embed_tokens
            else:
                self.lm_head = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, state)
        # RoPE tables stay float32 whatever the model's dtype (plain attributes: .to(dtype) skips
        # them), made where the model is built (the caller's torch.device)
        device = torch.empty(0).device
        positions = max_positions or cfg.max_position_embeddings
        self.rope = {key: rope_cache(cfg, positions, key).to(device) for key in sorted(set(spec.rope_keys))}
        self.cos_sin = self.rope[spec.rope_keys[0]]  # the one table of a plain model (the C decode step's)
        # the KV cache per layer: kv_planes (K and V, or MLA's one latent plane) x num_kv_heads x head_dim
        if spec.mla:
            self.kv_planes, self.num_kv_heads, self.head_dim = 1, 1, latent_cache_width(cfg)
        else:
            self.kv_planes, self.num_kv_heads = 2, self.layers[0].self_attn.qkv_proj.local_kv_heads
            self.head_dim = head_dim_of(cfg)
        # KV-cache groups (kv_groups.py): each layer reads its group's block table and writes its
        # slot's KV tensor; this stage holds the tensors of the slots its layers use
        places = [layer_places(spec.windows)[i] for i in self.layer_range]
        slots = sorted({slot for _, slot in places})
        self.kv_groups = [group for group, _ in places]
        self.kv_slots = [slots.index(slot) for _, slot in places]
        self.num_kv_tensors = len(slots)

    @property
    def windowed(self) -> bool:
        """Whether any layer attends through a sliding window, soft-caps its scores or has sinks."""
        return any(getattr(layer.self_attn, "window", 0) or getattr(layer.self_attn, "softcap", 0)
                   or getattr(layer.self_attn, "sinks", None) is not None for layer in self.layers)

    def forward(self, ops, input_ids, positions, kv_caches, meta, hidden=None, residual=None):
        """First stage: from token ids; later stages: from the previous stage's (hidden, residual).
        kv_caches: per layer (its slot's KV tensor, its decode workspace). Returns (hidden, residual); the last stage's hidden is normed, ready for logits."""
        if hidden is None:
            x = self.embed_tokens(input_ids)
            scale = self.spec.embed_scale
            if scale != 1.0:  # Gemma rounds the scale to the model's dtype first, as transformers does
                x = x * (torch.tensor(scale, dtype=x.dtype) if self.spec.norm_offset else scale)
        else:
            x = hidden
        metas = meta.per_group()
        for layer, kv_cache, group in zip(self.layers, kv_caches, self.kv_groups):
            x, residual = layer(ops, positions, x, residual, kv_cache, metas[group], self.rope)
        if self.norm is not None:
            x, _ = self.norm(ops, x, residual)
            residual = None
        return x, residual

    def compute_logits(self, hidden):
        logits = self.lm_head.logits(hidden)
        if self.spec.logit_scale != 1.0:
            logits = logits * self.spec.logit_scale
        if self.spec.logit_softcap:
            cap = self.spec.logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights) -> None:
        """Take (Hugging Face name, full tensor) pairs; keep only this rank's shard."""
        first = self.layer_range.start
        fused = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "gate_proj": 0, "up_proj": 1}
        offset = self.spec.norm_offset
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
                    self.norm.weight.data.copy_(tensor + offset)
            elif name.startswith("model.layers."):
                index, rest = name[len("model.layers.") :].split(".", 1)
                if int(index) not in self.layer_range:
                    continue
                self._load_layer(self.layers[int(index) - first], rest, tensor, fused, offset)
            else:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            loaded.add(name)
        if not any(n.startswith("model.layers.") for n in loaded):
            raise ValueError("the checkpoint held no decoder layer weights")
        for layer in self.layers:
            if isinstance(layer.mlp, SparseMoeBlock):
                layer.mlp.experts.check_loaded()

    def _load_layer(self, layer, rest: str, tensor, fused: dict, offset: float) -> None:
        if isinstance(layer.self_attn, MlaAttention) and rest.startswith("self_attn."):
            layer.self_attn.load(rest[len("self_attn."):], tensor)
            return
        if isinstance(layer.mlp, SparseMoeBlock) and rest.startswith(("mlp.", "block_sparse_moe.")):
            layer.mlp.load(rest.split(".", 1)[1], tensor)  # router, experts, shared expert (Mixtral: block_sparse_moe)
            return
        module_name, kind = rest.rsplit(".", 1)  # e.g. self_attn.q_proj, weight
        parent, leaf = module_name.rsplit(".", 1) if "." in module_name else ("", module_name)
        attn = layer.self_attn
        if kind in KV_SCALES and module_name == "self_attn":  # a float8 KV cache's scales (compressed-tensors)
            scales = list(attn.kv_scales)
            for i in KV_SCALES[kind]:
                scales[i] = float(tensor.float().max())
            attn.kv_scales = tuple(scales)
            return
        if module_name == "self_attn" and kind == "sinks" and attn.sinks is not None:  # gpt-oss: this rank's heads
            _, start, count = attn.qkv_proj._rows(0)
            attn.sinks.data.copy_(tensor[start // attn.head_dim : (start + count) // attn.head_dim])
            return
        if kind in ("k_scale", "v_scale", "q_scale", "prob_scale") or (leaf in ("k_proj", "v_proj") and kind == "output_scale"):
            return  # attention scales Shoal does not use (fp8 attention math), or the older k_proj.output_scale
        if leaf in fused:
            target = attn.qkv_proj if parent == "self_attn" else layer.mlp.gate_up_proj
            target.load(tensor, fused[leaf], kind)
        elif leaf == "qkv_proj":  # Phi-3: Q, K and V stacked on disk
            for shard, part in enumerate(tensor.split(attn.qkv_proj.output_sizes)):
                attn.qkv_proj.load(part, shard, kind)
        elif leaf == "gate_up_proj":  # Phi-3: gate and up stacked on disk
            for shard, part in enumerate(tensor.chunk(2)):
                layer.mlp.gate_up_proj.load(part, shard, kind)
        elif leaf in ("o_proj", "down_proj"):
            layer.get_submodule(module_name).load(tensor, kind)
        elif leaf in ("q_norm", "k_norm") and attn.qk_norm == "all":  # this rank's heads of the norm
            proj = attn.qkv_proj
            shard = 0 if leaf == "q_norm" else 1
            _, start, count = proj._rows(shard)
            getattr(attn, leaf).weight.data.copy_(tensor[start : start + count])
        else:  # the layer norms, and per-head q/k norms
            layer.get_submodule(module_name).weight.data.copy_(tensor + offset)

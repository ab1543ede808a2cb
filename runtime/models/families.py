"""Which architectures Shoal runs, and what each family changes in the one decoder.

A family is a handful of switches on the Llama-shaped decoder in decoder.py, read from its
Hugging Face config the way transformers reads them: where the norms sit and whether they
scale by (1 + w), q/k norms, the activation, multipliers, soft-caps, which layers attend
through a sliding window and with which RoPE, which layers route through experts, attention
sinks and an o_proj bias (gpt-oss), whether attention is DeepSeek's latent one. `spec_of(cfg)`
is the only place a model
type is named; the decoder asks the spec, never the model type.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

# architecture -> model_type, for configs that name only one of them
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Phi3ForCausalLM": "phi3",
    "GraniteForCausalLM": "granite",
    "Olmo2ForCausalLM": "olmo2",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "GptOssForCausalLM": "gpt_oss",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}


# families whose o_proj takes a bias with attention_bias, as transformers builds them (Qwen2,
# Qwen2-MoE, Mistral, Mixtral and Phi-3 never give it one)
O_BIAS = {"llama", "qwen3", "qwen3_moe", "gemma2", "gemma3_text", "granite", "olmo2", "gpt_oss"}


@dataclass
class DecoderSpec:
    norms: str = "pre"  # "pre": before attention and MLP (Llama); "sandwich": before and after (Gemma); "post": after only (OLMo 2)
    norm_offset: float = 0.0  # Gemma: a norm's weight w is applied as (offset + w)
    qk_norm: str = ""  # "head": RMSNorm over each head (Qwen3, Gemma 3); "all": over all heads at once (OLMo 2)
    activation: str = "silu"  # "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    qkv_bias: bool = False
    mlp_bias: bool = False
    fused_checkpoint: bool = False  # Phi-3: qkv_proj and gate_up_proj are already fused on disk
    embed_scale: float = 1.0  # Gemma: sqrt(hidden), rounded to the model's dtype; Granite: embedding_multiplier
    residual_scale: float = 1.0  # Granite: residual_multiplier on each block's output
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float = 0.0  # Gemma 2
    logit_softcap: float = 0.0  # Gemma 2's final_logit_softcapping
    logit_scale: float = 1.0  # Granite: 1 / logits_scaling
    windows: list[int] = field(default_factory=list)  # per layer: 0 (global) or its sliding window
    rope_keys: list[str] = field(default_factory=list)  # per layer: which RoPE table (see decoder.rope_tables)
    moe_layers: list[bool] = field(default_factory=list)  # per layer: a sparse mixture-of-experts block for its MLP
    attn_sinks: bool = False  # gpt-oss: a learned logit per head in each attention softmax's denominator
    o_bias: bool = False  # o_proj has a bias (attention_bias in the families of O_BIAS)
    mla: bool = False  # DeepSeek's multi-head latent attention (models/deepseek.py), a latent KV cache
    moe_router: str = ""  # "softmax": softmax over every expert, then top-k (Mixtral, Qwen2/3-MoE); "": another or none

    @property
    def plain(self) -> bool:
        """A Llama-shaped model."""
        return (self.norms == "pre" and not self.norm_offset and not self.qk_norm and self.activation == "silu"
                and not self.fused_checkpoint and self.embed_scale == 1.0 and self.residual_scale == 1.0
                and self.attn_scale is None and not self.attn_softcap and not self.logit_softcap
                and self.logit_scale == 1.0 and not any(self.windows) and len(set(self.rope_keys)) <= 1
                and not any(self.moe_layers) and not self.attn_sinks and not self.o_bias and not self.mla)

    @property
    def c_step(self) -> bool:
        """The C decode step (models/cpu_llama.c) runs it: Llama's shape, or Qwen3's per-head q/k norms on
        it, with MLPs or experts routed by softmax and top-k (Mixtral, Qwen2/3-MoE, Qwen2-MoE's gated
        shared expert too) in any layers."""
        moe_ok = not any(self.moe_layers) or self.moe_router == "softmax"
        return self.qk_norm in ("", "head") and moe_ok and replace(self, qk_norm="", moe_layers=[]).plain


def model_type_of(raw: dict) -> str | None:
    """The model_type of a config.json dict, if Shoal runs it (the model_type wins, as in
    transformers' Auto classes; a config naming only an architecture gets that one's)."""
    model_type = raw.get("model_type")
    if model_type:
        return model_type if model_type in ARCHITECTURES.values() else None
    return next((ARCHITECTURES[a] for a in raw.get("architectures") or [] if a in ARCHITECTURES), None)


def _layer_types(cfg) -> list[str]:
    """"sliding_attention" or "full_attention" per layer, as transformers decides them."""
    n = cfg.num_hidden_layers
    types = getattr(cfg, "layer_types", None)
    if types:
        return list(types)
    # Mistral and Phi-3 name no layer types: a sliding_window bounds every layer
    return ["sliding_attention" if getattr(cfg, "sliding_window", None) else "full_attention"] * n


def spec_of(cfg) -> DecoderSpec:
    t = cfg.model_type
    layer_types = _layer_types(cfg)
    window = int(getattr(cfg, "sliding_window", None) or 0)
    if t == "qwen2" and not getattr(cfg, "use_sliding_window", False):
        window = 0  # Qwen2 configs carry a sliding_window that only use_sliding_window turns on
    spec = DecoderSpec(
        qkv_bias=bool(getattr(cfg, "attention_bias", getattr(cfg, "qkv_bias", t == "qwen2"))),  # Qwen2-MoE: qkv_bias
        o_bias=bool(getattr(cfg, "attention_bias", False)) and t in O_BIAS,
        mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
        windows=[window if lt == "sliding_attention" else 0 for lt in layer_types],
        rope_keys=[lt if lt in _per_type_rope(cfg) else "" for lt in layer_types],
        moe_layers=_moe_layers(cfg),
        moe_router="softmax" if t in ("mixtral", "qwen2_moe", "qwen3_moe") else "",
    )
    if t in ("qwen3", "qwen3_moe"):
        spec.qk_norm = "head"
    elif t in ("gemma2", "gemma3_text"):
        spec.norms, spec.norm_offset, spec.activation = "sandwich", 1.0, "gelu_tanh"
        spec.embed_scale = cfg.hidden_size**0.5
        spec.attn_scale = cfg.query_pre_attn_scalar**-0.5
        spec.attn_softcap = float(getattr(cfg, "attn_logit_softcapping", None) or 0.0)
        spec.logit_softcap = float(getattr(cfg, "final_logit_softcapping", None) or 0.0)
        if t == "gemma3_text":
            spec.qk_norm = "head"
    elif t == "phi3":
        spec.fused_checkpoint = True
    elif t == "granite":
        spec.embed_scale = cfg.embedding_multiplier
        spec.residual_scale = cfg.residual_multiplier
        spec.attn_scale = cfg.attention_multiplier
        spec.logit_scale = 1.0 / cfg.logits_scaling
    elif t == "olmo2":
        spec.norms, spec.qk_norm = "post", "all"
    elif t == "gpt_oss":
        spec.attn_sinks = True
    elif t in ("deepseek_v2", "deepseek_v3"):
        spec.mla, spec.qkv_bias = True, False  # attention_bias is MLA's own (kv_a_proj, q_a_proj)
    activation = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "silu")
    expected = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}[spec.activation]
    if activation != expected and not (spec.activation == "gelu_tanh" and activation == "gelu_tanh"):
        raise ValueError(f"activation {activation!r} is not supported for {t} (expected {expected!r})")
    return spec


def _moe_layers(cfg) -> list[bool]:
    """Which layers hold a mixture-of-experts block, as transformers builds them: every one in
    Mixtral; in Qwen2/3-MoE those past `mlp_only_layers` on every `decoder_sparse_step`-th."""
    n = cfg.num_hidden_layers
    if cfg.model_type in ("mixtral", "gpt_oss"):
        return [True] * n
    if cfg.model_type in ("qwen2_moe", "qwen3_moe"):
        dense = set(cfg.mlp_only_layers or [])
        return [i not in dense and cfg.num_experts > 0 and (i + 1) % cfg.decoder_sparse_step == 0 for i in range(n)]
    if cfg.model_type in ("deepseek_v2", "deepseek_v3"):  # dense before first_k_dense_replace, then sparse
        return [i >= (cfg.first_k_dense_replace or 0) and cfg.n_routed_experts > 0 for i in range(n)]
    return [False] * n


def _per_type_rope(cfg) -> dict:
    """Gemma 3's rope_parameters hold one entry per layer type; other families one for all."""
    params = getattr(cfg, "rope_parameters", None) or {}
    return {k: v for k, v in params.items() if k in ("sliding_attention", "full_attention") and isinstance(v, dict)}

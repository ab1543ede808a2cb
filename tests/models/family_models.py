"""Tiny random-weight models of every dense family, made with transformers, and the
reference they are checked against (transformers' own greedy generate and log-probs).

Each config turns on what its family changes (sliding windows shorter than the prompts,
soft-caps small enough to bite, multipliers far from 1, partial rotary with LongRoPE,
per-layer-type RoPE), and every norm weight is randomized so that Gemma's (1 + w) and the
q/k norms matter. (Phi-3's sequences stay inside its original context: past it, transformers
drops its cache and re-rotates every key with the long factors, which a paged cache does not
do; test_families checks the long table itself.)
"""

from __future__ import annotations

import random
import shutil

import torch

BASE = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.2,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)

FAMILIES = {
    "mistral": dict(sliding_window=8),
    "qwen2": dict(use_sliding_window=True, sliding_window=12, max_window_layers=1, num_hidden_layers=3),
    "qwen3": dict(head_dim=32, tie_word_embeddings=True),
    "gemma2": dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=3.0,
                   final_logit_softcapping=5.0, hidden_activation="gelu_pytorch_tanh", num_hidden_layers=3,
                   tie_word_embeddings=True),
    "gemma3_text": dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8, num_hidden_layers=3,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}},
                        tie_word_embeddings=True),
    "phi3": dict(original_max_position_embeddings=80, max_position_embeddings=256,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                  "original_max_position_embeddings": 80,
                                  "short_factor": [1.0 + 0.1 * i for i in range(6)],
                                  "long_factor": [1.5 + 0.5 * i for i in range(6)]}),
    "granite": dict(embedding_multiplier=6.0, residual_multiplier=0.3, attention_multiplier=0.2, logits_scaling=4.0,
                    attention_bias=True),  # q/k/v and o_proj biased, as Llama-shaped families do with it
    "olmo2": dict(),
}

# gpt-oss (tests/models/test_moe_models.py): sliding and full layers alternating, YaRN past a
# short original context, 6 experts of which each token takes 2
GPT_OSS = dict(head_dim=16, num_local_experts=6, num_experts_per_tok=2, intermediate_size=32, sliding_window=8,
               num_hidden_layers=3, rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                                     "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                     "original_max_position_embeddings": 64})


@torch.no_grad()
def make_gpt_oss_model(path, builtin_dir, **overrides):
    """A random gpt-oss whose sinks, router and expert biases are far from their zero init and
    whose expert activations pass the SwiGLU clamp (|x| > 7), so that each of them shows."""
    path, model = make_family_model(path, builtin_dir, "gpt_oss", **{**GPT_OSS, **overrides})
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if name.endswith(("sinks", "_bias", "router.bias", "o_proj.bias")):
            p.copy_(torch.randn_like(p))
        elif name.endswith("experts.gate_up_proj"):
            p.mul_(4)
    model.save_pretrained(path)
    return path, model


def make_family_model(path, builtin_dir, model_type: str, shard: bool = False, **overrides):
    """A random model of `model_type` saved as an HF directory with the built-in tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {**BASE, **FAMILIES.get(model_type, {}), **overrides}  # other families: give every field
    cfg = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):  # ones (or zeros: Gemma's 1 + w, biases) would hide one applied wrongly
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(path, **({"max_shard_size": "2MB"} if shard else {}))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (builtin_dir / name).exists():
            shutil.copy(builtin_dir / name, path / name)
    return path, model


# DeepSeek-V2/V3 (tests/models/test_deepseek_models.py says what each varies)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0,
        "beta_fast": 32, "beta_slow": 1}
ATTN = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8)
DEEPSEEK = {
    "deepseek_v2": dict(**ATTN, q_lora_rank=None, attention_bias=True, v_head_dim=12, n_routed_experts=8,
                        num_experts_per_tok=3, n_group=4, topk_group=2, topk_method="group_limited_greedy",
                        routed_scaling_factor=1.5, n_shared_experts=2, moe_intermediate_size=32, first_k_dense_replace=1,
                        num_hidden_layers=3,
                        rope_parameters={**YARN, "mscale": 0.707, "mscale_all_dim": 0.707}),
    "deepseek_v3": dict(**ATTN, q_lora_rank=24, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                        topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, n_shared_experts=1,
                        moe_intermediate_size=32, first_k_dense_replace=1, num_hidden_layers=3, rope_interleave=True,
                        rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 0.8}),
}


def make_deepseek_model(path, builtin_dir, model_type: str, **overrides):
    """V3's e_score_correction_bias and V2's attention biases random (zeros at init would hide them)."""
    path, model = make_family_model(path, builtin_dir, model_type, **{**DEEPSEEK[model_type], **overrides})
    torch.manual_seed(1)
    with torch.no_grad():
        for name, b in [*model.named_buffers(), *model.named_parameters()]:
            if name.endswith(("e_score_correction_bias", "self_attn.kv_a_proj_with_mqa.bias", "self_attn.o_proj.bias")):
                b.copy_(torch.randn_like(b) * 0.3)
    model.save_pretrained(path)
    return path, model


def mixed_prompts(n: int = 8, seed: int = 3) -> list[list[int]]:
    """Prompts of mixed length, most longer than the sliding windows above, one of one token."""
    rng = random.Random(seed)
    lengths = [1, 5, 9, 17, 23, 30, 36, 41][:n]
    return [[rng.randrange(100, 40000) for _ in range(k)] for k in lengths]


@torch.inference_mode()
def hf_reference(model, prompts, max_new_tokens: int):
    """transformers' greedy tokens for each prompt alone, and its first-step log-probabilities."""
    tokens, first = [], []
    for ids in prompts:
        x = torch.tensor([ids])
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
        tokens.append(out[0, len(ids):].tolist())
        first.append(torch.log_softmax(model(x).logits[0, -1].double(), -1))
    return tokens, first


def check_against_reference(llm, family, max_new_tokens: int) -> None:
    """Run the family's prompts greedily through `llm` (then shut it down) and assert
    transformers' tokens and first-step log-probabilities within 1e-4."""
    from shoal import SamplingParams

    model_type, _, prompts, want, first = family
    try:
        params = SamplingParams(max_tokens=max_new_tokens, min_tokens=max_new_tokens, temperature=0.0, logprobs=5)
        outs = llm.generate(prompts, params)
    finally:
        llm.engine.shutdown()
    got = [o.outputs[0].token_ids for o in outs]
    assert got == want, f"{model_type}: {sum(g != w for g, w in zip(got, want))} of {len(want)} sequences differ"
    for o, ref in zip(outs, first):
        for token, logprob in o.outputs[0].logprobs[0].items():
            value = logprob.logprob if hasattr(logprob, "logprob") else logprob
            assert abs(value - float(ref[token])) < 1e-4, (model_type, token, value, float(ref[token]))

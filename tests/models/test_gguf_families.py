"""Qwen3, Qwen3-MoE, Gemma 3 and Phi-3 load from a .gguf as Llama does: a tiny random model of each,
saved by transformers, written into a GGUF the way llama.cpp's convert_hf_to_gguf.py lays it out
(its metadata keys, its tensor names, Gemma's norms stored as 1 + w, experts stacked into 3-D
tensors, Phi-3's LongRoPE factors as tensors, matrices in F16), is converted by Shoal and gives transformers' greedy
tokens and first-step log-probabilities on the original weights (float32, CPU, torch backend)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from family_models import FAMILIES, check_against_reference, hf_reference, make_family_model, mixed_prompts
from shoal import LLM
from shoal.runtime.models.gguf_convert import convert_gguf
from shoal.runtime.models.loader import builtin_gguf_path, iter_weights, resolve_model

MAX_NEW = 16

# model_type -> (llama.cpp architecture, what the tiny model turns on)
GGUF_FAMILIES = {
    "qwen3": ("qwen3", FAMILIES["qwen3"]),  # head_dim 32, not hidden / heads: only key_length says so
    # llama.cpp's qwen3moe has experts in every layer
    "qwen3_moe": ("qwen3moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                                   decoder_sparse_step=1, head_dim=32)),
    # six layers: llama.cpp's fixed pattern makes the sixth global; the global RoPE is linearly scaled
    "gemma3_text": ("gemma3", dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8, num_hidden_layers=6,
                                   layer_types=["sliding_attention"] * 5 + ["full_attention"],
                                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                    "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                       "rope_theta": 1e6}},
                                   tie_word_embeddings=True)),
    "phi3": ("phi3", FAMILIES["phi3"]),  # partial rotary and LongRoPE factors
}

# HF -> GGUF block tensor names (gguf-py tensor_mapping.py), and where an architecture differs
_BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
          "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
_GEMMA3 = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
           "post_feedforward_layernorm": "post_ffw_norm"}
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


def _copy_tokenizer(w) -> None:
    """The built-in model's GPT-2-style vocabulary (49152 tokens, as the tiny models use)."""
    import gguf

    fields = gguf.GGUFReader(str(builtin_gguf_path())).fields
    get = lambda key: fields[key].contents()
    w.add_tokenizer_model(get("tokenizer.ggml.model"))
    w.add_tokenizer_pre(get("tokenizer.ggml.pre"))
    w.add_token_list(get("tokenizer.ggml.tokens"))
    w.add_token_types(get("tokenizer.ggml.token_type"))
    w.add_token_merges(get("tokenizer.ggml.merges"))
    w.add_bos_token_id(get("tokenizer.ggml.bos_token_id"))
    w.add_eos_token_id(get("tokenizer.ggml.eos_token_id"))
    w.add_pad_token_id(get("tokenizer.ggml.padding_token_id"))
    w.add_add_bos_token(get("tokenizer.ggml.add_bos_token"))
    w.add_chat_template(get("tokenizer.chat_template"))


def write_llama_cpp_gguf(path, hf_dir, cfg, arch: str) -> None:
    """`hf_dir` written as convert_hf_to_gguf.py would write it with --outtype f16: matrices (and
    stacked experts) F16, norms and other vectors F32."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    if arch == "phi3":  # Phi3MiniModel: no key_length; rotary dims, original context, window 0 for none
        rope_dims = int(rope.get("partial_rotary_factor", 1.0) * cfg.hidden_size) // cfg.num_attention_heads
        w.add_rope_dimension_count(rope_dims)
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_sliding_window(cfg.sliding_window or 0)
        scale = cfg.max_position_embeddings / rope["original_max_position_embeddings"]
        w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(scale) / np.log(rope["original_max_position_embeddings"]))))
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    else:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if arch == "gemma3":  # the global layers' base and scaling; the local base is llama.cpp's fixed 10000
        full = rope["full_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
        w.add_sliding_window(cfg.sliding_window)
    elif arch in ("qwen3", "qwen3moe"):
        w.add_rope_freq_base(rope["rope_theta"])
    if arch == "qwen3moe":
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    _copy_tokenizer(w)

    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, tensor in iter_weights(hf_dir):
        data = tensor.float().numpy()
        if m := _EXPERT.fullmatch(name):  # stacked per layer into [n_expert, rows, cols]
            experts.setdefault((int(m.group(1)), m.group(3)), {})[int(m.group(2))] = data
            continue
        if arch == "gemma3" and name.endswith("norm.weight"):  # Gemma3Model.norm_shift
            data = data + 1.0
        if name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
            gg = {"model.embed_tokens.weight": "token_embd", "lm_head.weight": "output",
                  "model.norm.weight": "output_norm"}[name] + ".weight"
        else:
            layer, leaf = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", name).groups()
            names = {**_BLOCK, **_GEMMA3} if arch == "gemma3" else _BLOCK
            gg = f"blk.{layer}.{names[leaf]}.weight"
        w.add_tensor(gg, np.ascontiguousarray(data, dtype=np.float16 if data.ndim >= 2 else np.float32))
    for (layer, proj), by_expert in sorted(experts.items()):
        stacked = np.stack([by_expert[e] for e in range(len(by_expert))])
        w.add_tensor(f"blk.{layer}.ffn_{proj}_exps.weight", np.ascontiguousarray(stacked, dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module", params=sorted(GGUF_FAMILIES))
def family(request, tmp_path_factory, builtin_dir):
    model_type = request.param
    arch, fields = GGUF_FAMILIES[model_type]
    root = tmp_path_factory.mktemp(model_type)
    hf_dir, model = make_family_model(root / "hf", builtin_dir, model_type, **fields)
    with torch.no_grad():  # the matrices the F16 file can hold exactly, in the reference and its checkpoint
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(p.half().float())
    model.save_pretrained(hf_dir)
    gguf_path = root / f"{model_type}.gguf"
    write_llama_cpp_gguf(gguf_path, hf_dir, model.config, arch)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SHOAL_CACHE", str(root / "cache"))
        prompts = mixed_prompts()
        tokens, first = hf_reference(model, prompts, MAX_NEW)
        yield model_type, gguf_path, prompts, tokens, first, hf_dir


def test_weights_come_back_as_saved(family):
    """Every tensor the HF checkpoint holds, under its HF name, from the GGUF (Gemma's 1 + w undone,
    experts split back, Phi-3's fused projections kept fused)."""
    model_type, gguf_path, hf_dir = family[0], family[1], family[5]
    converted = dict(iter_weights(resolve_model(str(gguf_path))))
    saved = dict(iter_weights(hf_dir))
    assert set(converted) == set(saved), (model_type, set(converted) ^ set(saved))
    for name, tensor in saved.items():
        torch.testing.assert_close(converted[name], tensor.float(), atol=1e-6, rtol=0, msg=name)


def test_greedy_tokens_and_first_logprobs_match_transformers(family):
    llm = LLM(str(family[1]), kv_cache_memory=2**24, max_num_batched_tokens=32, attention_backend="torch")
    check_against_reference(llm, family[:5], MAX_NEW)


def test_unsupported_architecture_is_refused(tmp_path):
    """A GGUF of an architecture Shoal does not map is refused at conversion, naming the ones it does."""
    import gguf

    path = tmp_path / "tiny-gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"'gpt2' is not supported; supported: gemma3, llama, .*qwen3moe"):
        convert_gguf(path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()

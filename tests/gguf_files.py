"""Tiny GGUF files for the tests: a random Llama written the way llama.cpp's converter writes it
(write_tiny_gguf), its linear weights optionally quantized; and a reference quantizer for the
K-quants (Q4_K, Q5_K, Q6_K), which gguf.quants can read but not write: plain min/max scales (not
llama.cpp's search for the best ones), bytes laid out as ggml-common.h's block_q4_K / block_q5_K
/ block_q6_K. The tests check that layout by reading the blocks back with gguf.quants.dequantize,
which is independent of this file and of Shoal's C."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def tiny_llama(vocab_size=262, tie=False, seed=0, hidden_size=64, intermediate_size=128):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tie,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms are ones at init; make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


TINY_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def write_tiny_gguf(path: Path, model, quant: dict[str, str] | None = None) -> None:
    """Write ``model`` the way llama.cpp's converter would (Q/K rows permuted), embeddings in Q8_0,
    each linear weight named in ``quant`` ({"q_proj": "Q4_K", ...}, "lm_head" the LM head) in
    that GGUF type; ``model`` is left holding exactly the weights the file holds."""
    import gguf
    import gguf.quants
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    cfg = model.config
    n_head, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads

    def permute(w, heads):  # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    byte_tokens = list(bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he"]
    tokens = specials + byte_tokens + ["Ġt", "he", "Ġthe"]
    assert len(tokens) == cfg.vocab_size

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(cfg.hidden_size // n_head)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(specials) + [1] * (len(tokens) - len(specials)))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(TINY_TEMPLATE)

    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    emb = sd["model.embed_tokens.weight"]
    q8 = gguf.quants.quantize(emb, gguf.GGMLQuantizationType.Q8_0)
    with torch.no_grad():  # the reference holds what the file holds
        model.model.embed_tokens.weight.copy_(torch.from_numpy(gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0)))
    w.add_tensor("token_embd.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for i in range(cfg.num_hidden_layers):
        for hf, gg in names.items():
            sub = "self_attn." if hf.endswith("_proj") and hf[0] in "qkvo" else "mlp." if hf.endswith("_proj") else ""
            t = sd[f"model.layers.{i}.{sub}{hf}.weight"]
            raw = None
            if hf in (quant or {}):
                t, raw = _quantize_into(model, f"model.layers.{i}.{sub}{hf}.weight", t, quant[hf])
            if gg == "attn_q":
                t = permute(t, n_head)
            elif gg == "attn_k":
                t = permute(t, n_kv)
            w.add_tensor(f"blk.{i}.{gg}.weight", np.ascontiguousarray(t), raw_dtype=raw)
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        t, raw = sd["lm_head.weight"], None
        if "lm_head" in (quant or {}):
            t, raw = _quantize_into(model, "lm_head.weight", t, quant["lm_head"])
        w.add_tensor("output.weight", t, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _quantize_into(model, name: str, weight: np.ndarray, qtype: str):
    """(uint8 rows, GGUF type) of weight in qtype; the model's parameter set to their dequantization."""
    import gguf
    import gguf.quants

    t = gguf.GGMLQuantizationType[qtype]
    rows = quantize(weight, qtype)
    with torch.no_grad():
        model.get_parameter(name).copy_(torch.from_numpy(gguf.quants.dequantize(rows, t).copy()))
    return rows, t


# ----------------------------------------------------------------------------- K-quants

QK_K = 256
TYPES = {"Q4_K": 12, "Q5_K": 13, "Q6_K": 14}  # ggml's numbers


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _pack_scales_k4(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """[n, 8] 6-bit scales and mins -> [n, 12] bytes (the inverse of get_scale_min_k4)."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    return out


def _q45k(blocks: np.ndarray, bits: int) -> np.ndarray:
    """[n, 256] float32 -> [n, 144] (Q4_K) or [n, 176] (Q5_K) bytes."""
    n, top = blocks.shape[0], 2**bits - 1
    sub = blocks.reshape(n, 8, 32)
    lo, hi = np.minimum(sub.min(-1), 0), np.maximum(sub.max(-1), 0)
    scale, mins = (hi - lo) / top, -lo
    d = _f16(scale.max(-1) / 63)
    dmin = _f16(mins.max(-1) / 63)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(np.nan_to_num(np.round(scale / df)), 0, 63).astype(np.uint8)
        m = np.clip(np.nan_to_num(np.round(mins / dminf)), 0, 63).astype(np.uint8)
        step, offset = (df * sc)[..., None], (dminf * m)[..., None]
        q = np.clip(np.nan_to_num(np.round((sub + offset) / step)), 0, top).astype(np.uint8)  # [n, 8, 32]
    qs = (q[:, 0::2] & 0xF) | ((q[:, 1::2] & 0xF) << 4)  # [n, 4, 32]: sub-blocks 2j low, 2j + 1 high
    parts = [d.reshape(n, 1).view(np.uint8), dmin.reshape(n, 1).view(np.uint8), _pack_scales_k4(sc, m)]
    if bits == 5:
        qh = np.zeros((n, 32), dtype=np.uint8)
        for j in range(8):
            qh |= ((q[:, j] >> 4) & 1) << j
        parts.append(qh)
    return np.concatenate(parts + [qs.reshape(n, 128)], axis=1)


def _q6k(blocks: np.ndarray) -> np.ndarray:
    """[n, 256] float32 -> [n, 210] bytes."""
    n = blocks.shape[0]
    sub = blocks.reshape(n, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d = _f16(scale.max(-1) / 127)
    df = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(np.nan_to_num(np.round(scale / df)), -128, 127).astype(np.int8)
        step = (df * sc)[..., None]
        q = np.clip(np.nan_to_num(np.round(sub / step)), -32, 31).astype(np.int16)
    u = (q.reshape(n, 256) + 32).astype(np.uint8)  # value 128 h + 32 s + l
    ql, qh = np.zeros((n, 128), dtype=np.uint8), np.zeros((n, 64), dtype=np.uint8)
    for h in range(2):
        for s in range(4):
            v = u[:, 128 * h + 32 * s : 128 * h + 32 * s + 32]
            ql[:, 64 * h + 32 * (s & 1) : 64 * h + 32 * (s & 1) + 32] |= (v & 0xF) << (4 * (s >> 1))
            qh[:, 32 * h : 32 * h + 32] |= (v >> 4) << (2 * s)
    return np.concatenate([ql, qh, sc.view(np.uint8), d.reshape(n, 1).view(np.uint8)], axis=1)


def quantize(w: np.ndarray, qtype: str) -> np.ndarray:
    """w [N, K] -> uint8 rows [N, bytes a row] of GGUF type `qtype` (a name: "Q4_K", "Q8_0", ...):
    the K-quants here (K a multiple of 256), the others by gguf.quants."""
    if qtype not in TYPES:
        import gguf.quants

        return gguf.quants.quantize(np.asarray(w, dtype=np.float32), gguf.GGMLQuantizationType[qtype])
    N, K = w.shape
    if K % QK_K:
        raise ValueError(f"K-quant rows hold whole 256-weight blocks, got {K}")
    blocks = np.asarray(w, dtype=np.float32).reshape(-1, QK_K)
    packed = _q6k(blocks) if qtype == "Q6_K" else _q45k(blocks, 4 if qtype == "Q4_K" else 5)
    return np.ascontiguousarray(packed.reshape(N, -1))

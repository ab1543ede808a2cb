"""Reference helpers shared by the engine tests: transformers as the oracle, tiny models."""

from __future__ import annotations

import shutil

import torch


def hf_greedy(hf_model, ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generate on one unpadded prompt: the reference tokens."""
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(ids):].tolist()


def make_tiny_model(path, builtin_dir, arch: str = "llama", **overrides):
    """A random-weight Llama/Qwen2/Mistral saved as an HF directory, with the built-in tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    base = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=False, initializer_range=0.3, bos_token_id=1, eos_token_id=2,
    )
    base.update(overrides)
    cfg = AutoConfig.for_model(arch, **base)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (builtin_dir / name).exists():
            shutil.copy(builtin_dir / name, path / name)
    return path

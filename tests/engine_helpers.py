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


# three adapters of different shapes: attention only, MLP only with rsLoRA, every target
ADAPTER_SHAPES = [
    dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    dict(r=8, lora_alpha=16, use_rslora=True, target_modules=["gate_proj", "up_proj", "down_proj"]),
    dict(r=16, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
]


def make_peft_adapter(base_dir, path, seed: int, **lora_config):
    """A random LoRA adapter of the model at base_dir, saved by PEFT (adapter_config.json +
    adapter_model.safetensors). B is random too (PEFT starts it at zero), so it changes the tokens."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", init_lora_weights=False, **lora_config))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
    model.save_pretrained(path)
    return path


def peft_greedy(base_dir, adapter_dir, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers + PEFT's greedy tokens for each prompt (adapter_dir None: the base model alone)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    return [hf_greedy(model, p, max_new_tokens) for p in prompts]


def make_lora_models(root, builtin_dir, count: int = 3):
    """A tiny random base model and `count` random PEFT adapters of it ({name: path}), shapes cycling."""
    base = make_tiny_model(root / "base", builtin_dir)
    return base, {f"a{i}": make_peft_adapter(base, root / f"a{i}", seed=i, **ADAPTER_SHAPES[i % len(ADAPTER_SHAPES)])
                  for i in range(count)}


def lora_prompts(seed: int = 3, lengths=(5, 23, 40)) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in lengths]


def lora_references(base, adapters: dict, prompts, max_new_tokens: int) -> dict:
    """{adapter name (None: base): transformers + PEFT's greedy tokens per prompt}."""
    refs = {None: peft_greedy(base, None, prompts, max_new_tokens)}
    refs.update({name: peft_greedy(base, path, prompts, max_new_tokens) for name, path in adapters.items()})
    return refs

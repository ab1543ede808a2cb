"""Random-weight models for benchmarks, saved as Hugging Face directories (config.json,
safetensors, a tokenizer) so that Shoal and transformers load the very same files.

    shoal bench make-model llama-1b --dtype bfloat16 --device cuda    # prints the directory

The tokenizer is synthetic (a word-level vocabulary "t0".."t{V-1}" plus <unk>/<s>/</s>), so
nothing is downloaded or converted: the benchmarks feed token ids, and the engine only
needs a fast tokenizer to detokenize what it generates. Needs torch, transformers,
tokenizers and safetensors only (what a bare GPU machine has).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

# Shapes, Llama's architecture unless a preset names its model_type. vocab 49152 everywhere a
# workload's ids (up to 40,000) must fit.
PRESETS: dict[str, dict] = {
    # PERFORMANCE.md's GPU model: Llama-3.2-1B's shape with SmolLM2's vocabulary, tied.
    "llama-1b": dict(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                     max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    # SmolLM2-135M's shape (the built-in model), for parity checks.
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
                         max_position_embeddings=8192, rope_parameters={"rope_type": "default", "rope_theta": 100000.0}),
    # issue 17's CPU host-work figure: a model too small to matter.
    "tiny-step": dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True,
                      max_position_embeddings=2048),
    # issue 29's CPU throughput check: a Qwen3 (q/k norms, untied, head_dim != hidden / heads) about the
    # built-in model's size
    "qwen3-small": dict(model_type="qwen3", vocab_size=49152, hidden_size=512, intermediate_size=1536,
                        num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=4, head_dim=80,
                        tie_word_embeddings=True, max_position_embeddings=8192,
                        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # issue 29's CPU throughput check for experts: qwen3-small's attention, 8 layers of MoE blocks shaped
    # like Qwen3-30B-A3B's (top-8, each expert 3/8 of hidden wide) with 64 experts
    "qwen3-moe-small": dict(model_type="qwen3_moe", vocab_size=49152, hidden_size=512, intermediate_size=1536,
                            moe_intermediate_size=192, num_experts=64, num_experts_per_tok=8, norm_topk_prob=True,
                            num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=80,
                            tie_word_embeddings=True, max_position_embeddings=8192,
                            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # smoke runs of the GPU check on CPU: a workload's ids fit, everything else tiny.
    "tiny": dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                 max_position_embeddings=2048),
    # Qwen3-30B-A3B's layer (128 experts, top-8, expert width 768, 32/4 heads of 128) in 8 layers:
    # the mixture-of-experts GPU figure (issue 29).
    "qwen3-moe-a3b-8l": dict(model_type="qwen3_moe", vocab_size=49152, hidden_size=2048, intermediate_size=6144,
                             moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                             num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                             tie_word_embeddings=False, max_position_embeddings=4096,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # the same routing (128 experts, top-8) at a size a CPU runs in seconds.
    "qwen3-moe-tiny": dict(model_type="qwen3_moe", vocab_size=49152, hidden_size=128, intermediate_size=256,
                           moe_intermediate_size=64, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                           tie_word_embeddings=True, max_position_embeddings=2048),
}
COMMON = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0, rms_norm_eps=1e-5, hidden_act="silu")
SPECIAL = ["<unk>", "<s>", "</s>"]


def default_dir(preset: str, dtype: str, initializer_range: float | None = None) -> Path:
    from shoal.runtime.models.loader import cache_dir

    init = "" if initializer_range is None else f"-init{initializer_range:g}"
    return cache_dir() / "random-models" / f"{preset}-{dtype}{init}"


def save_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level fast tokenizer covering every id of the model's vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL)}
    vocab.update({f"t{i}": i for i in range(len(SPECIAL), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<unk>")
    fast.save_pretrained(str(path))


def make_random_model(preset: str = "llama-1b", out: str | os.PathLike | None = None, dtype: str = "bfloat16",
                      device: str = "cpu", seed: int = 0, initializer_range: float | None = None,
                      overwrite: bool = False, **overrides) -> Path:
    """Create (or reuse) a random-weight HF directory of the preset's architecture; returns its path.

    `device="cuda"` initialises the weights on the GPU (seconds for the 1B shape, against
    tens of seconds on a few CPU cores); the weights then come from the GPU's random
    generator, so they differ from a CPU-made model of the same seed (fine for benchmarks).
    A directory made before with the same preset, dtype, seed and overrides is reused.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    path = Path(out) if out is not None else default_dir(preset, dtype, initializer_range)
    done = path / ".shoal-random-model.json"
    fields = {**COMMON, **PRESETS[preset], **overrides}
    if initializer_range is not None:
        fields["initializer_range"] = initializer_range
    spec = {"preset": preset, "dtype": dtype, "seed": seed, "config": fields}  # a changed preset is made anew
    if done.exists() and not overwrite:
        try:
            if json.loads(done.read_text()) == spec:
                return path
        except ValueError:
            pass
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    config_fields = dict(fields)
    cfg = AutoConfig.for_model(config_fields.pop("model_type", "llama"), **config_fields)
    torch.manual_seed(seed)  # seeds the CUDA generators too
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    model.save_pretrained(str(path))
    del model
    save_tokenizer(path, cfg.vocab_size)
    done.write_text(json.dumps(spec))
    return path


LORA_TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def make_random_adapters(model_dir: str | os.PathLike, count: int, rank: int = 16, seed: int = 0) -> dict[str, Path]:
    """`count` random LoRA adapters of the model at model_dir, in PEFT's files (every q/k/v/o and
    gate/up/down projection, rank `rank`), beside it in `<model_dir>-loras/`; {name: path}."""
    import torch
    from safetensors.torch import save_file

    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, inter),
              "up_proj": (h, inter), "down_proj": (inter, h)}
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(count):
        path = Path(f"{model_dir}-loras") / f"lora{i}"
        path.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for layer in range(cfg["num_hidden_layers"]):
            for target, parent in LORA_TARGETS.items():
                fan_in, fan_out = shapes[target]
                key = f"base_model.model.model.layers.{layer}.{parent}.{target}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.01
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
            "target_modules": list(LORA_TARGETS), "base_model_name_or_path": str(model_dir)}))
        out[f"lora{i}"] = path
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="shoal bench make-model", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    return run(args)


def add_arguments(p) -> None:
    p.add_argument("preset", choices=sorted(PRESETS))
    p.add_argument("--out", help="directory (default: the user cache, one per preset and dtype)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--device", default="cpu", help="where to initialise the weights (cuda is much faster for 1B)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--initializer-range", type=float)
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=run)


def run(args) -> int:
    path = make_random_model(args.preset, args.out, args.dtype, args.device, args.seed, args.initializer_range,
                             args.overwrite)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

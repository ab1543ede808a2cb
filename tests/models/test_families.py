"""Every dense family gives transformers' greedy tokens and first-step log-probabilities
on the same weights (float32, CPU, torch backend): a batch of mixed-length prompts, most
longer than the sliding windows, prefilled in chunks smaller than the prompts."""

from __future__ import annotations

import pytest

from family_models import FAMILIES, check_against_reference, hf_reference, make_family_model, mixed_prompts
from shoal import LLM

MAX_NEW = 24


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory, builtin_dir):
    model_type = request.param
    path, model = make_family_model(tmp_path_factory.mktemp(model_type), builtin_dir, model_type,
                                    shard=model_type == "qwen3")
    prompts = mixed_prompts()
    tokens, first = hf_reference(model, prompts, MAX_NEW)
    return model_type, path, prompts, tokens, first


def test_greedy_tokens_and_first_logprobs_match_transformers(family):
    llm = LLM(str(family[1]), kv_cache_memory=2**24, max_num_batched_tokens=32, attention_backend="torch")
    check_against_reference(llm, family, MAX_NEW)


def test_unsupported_or_mismatched_configs_are_refused(tmp_path, builtin_dir):
    """A supported architecture whose model_type Shoal does not run is refused, never loaded
    into another family's module."""
    import json

    from shoal.runtime.models.loader import load_config

    path, _ = make_family_model(tmp_path / "m", builtin_dir, "qwen3")
    raw = json.loads((path / "config.json").read_text())
    raw["model_type"] = "gpt_neox"
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="unsupported model architecture.*Qwen3ForCausalLM"):
        load_config(path)


def test_spec_of_reads_each_family():
    """The switches families.py derives, against the configs' own fields."""
    from transformers import AutoConfig

    from shoal.runtime.models.families import spec_of

    cfg = AutoConfig.for_model("gemma3_text", num_hidden_layers=3, sliding_window=8,
                               layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    spec = spec_of(cfg)
    assert spec.windows == [8, 0, 8] and spec.rope_keys == ["sliding_attention", "full_attention", "sliding_attention"]
    assert spec.norms == "sandwich" and spec.norm_offset == 1.0 and spec.qk_norm == "head" and not spec.plain
    qwen2 = spec_of(AutoConfig.for_model("qwen2", num_hidden_layers=4, sliding_window=16))  # use_sliding_window off
    assert qwen2.windows == [0, 0, 0, 0] and qwen2.qkv_bias and qwen2.plain
    assert spec_of(AutoConfig.for_model("llama", num_hidden_layers=2)).plain
    assert spec_of(AutoConfig.for_model("mistral", num_hidden_layers=2, sliding_window=5)).windows == [5, 5]
    with pytest.raises(ValueError, match="activation"):
        spec_of(AutoConfig.for_model("llama", num_hidden_layers=2, hidden_act="relu"))


def test_longrope_table_matches_transformers_on_both_sides_of_the_switch():
    """Phi-3's RoPE table: short factors below the original context, long ones from it on,
    each row as transformers' rotary module gives it for a sequence that long."""
    import torch
    from transformers import AutoConfig
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from family_models import BASE
    from shoal.runtime.models.decoder import rope_cache

    cfg = AutoConfig.for_model("phi3", **{**BASE, **FAMILIES["phi3"]})
    original = cfg.rope_parameters["original_max_position_embeddings"]
    table = rope_cache(cfg, 256)
    rotary = Phi3RotaryEmbedding(cfg)
    half = table.shape[-1] // 2
    for pos in (0, 7, original - 1, original, original + 9, 255):
        cos, sin = rotary(torch.zeros(1, 1, 16), torch.tensor([[pos]]))
        torch.testing.assert_close(table[pos, :half], cos[0, 0, :half], rtol=0, atol=1e-6)
        torch.testing.assert_close(table[pos, half:], sin[0, 0, :half], rtol=0, atol=1e-6)

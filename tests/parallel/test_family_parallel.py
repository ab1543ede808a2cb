"""The families that change what tensor and pipeline parallelism must get right give
transformers' greedy tokens across ranks: Gemma 3's per-layer windows and RoPE tables split
over pipeline stages, Gemma 2's soft-caps and sandwich norms over tensor ranks, OLMo 2's q/k
norm over all heads (a mean square summed across ranks, one KV head replicated on both), and
Qwen3's per-head norms over both at once, gpt-oss's sinks (each rank its heads'), o_proj bias
(added once, after the all-reduce) and biased experts (the down bias on one rank) at TP 2 and over
pipeline stages, DeepSeek's latent attention (heads split, the latent and its cache whole on every
rank) with its experts sliced. A KV cache small enough to preempt, prefix caching on."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))  # family_models

from family_models import hf_reference, make_deepseek_model, make_family_model  # noqa: E402
from parallel_helpers import MAX_NEW, generate, mixed_prompts  # noqa: E402


@pytest.mark.parametrize("model_type,tp,pp,overrides", [
    ("gemma3_text", 1, 2, {}),
    ("gemma2", 2, 1, {}),
    ("olmo2", 2, 1, {"num_key_value_heads": 1}),
    ("qwen3", 2, 2, {"num_hidden_layers": 4}),
], ids=["gemma3-pp2", "gemma2-tp2", "olmo2-tp2-mqa", "qwen3-tp2xpp2"])
def test_family_in_parallel_matches_transformers(tmp_path, builtin_dir, model_type, tp, pp, overrides):
    path, model = make_family_model(tmp_path, builtin_dir, model_type, **overrides)
    prompts = mixed_prompts()
    want, _ = hf_reference(model, prompts, MAX_NEW)
    tokens, _ = generate(path, tp, pp, prompts)
    assert tokens == want


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_gpt_oss_in_parallel_matches_transformers(tmp_path, builtin_dir, tp, pp):
    from family_models import make_gpt_oss_model

    path, model = make_gpt_oss_model(tmp_path, builtin_dir, num_hidden_layers=4)
    prompts = mixed_prompts()
    want, _ = hf_reference(model, prompts, MAX_NEW)
    tokens, stats = generate(path, tp, pp, prompts)
    assert stats.num_preemptions > 0
    assert tokens == want


@pytest.mark.parametrize("model_type,tp,pp", [("deepseek_v2", 2, 1), ("deepseek_v3", 2, 2)], ids=["v2-tp2", "v3-tp2xpp2"])
def test_deepseek_in_parallel_matches_transformers(tmp_path, builtin_dir, model_type, tp, pp):
    from shoal import SamplingParams

    path, model = make_deepseek_model(tmp_path, builtin_dir, model_type, num_hidden_layers=4)
    prompts = mixed_prompts()
    want, first = hf_reference(model, prompts, MAX_NEW)
    outs = []
    params = SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0.0, logprobs=3)
    tokens, stats = generate(path, tp, pp, prompts, params=params, outputs=outs)
    assert stats.num_preemptions > 0
    assert tokens == want
    for out, ref in zip(outs, first):
        for token, logprob in out.outputs[0].logprobs[0].items():
            value = logprob.logprob if hasattr(logprob, "logprob") else logprob
            assert abs(value - float(ref[token])) < 1e-4

"""--kv-cache-dtype fp8 on a tiny random Llama (torch backend). Against transformers whose
attention rounds every key and value through float8 e4m3 (times the scale) before it
attends, as a float8 cache holds them: the same greedy tokens and first-step
log-probabilities. Against Shoal's bfloat16 cache: twice the blocks in the same memory, and
the figures docs/quantization.md reports. The checkpoint's k_scale / v_scale are read; a
prompt served again from the prefix cache gives the same tokens."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import make_tiny_model
from family_models import hf_reference, mixed_prompts
from shoal import LLM, SamplingParams

MAX_NEW = 8
MEMORY = 2**22


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, builtin_dir):
    return make_tiny_model(tmp_path_factory.mktemp("fp8kv"), builtin_dir, hidden_size=128, intermediate_size=256)


def _run(path, prompts, dtype="float32", **kw):
    llm = LLM(str(path), kv_cache_memory=MEMORY, max_num_batched_tokens=32, attention_backend="torch", dtype=dtype, **kw)
    try:
        params = SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0.0, logprobs=5)
        outs = llm.generate(prompts, params)
        again = llm.generate(prompts[-2:], params)  # their blocks now come from the prefix cache
        blocks = llm.engine.executor.num_blocks_for(MEMORY)
        scales = llm.engine.executor.model.layers[0].self_attn.kv_scales
    finally:
        llm.engine.shutdown()
    return outs, again, blocks, scales


def _first(out) -> dict[int, float]:
    return {t: getattr(lp, "logprob", lp) for t, lp in out.outputs[0].logprobs[0].items()}


def _fp8_attention(k_scale: float, v_scale: float):
    """transformers' SDPA attention over keys and values rounded as a float8 cache stores them."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def rounded(x, scale):
        return ((x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)

    def attention(module, query, key, value, attention_mask, **kwargs):
        return sdpa_attention_forward(module, query, rounded(key, k_scale), rounded(value, v_scale), attention_mask, **kwargs)

    return attention


def test_fp8_cache_matches_transformers_attending_over_fp8_keys_and_values(tiny):
    from transformers import AttentionInterface, AutoModelForCausalLM

    AttentionInterface.register("fp8_kv_reference", _fp8_attention(1.0, 1.0))
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32, attn_implementation="fp8_kv_reference").eval()
    prompts = mixed_prompts()
    want, first = hf_reference(model, prompts, MAX_NEW)
    outs, again, blocks, scales = _run(tiny, prompts, kv_cache_dtype="fp8")
    assert scales == (1.0, 1.0)  # none in the checkpoint: 1.0, as vLLM
    same = sum(o.outputs[0].token_ids == w for o, w in zip(outs, want))
    assert same >= len(prompts) - 1, f"{same} of {len(prompts)} prompts gave transformers' tokens"
    for o, ref in zip(outs, first):
        for token, value in _first(o).items():
            assert abs(value - float(ref[token])) < 1e-3, (token, value, float(ref[token]))
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs[-2:]]


def test_fp8_cache_doubles_the_blocks_of_a_bfloat16_cache(tiny):
    prompts = mixed_prompts()
    base, _, base_blocks, _ = _run(tiny, prompts, "bfloat16")
    fp8, _, fp8_blocks, _ = _run(tiny, prompts, "bfloat16", kv_cache_dtype="fp8")
    assert fp8_blocks == 2 * base_blocks
    # the first token of every prompt: the cache's rounding moves log-probs, rarely the argmax
    firsts = sum(a.outputs[0].token_ids[0] == b.outputs[0].token_ids[0] for a, b in zip(base, fp8))
    assert firsts >= len(prompts) - 2


def test_checkpoint_kv_scales_are_read(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    for f in tiny.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    weights = load_file(str(tmp_path / "model.safetensors"))
    weights["model.layers.0.self_attn.k_scale"] = torch.tensor(0.25)
    weights["model.layers.0.self_attn.v_scale"] = torch.tensor(0.5)
    save_file(weights, str(tmp_path / "model.safetensors"))
    _, _, _, scales = _run(tmp_path, mixed_prompts(2), kv_cache_dtype="fp8")
    assert scales == (0.25, 0.5)


def test_preemption_with_an_fp8_cache_keeps_the_tokens(tiny):
    """Too few blocks for the batch: sequences are preempted and recomputed, and give the
    tokens they give with room to spare."""
    prompts = mixed_prompts()
    params = SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0.0)
    results = []
    for blocks in (256, 8):
        llm = LLM(str(tiny), kv_cache_memory=blocks * 4096, max_num_batched_tokens=32, attention_backend="torch",
                  kv_cache_dtype="fp8", cpu_decode_max_seqs=0)
        try:
            assert llm.engine.executor.kv_bytes_per_block() == 4096  # 2 layers x K,V x 16 tokens x 2 heads x 32, 1 byte
            results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
            preemptions = llm.engine.stats().num_preemptions
        finally:
            llm.engine.shutdown()
    assert preemptions > 0
    assert results[1] == results[0]

"""Log-probabilities, sampling options and detokenization against independent references."""

from __future__ import annotations

import math

import pytest
import torch

from shoal import SamplingParams


def test_logprobs_equal_transformers_log_softmax(llm, hf_model, tokenizer):
    prompt = tokenizer("Tell me about the moon.").input_ids
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, logprobs=5))[0].outputs[0]
    full = torch.tensor([prompt + out.token_ids])
    with torch.inference_mode():
        ref = hf_model(full).logits[0].log_softmax(-1)
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt) - 1 + step]
        top = row.topk(5)
        assert set(entry) >= set(top.indices.tolist())
        for tid, lp in entry.items():
            assert abs(lp - row[tid].item()) < 1e-4
        assert token in entry
    assert out.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(out.token_ids, out.logprobs)), abs=1e-4)


def test_seeded_sampling_is_independent_of_the_batch(llm, tokenizer):
    prompt = tokenizer("Once upon a time").input_ids
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=1234)
    alone = llm.generate([prompt], seeded)[0].outputs[0].token_ids
    others = SamplingParams(max_tokens=12, temperature=1.0)
    crowd = llm.generate([tokenizer("Hello").input_ids, prompt, tokenizer("Why?").input_ids], [others, seeded, others])
    assert crowd[1].outputs[0].token_ids == alone
    different = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=99))[0]
    assert different.outputs[0].token_ids != alone


def test_top_k_one_is_greedy(llm, tokenizer):
    prompt = tokenizer("The best way to learn is").input_ids
    greedy = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0))[0].outputs[0].token_ids
    top1 = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=1.5, top_k=1, seed=3))[0].outputs[0].token_ids
    assert top1 == greedy


def test_n_samples_share_the_prompt_blocks(llm, tokenizer):
    prompt = tokenizer("List three animals: " * 8).input_ids  # several full blocks
    engine = llm.engine
    engine.add_request("n3", prompt, SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=5))
    shared = None
    outputs = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs = out
        request = engine.requests.get("n3")
        if request and request.forked and all(s.block_table for s in request.seqs) and shared is None:  # siblings placed
            tables = [s.block_table for s in request.seqs]
            full = len(prompt) // engine.block_size
            shared = all(t[:full] == tables[0][:full] for t in tables)
            refs = [engine.pool.ref_count[b] for b in tables[0][:full]]
    assert shared and min(refs) >= 3
    assert [o.index for o in outputs.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 6 for o in outputs.outputs)
    assert len({tuple(o.token_ids) for o in outputs.outputs}) > 1


def test_stop_strings_and_stop_token_ids(llm, tokenizer):
    prompt = tokenizer("Count: 1, 2, 3, 4,").input_ids
    free = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0))[0].outputs[0]
    assert " 6" in free.text
    stopped = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, stop=[" 6"]))[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == " 6"
    assert stopped.text == free.text[: free.text.index(" 6")]
    tid = free.token_ids[3]
    by_id = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[tid]))[0].outputs[0]
    assert by_id.token_ids == free.token_ids[: free.token_ids.index(tid) + 1] and by_id.stop_reason == tid


def test_min_tokens_and_ignore_eos(llm, tokenizer):
    chat = "Write a poem about the sea."  # the built-in model ends this one at once (EOS)
    short = llm.generate([chat], SamplingParams(max_tokens=64, temperature=0.0))[0].outputs[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 64
    n = len(short.token_ids)
    longer = llm.generate([chat], SamplingParams(max_tokens=64, min_tokens=n + 5, temperature=0.0))[0].outputs[0]
    assert len(longer.token_ids) >= n + 5
    forced = llm.generate([chat], SamplingParams(max_tokens=n + 4, temperature=0.0, ignore_eos=True))[0].outputs[0]
    assert len(forced.token_ids) == n + 4 and forced.finish_reason == "length"


def test_penalties_match_transformers_processors(tokenizer):
    from transformers import RepetitionPenaltyLogitsProcessor

    from shoal.runtime.engine.request import Request
    from shoal.runtime.engine.step_input import sampling_metadata
    from shoal.runtime.layers.sampler import apply_penalties

    torch.manual_seed(0)
    logits = torch.randn(2, 100)
    reqs = [Request(f"r{i}", None, [5, 6, 7, 5], SamplingParams(repetition_penalty=1.3)) for i in range(2)]
    reqs[1].seqs[0].token_ids += [9, 9]
    ours = logits.clone()
    apply_penalties(ours, sampling_metadata([r.seqs[0] for r in reqs], [], 100))
    proc = RepetitionPenaltyLogitsProcessor(1.3)
    for row, r in enumerate(reqs):
        ref = proc(torch.tensor([r.seqs[0].token_ids]), logits[row : row + 1].clone())
        assert torch.allclose(ours[row], ref[0])
    # OpenAI's definition: logit - count * frequency - (count > 0) * presence, output tokens only
    r = Request("f", None, [1, 2], SamplingParams(frequency_penalty=0.5, presence_penalty=0.25))
    r.seqs[0].token_ids += [3, 3, 4]
    ours = logits[:1].clone()
    apply_penalties(ours, sampling_metadata([r.seqs[0]], [], 100))
    expected = logits[0].clone()
    expected[3] -= 2 * 0.5 + 0.25
    expected[4] -= 0.5 + 0.25
    assert torch.allclose(ours[0], expected)


def test_top_p_top_k_min_p_match_transformers_warpers():
    from transformers import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from shoal.runtime.engine.request import Request
    from shoal.runtime.engine.step_input import sampling_metadata
    from shoal.runtime.layers.sampler import apply_top_k_top_p_min_p

    torch.manual_seed(1)
    logits = torch.randn(1, 200) * 3
    cases = [
        (SamplingParams(top_p=0.8), TopPLogitsWarper(0.8)),
        (SamplingParams(top_k=7), TopKLogitsWarper(7)),
        (SamplingParams(min_p=0.1), MinPLogitsWarper(0.1)),
    ]
    for params, warper in cases:
        ours = apply_top_k_top_p_min_p(logits.clone(), sampling_metadata([Request("x", None, [1], params).seqs[0]], [], 200))
        ref = warper(torch.tensor([[1]]), logits.clone())
        assert torch.equal(torch.isinf(ours), torch.isinf(ref)), params


def test_incremental_text_never_splits_characters(llm, tokenizer):
    prompt = tokenizer("Traduis en japonais et ajoute des emojis 🎉🐟: bonjour, poisson, mer →").input_ids
    engine = llm.engine
    engine.add_request("utf8", prompt, SamplingParams(max_tokens=40, temperature=1.0, seed=11))
    texts = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts.append(out.outputs[0].text)
    final = out.outputs[0]
    assert all("\ufffd" not in t for t in texts)
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert final.text == tokenizer.decode(final.token_ids, skip_special_tokens=True).rstrip("\ufffd")


def test_cumulative_logprob_absent_without_logprobs(llm, tokenizer):
    out = llm.generate([tokenizer("Hi").input_ids], SamplingParams(max_tokens=2, temperature=0.0))[0].outputs[0]
    assert out.logprobs is None and out.cumulative_logprob is None
    assert not math.isnan(len(out.token_ids))


@pytest.mark.parametrize("kind", ["cumulative", "final_only"])
def test_stop_and_eos_tokens_add_no_text(llm, tokenizer, kind):
    """As vLLM's detokenizer: the token that ends a sequence (a stop token id, or EOS) is in its
    token ids but not in its text, special or not, unless include_stop_str_in_output."""
    prompt = tokenizer("Count: 1, 2, 3, 4,").input_ids
    base = dict(max_tokens=20, temperature=0.0, skip_special_tokens=False, output_kind=kind)
    free = llm.generate([prompt], SamplingParams(**base))[0].outputs[0]
    tid = free.token_ids[3]
    cut = free.token_ids.index(tid)
    by_id = llm.generate([prompt], SamplingParams(**base, stop_token_ids=[tid]))[0].outputs[0]
    assert by_id.token_ids[-1] == tid and by_id.text == tokenizer.decode(free.token_ids[:cut])
    kept = llm.generate([prompt], SamplingParams(**base, stop_token_ids=[tid], include_stop_str_in_output=True))[0]
    assert kept.outputs[0].text == tokenizer.decode(free.token_ids[: cut + 1])
    eos = tokenizer.eos_token_id
    ended = llm.generate([prompt], SamplingParams(**base, logit_bias={eos: 100.0}))[0].outputs[0]
    assert ended.token_ids == [eos] and ended.finish_reason == "stop" and ended.text == ""

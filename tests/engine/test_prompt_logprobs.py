"""prompt_logprobs (vLLM's): every prompt token's log-probability, rank and top k, against
transformers' log_softmax on the same weights (a tiny random Llama in float32)."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import make_tiny_model
from shoal import LLM, SamplingParams
from shoal.runtime.engine.request import Logprob

BUDGET = 64  # the step's token budget: longer prompts are prefilled in chunks


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, builtin_dir):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-scoring"), builtin_dir)


@pytest.fixture(scope="module")
def hf_tiny(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(tiny_dir):
    engine = LLM(str(tiny_dir), kv_cache_memory=2**26, max_num_batched_tokens=BUDGET, dtype="float32")
    yield engine
    engine.engine.shutdown()


def reference(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row p is the log-distribution of token p + 1."""
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def check_against(ref: torch.Tensor, ids: list[int], scored: list, k: int) -> None:
    assert len(scored) == len(ids) and scored[0] is None
    for p in range(1, len(ids)):
        row, entry, token = ref[p - 1], scored[p], ids[p]
        assert isinstance(entry[token], Logprob)
        assert next(iter(entry)) == token  # the prompt's own token first, as vLLM
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        # its rank: tokens at least as likely, up to float noise between the two implementations
        value = row[token].item()
        assert int((row > value + 1e-4).sum()) + 1 <= entry[token].rank <= int((row >= value - 1e-4).sum())
        top = row.topk(k)
        others = {t: lp for t, lp in entry.items() if t != token or lp.rank <= k}
        assert len(others) == k
        assert sorted(lp.rank for lp in others.values()) == list(range(1, k + 1))
        for tid, lp in others.items():
            assert lp.logprob == pytest.approx(row[tid].item(), abs=1e-4)
            assert lp.logprob >= top.values[-1].item() - 1e-4  # among the top k
            assert lp.decoded_token is not None


def test_prompt_logprobs_equal_transformers_across_chunks(llm, hf_tiny):
    ids = [(7 * i + 3) % 40000 + 10 for i in range(3 * BUDGET + 17)]  # four chunks
    out = llm.generate([ids], SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=4))[0]
    check_against(reference(hf_tiny, ids), ids, out.prompt_logprobs, 4)
    assert out.outputs[0].logprobs is None  # logprobs of the output are a separate option


def test_zero_top_k_and_a_mixed_batch(llm, hf_tiny, tokenizer):
    a = tokenizer("The quick brown fox jumps over the lazy dog.").input_ids
    b = [11 + i for i in range(90)]
    params = [SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=0),
              SamplingParams(max_tokens=4, temperature=0.0),
              SamplingParams(max_tokens=2, temperature=0.8, seed=1, prompt_logprobs=2, logprobs=1)]
    outs = llm.generate([a, b, b], params)
    check_against(reference(hf_tiny, a), a, outs[0].prompt_logprobs, 0)
    assert all(len(e) == 1 for e in outs[0].prompt_logprobs[1:])  # k = 0: the prompt's token alone
    assert outs[1].prompt_logprobs is None
    check_against(reference(hf_tiny, b), b, outs[2].prompt_logprobs, 2)
    # scoring the prompt does not change what is generated
    alone = llm.generate([a], SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert outs[0].outputs[0].token_ids == alone.outputs[0].token_ids


def test_a_cached_prefix_is_scored_anyway(llm, hf_tiny):
    ids = [100 + 3 * i for i in range(5 * 16 + 3)]  # several full blocks
    llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))  # now in the prefix cache
    kv = llm.engine.kv
    hits = kv.prefix_hits
    llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))
    assert kv.prefix_hits > hits  # the cache would serve it...
    hits = kv.prefix_hits
    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))[0]
    assert kv.prefix_hits == hits  # ...but a scored prompt computes every position
    check_against(reference(hf_tiny, ids), ids, out.prompt_logprobs, 1)


def test_n_and_delta_outputs(llm, hf_tiny):
    ids = [500 + i for i in range(40)]
    engine = llm.engine
    engine.add_request("delta", ids, SamplingParams(n=2, max_tokens=3, temperature=1.0, seed=3, prompt_logprobs=1,
                                                    output_kind="delta"))
    seen = []
    while engine.has_unfinished_requests():
        seen += [o.prompt_logprobs for o in engine.step() if o.request_id == "delta"]
    assert seen and all(p is None for p in seen[1:])  # in the first output only
    check_against(reference(hf_tiny, ids), ids, seen[0], 1)


def test_one_token_chunks_bypass_the_c_decode_step(tiny_dir, hf_tiny):
    """A budget of 2 next to a decoding request: the scored prompt advances one token per
    step, in decode-only steps that would otherwise run in C (whose output is the sample
    rows' logits only)."""
    llm = LLM(str(tiny_dir), kv_cache_memory=2**24, max_num_batched_tokens=2, dtype="float32")
    try:
        assert llm.engine.executor.c_decode_max_seqs > 0
        engine = llm.engine
        engine.add_request("decoding", [5, 6], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
        engine.step()
        ids = [900 + i for i in range(12)]
        engine.add_request("scored", ids, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=3))
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        check_against(reference(hf_tiny, ids), ids, done["scored"].prompt_logprobs, 3)
    finally:
        llm.engine.shutdown()


def test_bad_values_are_refused():
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


def test_the_lm_head_sees_at_most_a_slice_of_rows():
    from shoal.runtime.executor.prompt_logprobs import PromptRows, score

    torch.manual_seed(0)
    hidden, head = torch.randn(700, 8), torch.randn(8, 50)
    seen = []

    def logits(h):
        seen.append(h.shape[0])
        return h @ head

    rows = PromptRows(torch.arange(1, 700), torch.randint(0, 50, (699,)), k=3)
    out = score(logits, hidden, rows, slice_rows=256)
    assert seen == [256, 256, 187]
    ref = (hidden[1:] @ head).log_softmax(-1)
    assert torch.allclose(out[:, 0], ref.gather(1, rows.targets[:, None])[:, 0].double(), atol=1e-5)
    assert torch.equal(out[:, 1].long(), (ref >= ref.gather(1, rows.targets[:, None])).sum(-1))
    assert torch.equal(out[:, 5:].long(), ref.topk(3).indices)


def test_an_executor_that_cannot_score_refuses_the_request(llm, monkeypatch):
    """The tensor/pipeline-parallel executor scores no prompt rows: a clear error, not a silent None."""
    monkeypatch.setattr(llm.engine.executor, "scores_prompts", False)
    with pytest.raises(ValueError, match="prompt_logprobs is not supported with tensor or pipeline parallelism"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1, prompt_logprobs=1))
    assert not llm.engine.has_unfinished_requests()


def test_two_batches_in_flight_collect_the_scores_with_their_batch(tiny_dir, hf_tiny, monkeypatch):
    """As on a GPU with --batches-in-flight 2: a step's scores are read when its batch is
    collected, a step later, beside its sampled tokens."""
    from shoal.runtime.executor.model_runner import ModelRunner

    monkeypatch.setattr(ModelRunner, "pipelined", property(lambda self: True))
    llm = LLM(str(tiny_dir), kv_cache_memory=2**24, max_num_batched_tokens=32, batches_in_flight=2, dtype="float32")
    try:
        assert llm.engine.num_lanes == 2
        prompts = [[300 + 5 * i + j for i in range(70)] for j in range(3)]
        outs = llm.generate(prompts, [SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2)] * 3)
        for ids, out in zip(prompts, outs):
            check_against(reference(hf_tiny, ids), ids, out.prompt_logprobs, 2)
    finally:
        llm.engine.shutdown()

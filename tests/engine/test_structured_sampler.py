"""Structured outputs in the engine: the sampler's bitmask op against plain references, and
constrained generation (validated with jsonschema / re) on every path a step can take: the C
decode step (the CPU default, what `shoal serve` runs), the torch model, two batches in
flight (the GPU's pipelined path), preemption and recompute, n > 1."""

import json
import re

import jsonschema
import pytest
import torch

from engine_helpers import make_tiny_model
from shoal import LLM, SamplingParams
from shoal.runtime.executor.model_runner import ModelRunner
from shoal.runtime.layers.sampler import SamplingMetadata, apply_token_bitmask, sample
from shoal.runtime.sampling_params import StructuredOutputsParams

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}}}


# ------------------------------------------------------------------ the bitmask op
@pytest.mark.parametrize("vocab", [1, 31, 32, 100, 1000])
def test_bitmask_matches_a_bit_by_bit_reference(vocab):
    g = torch.Generator().manual_seed(vocab)
    rows, words = 5, -(-vocab // 32)
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, words), dtype=torch.int32, generator=g)
    bitmask[1] = -1  # a row without constraints: all ones
    bitmask[2] = 0
    bitmask[2, 0] = 1  # one token allowed
    logits = torch.randn(rows, vocab, generator=g)
    got = logits.clone()
    apply_token_bitmask(got, bitmask)
    for r in range(rows):  # the layout, bit by bit in Python integers
        for t in range(vocab):
            allowed = (int(bitmask[r, t // 32]) >> (t % 32)) & 1
            assert got[r, t].item() == (logits[r, t].item() if allowed else float("-inf")), (r, t)
    assert torch.equal(got[1], logits[1])


def test_sampled_tokens_stay_inside_the_mask_with_bias_and_bans():
    vocab, rows = 300, 6
    g = torch.Generator().manual_seed(0)
    allowed = [sorted(torch.randperm(vocab, generator=g)[: 1 + 7 * r].tolist()) for r in range(rows)]
    bits = torch.zeros(rows, 320, dtype=torch.int64)
    for r, ids in enumerate(allowed):
        bits[r, ids] = 1
    words = (bits.view(rows, 10, 32) << torch.arange(32)).sum(-1)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    for greedy in (True, False):
        for trial in range(20):
            logits = torch.randn(rows, vocab, generator=g)
            best_disallowed = [max(set(range(vocab)) - set(ids), key=lambda t: logits[r, t]) for r, ids in enumerate(allowed)]
            m = SamplingMetadata(temperature=torch.full((rows,), 1.0), greedy=torch.full((rows,), greedy), all_greedy=greedy,
                                 bias_rows=torch.arange(rows), bias_ids=torch.tensor(best_disallowed),
                                 bias_values=torch.full((rows,), 100.0), token_bitmask=bitmask)
            tokens = sample(logits.clone(), m).token_ids
            for r, t in enumerate(tokens):
                assert t in allowed[r], (r, t)
            if greedy:  # inside the mask, greedy is the argmax of what is allowed
                assert tokens == [max(ids, key=lambda t: logits[r, t]) for r, ids in enumerate(allowed)]


# ------------------------------------------------------------------ the engine
@pytest.fixture(scope="module")
def tiny(tmp_path_factory, builtin_dir):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), builtin_dir)


def _check_json(outputs, schema=SCHEMA):
    for out in outputs:
        for c in out.outputs:
            assert c.finish_reason == "stop", c
            jsonschema.validate(json.loads(c.text), schema)


def _requests(n=2, count=4):
    spec = StructuredOutputsParams(json=SCHEMA)
    params = [SamplingParams(max_tokens=120, temperature=0.0 if i == 0 else 1.0, seed=i, n=1 if i == 0 else n,
                             structured_outputs=spec, output_kind="final_only") for i in range(count)]
    return [f"Person {i}:" for i in range(count)], params


@pytest.fixture(scope="module")
def llm(tiny):
    """The CPU default: decode steps in C (what `shoal serve` runs)."""
    engine = LLM(str(tiny), kv_cache_memory=2**24)
    assert engine.engine.executor.c_decode_max_seqs > 0
    yield engine
    engine.engine.shutdown()


@pytest.mark.parametrize("path", ["c_decode", "torch", "two_lanes"])
def test_json_schema_on_every_step_path(tiny, llm, path, monkeypatch):
    """c_decode: the CPU default; torch: the torch model; two_lanes: batches in flight as on
    a GPU, each lane's step prepared while the other's runs."""
    engine = llm
    if path != "c_decode":
        options = dict(kv_cache_memory=2**24, cpu_decode_max_seqs=0)
        if path == "two_lanes":
            monkeypatch.setattr(ModelRunner, "pipelined", property(lambda self: True))
            options["batches_in_flight"] = 2
        engine = LLM(str(tiny), **options)
        assert engine.engine.num_lanes == (2 if path == "two_lanes" else 1)
    prompts, params = _requests()
    outputs = engine.generate(prompts, params)
    _check_json(outputs)
    assert sum(len(o.outputs) for o in outputs) == 7  # n = 2 for the sampled ones: each sequence its own matcher
    assert engine.engine.pool.num_free == engine.engine.pool.num_blocks
    if engine is not llm:
        engine.engine.shutdown()


def test_preempted_sequences_keep_their_grammar(tiny):
    llm = LLM(str(tiny), kv_cache_memory=48 * 8192, max_num_seqs=16)  # 48 blocks of 16 tokens: too few for all
    prompts, params = _requests(n=1, count=6)
    prompts = [p * 12 for p in prompts] * 2
    outputs = llm.generate(prompts, params * 2)
    assert llm.engine.scheduler.num_preemptions > 0
    _check_json(outputs)
    llm.engine.shutdown()


def test_regex_choice_grammar_and_min_tokens(llm):
    regex, choices = r"[a-z]{2,5}-\d{3}", ["yes", "no", "maybe not"]
    cases = [(StructuredOutputsParams(regex=regex), lambda t: re.fullmatch(regex, t)),
             (StructuredOutputsParams(choice=choices), lambda t: t in choices),
             (StructuredOutputsParams(grammar='root ::= "(" [0-9] [0-9]? ")"'), lambda t: re.fullmatch(r"\(\d\d?\)", t))]
    for spec, ok in cases:
        for seed in (None, 1, 2):
            p = SamplingParams(max_tokens=40, temperature=0.0 if seed is None else 1.5, seed=seed, structured_outputs=spec)
            c = llm.generate(["x"], p)[0].outputs[0]
            assert c.finish_reason == "stop" and ok(c.text), (spec, c)
    # the grammar allows only EOS after "ok"; min_tokens asks for more: the grammar wins, no NaN row
    p = SamplingParams(max_tokens=20, min_tokens=10, temperature=1.0, seed=0, structured_outputs=StructuredOutputsParams(choice=["ok"]))
    c = llm.generate(["x"], p)[0].outputs[0]
    assert c.text == "ok" and c.finish_reason == "stop"


def test_allowed_token_ids_bad_words_and_logit_bias(llm):
    allowed = [300, 301, 302, 5000]
    c = llm.generate(["hi"], SamplingParams(max_tokens=30, temperature=1.0, seed=3, allowed_token_ids=allowed))[0].outputs[0]
    assert len(c.token_ids) == 30 and set(c.token_ids) <= set(allowed)
    free = llm.generate(["hi"], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0].outputs[0]
    word = llm.tokenizer.decode(free.token_ids[:1]).strip()
    assert word
    banned = llm.generate(["hi"], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, bad_words=[word]))[0].outputs[0]
    assert banned.token_ids[0] != free.token_ids[0]
    for text in (word, " " + word):
        ids = llm.tokenizer(text, add_special_tokens=False).input_ids
        assert not any(banned.token_ids[i : i + len(ids)] == ids for i in range(len(banned.token_ids))), (text, banned)
    forced = llm.generate(["hi"], SamplingParams(max_tokens=5, temperature=1.0, seed=0, logit_bias={4321: 100.0}))[0].outputs[0]
    assert forced.token_ids == [4321] * 5
    for bad in (dict(logit_bias={49152: 1.0}), dict(allowed_token_ids=[10**6]), dict(logit_bias={1: 101.0}), dict(allowed_token_ids=[])):
        with pytest.raises(ValueError):
            llm.engine.add_request("bad", "x", SamplingParams(**bad))
    with pytest.raises(ValueError, match="cannot be compiled"):
        llm.engine.add_request("bad", "x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-")))
    assert not llm.engine.has_unfinished_requests()

"""Async scheduling (`--async-scheduling`, on by default in one GPU process): step N+1 is
scheduled, prepared and launched before step N's tokens are read back, and the model
runner fills N's tokens into N+1's inputs on the device. Forced on here, on the CPU, where
the same engine and runner code runs: the tokens must be the serial engine's."""

import pytest

from engine_helpers import make_tiny_model
from shoal import LLM, SamplingParams
from shoal.runtime.sampling_params import StructuredOutputsParams
from shoal.runtime.executor.model_runner import ModelRunner


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, builtin_dir):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), builtin_dir, vocab_size=512)


PROMPTS = [[5 + i, 6, 7, 8 + i] * (1 + i % 3) for i in range(12)]


def mixed_params() -> list[SamplingParams]:
    """Every kind of request the overlapped path treats differently: greedy and sampled
    (seeded), logprobs, n = 2 (forks when its prompt completes), min_tokens (counts tokens
    still in flight), repetition, presence and frequency penalties (their histories get the
    token in flight on the device), bad words (read on the host: the step before is read
    back first), stop tokens, EOS allowed, and lengths that end in the middle of the batch."""
    out = []
    for i in range(len(PROMPTS)):
        out.append(SamplingParams(
            max_tokens=3 + 2 * i, temperature=0.0 if i % 2 else 0.9, seed=i, ignore_eos=i % 3 != 0,
            logprobs=2 if i in (3, 8) else None, n=2 if i == 4 else 1, min_tokens=4 if i == 5 else 0,
            repetition_penalty=1.3 if i in (6, 9) else 1.0, stop_token_ids=[100, 200, 300] if i == 7 else None,
            presence_penalty=1.5 if i in (9, 10) else 0.0, frequency_penalty=1.0 if i == 10 else 0.0,
            bad_words=["t", "a e"] if i == 1 else None))
    return out


def run(tiny, params, **kwargs):
    llm = LLM(str(tiny), kv_cache_memory=kwargs.pop("kv_cache_memory", 2**24), **kwargs)
    outputs = llm.generate(PROMPTS, params)
    engine = llm.engine
    assert engine.pool.num_free == engine.pool.num_blocks, "every block is given back"
    assert not engine._in_flight
    return engine, [[(c.token_ids, c.finish_reason, c.stop_reason, c.text, c.logprobs) for c in o.outputs] for o in outputs]


def assert_same(got, want):
    for g_req, w_req in zip(got, want, strict=True):
        for g, w in zip(g_req, w_req, strict=True):
            assert g[:4] == w[:4]
            if w[4] is not None:
                for gl, wl in zip(g[4], w[4], strict=True):
                    assert gl.keys() == wl.keys() and list(gl.values()) == pytest.approx(list(wl.values()), abs=1e-5)


@pytest.mark.parametrize("c_decode", [256, 0], ids=["c-decode-step", "torch"])
def test_async_scheduling_gives_the_serial_tokens(tiny, c_decode):
    params = mixed_params()
    _, want = run(tiny, params, async_scheduling=False, cpu_decode_max_seqs=c_decode)
    engine, got = run(tiny, params, async_scheduling=True, cpu_decode_max_seqs=c_decode)
    assert engine.overlap
    assert_same(got, want)


def test_preemption_with_tokens_in_flight(tiny):
    """A cache too small for the batch: sequences are preempted while their token is in
    flight, land in the waiting queue, and are recomputed once it is back."""
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True) for _ in PROMPTS]
    _, want = run(tiny, params, async_scheduling=False)
    block_bytes = 2 * 2 * 2 * 16 * 16 * 4  # K and V, 2 layers, 2 KV heads, 16 tokens, head dim 16, float32
    engine, got = run(tiny, params, async_scheduling=True, kv_cache_memory=20 * block_bytes)  # the batch needs ~48
    assert engine.scheduler.num_preemptions > 0
    assert_same(got, want)


def test_penalties_count_the_token_in_flight(tiny):
    """A penalized row sampled while its last token is in flight: the runner writes that
    token into the histories on the device. Chosen so that the last token decides: prompts
    whose greedy output repeats a token back to back (a repetition penalty breaks the repeat
    only if it counts the token just sampled), and a logit bias that presence and frequency
    penalties overcome only when they count every occurrence."""
    prompts = [[5 + i, 6 + 2 * i, 7, 8 + i] for i in range(60)]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    free = LLM(str(tiny), kv_cache_memory=2**24, async_scheduling=False).generate(prompts, greedy)
    repeats = [p for p, o in zip(prompts, free) if any(a == b for a, b in zip(o.outputs[0].token_ids, o.outputs[0].token_ids[1:]))]
    assert repeats, "no prompt repeats a token: pick others"
    params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, repetition_penalty=2.0)] * len(repeats)
    params += [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logit_bias={300: 6.0}, presence_penalty=2.0,
                              frequency_penalty=1.0)] * 2
    batch = repeats + prompts[:2]
    want, got = ([o.outputs[0].token_ids for o in LLM(str(tiny), kv_cache_memory=2**24, async_scheduling=mode).generate(batch, params)]
                 for mode in (False, True))
    assert got == want
    assert [w.count(300) for w in want[-2:]] != [16, 16]  # the penalties did overcome the bias


def launches_and_reads(tiny, params, **kwargs):
    """The order in which the engine launches steps, samples those it launched without their
    sampling, and reads their tokens back: ("launch" | "sample" | "read", step)."""
    llm = LLM(str(tiny), kv_cache_memory=2**24, **kwargs)
    engine, events = llm.engine, []
    launch, sample_later = engine.executor.execute_async, engine.executor.sample_async

    def logged_reads(pending, k):
        result = pending.result

        def logged_result():
            events.append(("read", k))
            return result()

        pending.result = logged_result
        return pending

    def logged_launch(step):
        k = sum(1 for e in events if e[0] == "launch")
        events.append(("launch", k))
        pending = launch(step)
        return logged_reads(pending, k) if step.sampling is not None else pending  # else: logits, sampled later

    def logged_sample(logits, sampling):
        k = sum(1 for e in events if e[0] == "launch") - 1
        events.append(("sample", k))
        return logged_reads(sample_later(logits, sampling), k)

    engine.executor.execute_async = logged_launch
    engine.executor.sample_async = logged_sample
    llm.generate(PROMPTS[:4], params)
    return events


def assert_launched_before_the_last_is_read(events):
    order = {e: i for i, e in enumerate(events)}
    steps = sum(1 for e in events if e[0] == "launch")
    assert steps >= 8
    for k in range(steps - 1):  # every step but the last: the next one is already queued when its tokens are read
        assert order[("launch", k + 1)] < order[("read", k)], events
    return order


def test_each_step_is_launched_before_the_previous_ones_tokens_are_read(tiny):
    events = launches_and_reads(tiny, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), async_scheduling=True)
    assert_launched_before_the_last_is_read(events)
    assert not any(e[0] == "sample" for e in events)


def test_penalized_steps_overlap_too(tiny):
    """Penalties read the tokens so far, the one in flight included, on the device."""
    events = launches_and_reads(tiny, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, presence_penalty=0.5,
                                                     repetition_penalty=1.2), async_scheduling=True)
    assert_launched_before_the_last_is_read(events)
    assert not any(e[0] == "sample" for e in events)


@pytest.mark.parametrize("asks", [{"bad_words": ["t", "a e"]}, {"structured_outputs": StructuredOutputsParams(regex="[a-z ]{1,40}")}],
                         ids=["bad-words", "grammar"])
def test_a_step_whose_sampling_reads_tokens_on_the_host_runs_its_forward_first(tiny, asks):
    """Bad words and grammars read the tokens so far on the host: the step's forward is
    launched before the previous step's tokens are read, its sampling only after."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, **asks)
    events = launches_and_reads(tiny, params, async_scheduling=True)
    order = assert_launched_before_the_last_is_read(events)
    sampled_later = [k for kind, k in events if kind == "sample"]
    assert len(sampled_later) >= 6
    for k in sampled_later:
        assert order[("read", k - 1)] < order[("sample", k)] < order[("read", k)], events


def test_sampling_that_reads_the_host_gives_the_serial_tokens(tiny):
    """Bad words and grammars sampled after the previous step is read, beside plain rows that
    overlap, and rows that the previous step ended (their late sampling is dropped)."""
    params = [SamplingParams(max_tokens=4 + 3 * i, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=i % 3 != 0,
                             bad_words=["t", "in on"] if i % 4 == 1 else None, min_tokens=3 if i == 5 else 0,
                             structured_outputs=StructuredOutputsParams(regex="[a-z ]{2,30}") if i % 4 == 2 else None)
              for i in range(len(PROMPTS))]
    _, want = run(tiny, params, async_scheduling=False)
    engine, got = run(tiny, params, async_scheduling=True)
    assert_same(got, want)


def test_no_step_is_spent_on_a_sequence_that_its_tokens_in_flight_end(tiny):
    """max_tokens reached by the token in flight: the next step does not compute it."""
    computed = {}
    for mode in (False, True):
        llm = LLM(str(tiny), kv_cache_memory=2**24, async_scheduling=mode)
        launch, rows = llm.engine.executor.execute_async, []
        llm.engine.executor.execute = lambda step, _run=llm.engine.executor.execute: (rows.append(step.input_ids.numel()), _run(step))[1]
        llm.engine.executor.execute_async = lambda step: (rows.append(step.input_ids.numel()), launch(step))[1]
        out = llm.generate(PROMPTS[:6], [SamplingParams(max_tokens=1 + i, temperature=0.0, ignore_eos=True) for i in range(6)])
        assert [len(o.outputs[0].token_ids) for o in out] == [1 + i for i in range(6)]
        computed[mode] = sum(rows)
    assert computed[True] == computed[False] == sum(map(len, PROMPTS[:6])) + sum(range(6))


def test_abort_while_a_step_is_in_flight_frees_its_blocks(tiny):
    llm = LLM(str(tiny), kv_cache_memory=2**24, async_scheduling=True)
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine._in_flight and engine.pool.num_free < engine.pool.num_blocks
    for i in range(len(PROMPTS)):
        engine.abort_request(f"r{i}")
    assert not engine._in_flight and not engine.has_unfinished_requests()
    assert engine.pool.num_free == engine.pool.num_blocks
    assert engine.step() == []


def test_async_scheduling_refuses_what_it_cannot_overlap(tiny, monkeypatch):
    monkeypatch.setattr(ModelRunner, "pipelined", property(lambda self: True))  # as on a GPU
    with pytest.raises(ValueError, match="async scheduling"):
        LLM(str(tiny), kv_cache_memory=2**24, async_scheduling=True, batches_in_flight=2)
    assert LLM(str(tiny), kv_cache_memory=2**24).engine.overlap, "on by default where the device runs behind the host"
    monkeypatch.undo()
    assert not LLM(str(tiny), kv_cache_memory=2**24).engine.overlap, "off by default on a CPU"

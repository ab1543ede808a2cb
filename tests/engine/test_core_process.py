"""The engine-core process (core_process.py) and its client (core_client.py) against the
engine in this process (the `llm` fixture's LLMEngine, which detokenizes and checks stop
strings itself): the same requests give the same tokens, text, logprobs and finish reasons
in every output kind; and a killed core fails the AsyncEngine above it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from process_helpers import all_gone, children_of
from shoal import SamplingParams
from shoal.runtime.config import EngineConfig

PROMPTS = ["The capital of France is", "Write a short poem about the sea.", "List three colours:", "Once upon a time"]


@pytest.fixture(scope="module")
def core():
    from shoal.runtime.engine.core_client import CoreClient

    client = CoreClient(EngineConfig(dtype="float32", kv_cache_memory=2**28, max_num_batched_tokens=512))  # as the llm fixture
    yield client
    client.shutdown()
    assert client.process.exitcode == 0


def run(engine, requests: dict[str, tuple]) -> dict[str, list]:
    """Add every (prompt, params) at once, step until all end: each request's outputs in order."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    got = {rid: [] for rid in requests}
    deadline = time.monotonic() + 300
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline
        for out in engine.step():
            got[out.request_id].append(out)
    return got


def final(outputs: list, kind: str) -> dict[int, tuple]:
    """index -> (text, token ids, logprobs, finish reason, stop reason) of each sequence at the end."""
    seqs: dict[int, list] = {}
    for out in outputs:
        for co in out.outputs:
            text, ids, lps, _, _ = seqs.get(co.index, ("", [], [], None, None))
            if kind == "delta":
                seqs[co.index] = [text + co.text, ids + co.token_ids, lps + (co.logprobs or []), co.finish_reason, co.stop_reason]
            else:
                seqs[co.index] = [co.text, co.token_ids, co.logprobs or [], co.finish_reason, co.stop_reason]
    assert outputs and outputs[-1].finished
    return {i: tuple(v) for i, v in seqs.items()}


def same(got: dict, want: dict, rid: str) -> None:
    """Equal text, tokens and finish; logprobs of the same tokens, equal to float noise (the
    two engines batch the requests differently, which changes the sums' order)."""
    assert got.keys() == want.keys(), rid
    for i in want:
        (text, ids, lps, *finish), (want_text, want_ids, want_lps, *want_finish) = got[i], want[i]
        assert (text, ids, finish) == (want_text, want_ids, want_finish), rid
        assert [sorted(d) for d in lps] == [sorted(d) for d in want_lps], rid
        assert [d[t] for d, t in zip(lps, ids)] == pytest.approx([d[t] for d, t in zip(want_lps, want_ids)], abs=1e-3), rid


def both(llm, core, requests: dict[str, tuple], prefix: str):
    """Run the same requests through both backends (ids prefixed so each run has its own)."""
    ref = run(llm.engine, {f"{prefix}-{k}": v for k, v in requests.items()})
    got = run(core, {f"{prefix}-{k}": v for k, v in requests.items()})
    return ref, got


@pytest.mark.parametrize("kind", ["delta", "cumulative", "final_only"])
def test_greedy_and_seeded_outputs_equal_the_engine_in_process(llm, core, kind):
    requests = {}
    for i, prompt in enumerate(PROMPTS):
        requests[f"g{i}"] = (prompt, SamplingParams(max_tokens=24, temperature=0.0, output_kind=kind, logprobs=2 if i == 0 else None))
        requests[f"s{i}"] = (prompt, SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=100 + i, output_kind=kind))
    requests["n2"] = (PROMPTS[1], SamplingParams(n=2, max_tokens=16, temperature=1.0, seed=7, output_kind=kind))
    requests["p"] = (PROMPTS[2], SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=2, output_kind=kind))
    ref, got = both(llm, core, requests, f"same-{kind}")
    # the prompt's logprobs: once (delta: with the first tokens), the same tokens and ranks, values to float noise
    [want], [have] = ([o.prompt_logprobs for o in outs if o.prompt_logprobs is not None][:1] for outs in (ref[f"same-{kind}-p"], got[f"same-{kind}-p"]))
    assert len(have) == len(want) > 3 and have[0] is None and want[0] is None
    for h, w in zip(have[1:], want[1:]):
        assert {t: lp.rank for t, lp in h.items()} == {t: lp.rank for t, lp in w.items()}
        assert [h[t].logprob for t in w] == pytest.approx([w[t].logprob for t in w], abs=1e-3)
    if kind == "delta":
        assert sum(o.prompt_logprobs is not None for o in got[f"same-{kind}-p"]) == 1
    for rid in ref:
        same(final(got[rid], kind), final(ref[rid], kind), rid)
        assert len(got[rid]) == len(ref[rid]), rid  # as many outputs: one a step while it runs (final_only: one)
    if kind == "delta":  # tokens arrived step by step, not in one lump
        assert sum(map(len, got.values())) > 3 * len(got)
    assert sum(len(seq[0]) for outs in ref.values() for seq in final(outs, kind).values()) > 200  # real text was compared


def test_stop_strings_cut_exactly_as_the_engine_in_process(llm, core):
    """Stop strings taken from the middle of greedy and seeded texts (spanning token boundaries
    or not), with and without include_stop_str_in_output, n=2, and every output kind."""
    base = run(llm.engine, {f"base{i}": (p, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
                                  for i, p in enumerate(PROMPTS)})
    requests = {}
    for i, prompt in enumerate(PROMPTS):
        text = final(base[f"base{i}"], "delta")[0][0]
        assert len(text) > 30
        for j, (start, length) in enumerate([(12, 3), (20, 6)]):
            stop = text[start:start + length]
            for include in (False, True):
                for kind in ("delta", "cumulative", "final_only"):
                    requests[f"{i}-{j}-{include}-{kind}"] = (prompt, SamplingParams(
                        max_tokens=32, temperature=0.0, ignore_eos=True, stop=[stop, "never appears"], include_stop_str_in_output=include, output_kind=kind))
        requests[f"{i}-n2"] = (prompt, SamplingParams(n=2, max_tokens=24, temperature=0.8, seed=11 + i, stop=[" the", "."]))
    ref, got = both(llm, core, requests, "stop")
    stopped = 0
    for rid in ref:
        kind = next((k for k in ("delta", "cumulative", "final_only") if rid.endswith(k)), "delta")
        want = final(ref[rid], kind)
        same(final(got[rid], kind), want, rid)
        stopped += sum(1 for seq in want.values() if seq[3] == "stop" and isinstance(seq[4], str))
    assert stopped >= len(requests) // 2  # most of them did end on their stop string
    # the core stopped what the client stopped: nothing of theirs holds blocks any more
    assert core.stats().num_running == 0 and core.stats().kv_cache_usage == 0.0


def test_bad_requests_are_refused_in_the_client_as_the_engine_refuses_them(llm, core):
    for prompt, params in [("", SamplingParams()), ([10**9], SamplingParams()), ("hi", SamplingParams(logit_bias={10**9: 1.0})),
                           ("word " * 10000, SamplingParams())]:
        with pytest.raises(ValueError) as ref:
            llm.engine.add_request("bad", prompt, params)
        with pytest.raises(ValueError) as got:
            core.add_request("bad", prompt, params)
        assert str(got.value) == str(ref.value)
    assert not core.has_unfinished_requests()


def test_a_killed_core_fails_the_async_engine_and_its_request():
    from shoal.runtime.engine.async_engine import AsyncEngine, Failed, Output
    from shoal.runtime.engine.core_client import CoreClient

    async def main():
        engine = AsyncEngine(EngineConfig(kv_cache_memory=2**26, max_model_len=512), engine_factory=CoreClient)
        loaded = asyncio.Event()
        engine.start(on_loaded=loaded.set)
        await asyncio.wait_for(loaded.wait(), 300)
        assert engine.health() == (True, "ok")
        queue: asyncio.Queue = asyncio.Queue()
        engine.submit("long", "Tell me a story", SamplingParams(max_tokens=400, ignore_eos=True), queue)
        items = [await asyncio.wait_for(queue.get(), 120) for _ in range(3)]  # accepted, then tokens
        assert isinstance(items[-1], Output) and items[-1].deltas[0].token_ids
        os.kill(engine.engine.process.pid, signal.SIGKILL)
        while not isinstance(item := await asyncio.wait_for(queue.get(), 60), Failed):
            assert isinstance(item, Output) and not item.finished
        assert not item.engine_alive and "engine core process exited" in item.message
        ok, why = engine.health()
        assert not ok and "engine core process exited" in why
        engine.stop()

    asyncio.run(main())


def test_a_core_with_two_pipeline_ranks_answers_as_the_engine_in_process_and_takes_them_down(llm):
    """The core starts its own rank processes (torch.distributed, gloo); the same greedy text and
    log-probs as one rank in this process; the ranks end with the core, whether it is shut down
    or killed; a rank that dies takes the core down, and the client says so."""
    from shoal.runtime.engine.core_client import CoreClient, CoreDied

    config = EngineConfig(dtype="float32", kv_cache_memory=2**28, max_num_batched_tokens=512, pipeline_parallel_size=2)
    for ending in ("shutdown", "kill", "rank dies"):
        client = CoreClient(config)
        try:
            ranks = set(children_of(client.process.pid))
            assert ranks  # rank 0 runs in the core; rank 1 (and whatever torch starts) are its children
            if ending == "shutdown":
                requests = {f"g{i}": (p, SamplingParams(max_tokens=16, temperature=0.0, logprobs=2))
                            for i, p in enumerate(PROMPTS)}
                ref, got = both(llm, client, requests, "pp")
                for rid in ref:
                    same(final(got[rid], "cumulative"), final(ref[rid], "cumulative"), rid)
                assert client.stats().num_running == 0 and client.stats().kv_cache_usage == 0.0
                client.shutdown()
                assert client.process.exitcode == 0
            elif ending == "kill":
                os.kill(client.process.pid, signal.SIGKILL)
                client.process.join(30)
            else:  # idle, the group loses a rank: the core exits, and the client's next poll raises
                assert client.group_ready()
                rank = next(p for p in ranks if b"executor.worker" in open(f"/proc/{p}/cmdline", "rb").read())
                os.kill(rank, signal.SIGKILL)
                with pytest.raises(CoreDied, match="engine core process exited"):
                    deadline = time.monotonic() + 60
                    while time.monotonic() < deadline:
                        client.stats()  # what the server's engine thread polls twice a second when idle
                        time.sleep(0.5)
            assert all_gone(ranks, 60), f"rank processes left after the core's {ending}"
        finally:
            client.shutdown()


def test_a_program_that_never_shuts_its_client_down_still_exits(tmp_path):
    """The core ends with the interpreter (before multiprocessing's exit hook would wait on it)."""
    script = tmp_path / "forgets.py"
    script.write_text(
        "from shoal.runtime.config import EngineConfig\n"
        "from shoal.runtime.engine.core_client import CoreClient\n"
        "if __name__ == '__main__':  # the spawned core imports this file again\n"
        "    client = CoreClient(EngineConfig(kv_cache_memory=2**26, max_model_len=256))\n"
        "    print(client.process.pid, flush=True)\n")
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert all_gone({int(r.stdout.split()[0])}, 5)

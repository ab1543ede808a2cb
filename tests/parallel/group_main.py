"""One "pod" (or a local-launch leader) of a test group, run as its own process.

    python group_main.py leader|worker MODEL_DIR TP PP KV_BYTES [--out FILE] [--forever] [--probe-port N]

leader: runs the engine (global rank 0) on the mixed prompts and writes the greedy tokens
to --out as JSON; with --forever it keeps generating (for the kill tests) and prints
"PIDS <pid>..." (its own and its children's) and "GENERATING" once the first tokens are out.
worker: a pod with SHOAL_PIPELINE_RANK > 0: run_worker_pod_if_needed must return True.
The pod-group shape comes from the SHOAL_* environment when it is set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("SHOAL_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

from parallel_helpers import mixed_prompts  # noqa: E402
from shoal.runtime.config import EngineConfig  # noqa: E402
from shoal.runtime.executor.worker_pod import run_worker_pod_if_needed  # noqa: E402
from shoal.runtime.sampling_params import SamplingParams  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["leader", "worker"])
    p.add_argument("model")
    p.add_argument("tp", type=int)
    p.add_argument("pp", type=int)
    p.add_argument("kv", type=int)
    p.add_argument("--out")
    p.add_argument("--forever", action="store_true")
    p.add_argument("--port", type=int, default=0, help="worker: the probe port")
    p.add_argument("--probe-port", type=int, default=0, help="leader: a worker pod's probe port to check")
    p.add_argument("--drain-on-sigterm", action="store_true",
                   help="leader --forever: on SIGTERM add no requests, finish those in flight, print DRAINED N, "
                        "shut the group down (as the server's drain does)")
    a = p.parse_args()
    config = EngineConfig(model=a.model, tensor_parallel_size=a.tp, pipeline_parallel_size=a.pp, kv_cache_memory=a.kv,
                          max_num_batched_tokens=128, extra={"heartbeat_timeout": 5.0})
    if a.role == "worker":
        assert run_worker_pod_if_needed(config, host="127.0.0.1", port=a.port) is True
        return 0
    assert run_worker_pod_if_needed(config) is False
    from shoal.runtime.engine.engine import LLMEngine

    engine = LLMEngine(config)
    ex = engine.executor
    print("PIDS", os.getpid(), *[c.pid for c in getattr(ex, "children", [])], flush=True)
    if a.forever:
        import signal

        params = SamplingParams(max_tokens=100, min_tokens=100, temperature=0.0)
        n, announced, finished, term = 0, False, 0, []
        if a.drain_on_sigterm:
            signal.signal(signal.SIGTERM, lambda *_: term.append(1))
        while True:
            if term:
                while engine.has_unfinished_requests():
                    finished += sum(o.finished for o in engine.step())
                print("DRAINED", finished, flush=True)
                engine.shutdown()
                return 0
            if not engine.has_unfinished_requests():
                for prompt in mixed_prompts():
                    engine.add_request(f"r{n}", prompt, params)
                    n += 1
            if engine.step() and not announced:
                print("GENERATING", flush=True)
                announced = True
    from shoal.runtime.entrypoints.llm import LLM

    llm = LLM.__new__(LLM)
    llm.engine, llm._ids = engine, iter(range(10**9))
    greedy = SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0)
    tokens = [o.outputs[0].token_ids for o in llm.generate(mixed_prompts(), greedy)]
    result = {"tokens": tokens, "ready": ex.group_ready(), "preemptions": engine.stats().num_preemptions}
    if a.probe_port:
        for path in ("/health", "/ready"):
            with urllib.request.urlopen(f"http://127.0.0.1:{a.probe_port}{path}", timeout=10) as r:
                result[path] = r.status
    Path(a.out).write_text(json.dumps(result))
    engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

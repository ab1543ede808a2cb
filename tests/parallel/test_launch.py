"""Launching a group: shapes refused up front, the SHOAL_* pod-group launch (one process
per "pod") agreeing with the local launch, and a dead rank taking the whole group down."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parallel_helpers import kv_memory, single_rank
from process_helpers import all_gone, children_of
from shoal.runtime.executor import launch

MAIN = str(Path(__file__).resolve().parent / "group_main.py")
EXIT_WITHIN = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pod_env(pipeline_rank: int, tp: int, pp: int, port: int) -> dict:
    env = dict(os.environ, SHOAL_GROUP="test-group", SHOAL_PIPELINE_RANK=str(pipeline_rank), SHOAL_PIPELINE_SIZE=str(pp),
               SHOAL_TENSOR_SIZE=str(tp), SHOAL_LEADER_ADDR="127.0.0.1", SHOAL_DIST_PORT=str(port), SHOAL_NUM_THREADS="1")
    return env


def local_env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_") or k in ("SHOAL_CACHE", "SHOAL_NUM_THREADS")}


def start(role: str, model, shape: tuple[int, int], env: dict, *args) -> subprocess.Popen:
    """One group process. In a pod group its flags say tensor 1 x pipeline 1 on purpose:
    the SHOAL_* environment gives the shape; the KV cache is sized for `shape`."""
    from shoal.runtime.models.loader import load_config

    kv = kv_memory(load_config(model), *shape)
    tp, pp = (1, 1) if "SHOAL_PIPELINE_RANK" in env else shape
    return subprocess.Popen([sys.executable, MAIN, role, str(model), str(tp), str(pp), str(kv), *args], env=env,
                            stdout=subprocess.PIPE, text=True)


def wait_for_line(proc: subprocess.Popen, word: str, timeout: float = 180.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"process exited ({proc.wait()}) before printing {word}")
        if line.startswith(word):
            return line
    raise AssertionError(f"no {word} within {timeout}s")


def reap(*procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


# ---------------------------------------------------------------- shapes


def test_unsplittable_model_is_refused_before_any_process_starts(builtin_dir, monkeypatch):
    from shoal import LLM

    def no_spawn(*a, **k):
        raise AssertionError("a rank was started for a shape that cannot work")

    monkeypatch.setattr(launch, "spawn_rank", no_spawn)
    monkeypatch.setattr(launch, "open_leader_store", no_spawn)
    with pytest.raises(ValueError, match=r"9 attention heads are not divisible by tensor_parallel_size 2.*\[1, 3\]"):
        LLM(str(builtin_dir), tensor_parallel_size=2)


@pytest.mark.parametrize("tp,pp,ok", [(4, 1, True), (2, 4, True), (3, 1, False), (8, 1, False), (1, 5, False)])
def test_check_parallel_shape(tp, pp, ok):
    from types import SimpleNamespace

    cfg = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, num_hidden_layers=4,
                          hidden_size=64, head_dim=16, vocab_size=1000)
    if ok:
        launch.check_parallel_shape(cfg, tp, pp)
    else:
        with pytest.raises(ValueError, match="cannot run this model"):
            launch.check_parallel_shape(cfg, tp, pp)
    with pytest.raises(ValueError, match="cannot split 4 layers"):
        launch.check_parallel_shape(cfg, 1, 2, [4, 0])


def test_group_from_env(monkeypatch):
    from shoal.runtime.config import EngineConfig

    assert launch.group_from_env() is None
    for k, v in pod_env(1, 2, 3, 29500).items():
        if k.startswith("SHOAL_"):
            monkeypatch.setenv(k, v)
    config = EngineConfig()
    spec = launch.group_from_env(config)
    assert (spec.tensor, spec.pipeline, spec.pipeline_rank, spec.port, spec.local_ranks()) == (2, 3, 1, 29500, [2, 3])
    assert (config.tensor_parallel_size, config.pipeline_parallel_size) == (2, 3)
    with pytest.raises(ValueError, match="disagrees"):
        launch.group_from_env(EngineConfig(tensor_parallel_size=4))


# ---------------------------------------------------------------- pod-group launch


def test_pod_group_launch_matches_local_launch(tiny_dir, tmp_path):
    """tensor 2 x pipeline 2 as two "pods" started separately: the worker pod first (it
    waits for its leader), each pod running its own two tensor ranks."""
    tp, pp, port, probe = 2, 2, free_port(), free_port()
    out = tmp_path / "tokens.json"
    worker = start("worker", tiny_dir, (tp, pp), pod_env(1, tp, pp, port), "--port", str(probe))
    time.sleep(1)
    leader = start("leader", tiny_dir, (tp, pp), pod_env(0, tp, pp, port), "--out", str(out), "--probe-port", str(probe))
    try:
        assert leader.wait(300) == 0
        assert worker.wait(60) == 0  # told to stop: a clean exit
    finally:
        reap(leader, worker)
    result = json.loads(out.read_text())
    assert result["ready"] and result["/health"] == 200 and result["/ready"] == 200
    assert result["preemptions"] > 0
    assert result["tokens"] == single_rank(tiny_dir)


# ---------------------------------------------------------------- failure


def _assert_all_exit(procs: dict, pids: list[int], started: float) -> None:
    for name, p in procs.items():
        code = p.wait(max(1.0, EXIT_WITHIN - (time.monotonic() - started)))
        assert code != 0, f"{name} exited 0 after a rank died"
    assert all_gone(pids, EXIT_WITHIN - (time.monotonic() - started)), "rank processes left behind"


def test_killing_a_worker_pod_rank_ends_the_group(tiny_dir):
    """Kill rank 3 (the worker pod's second tensor rank) mid-generation: both pods and the
    leader's own tensor rank exit non-zero within 30 s."""
    tp, pp, port = 2, 2, free_port()
    worker = start("worker", tiny_dir, (tp, pp), pod_env(1, tp, pp, port), "--port", "0")
    leader = start("leader", tiny_dir, (tp, pp), pod_env(0, tp, pp, port), "--forever")
    try:
        pids = [int(x) for x in wait_for_line(leader, "PIDS").split()[1:]]
        wait_for_line(leader, "GENERATING")
        victim = children_of(worker.pid)
        assert len(victim) == 1
        os.kill(victim[0], signal.SIGKILL)
        started = time.monotonic()
        _assert_all_exit({"leader pod": leader, "worker pod": worker}, pids[1:], started)
        assert time.monotonic() - started < EXIT_WITHIN
    finally:
        reap(leader, worker)


@pytest.mark.parametrize("victim", ["leader", "worker"])
def test_killing_a_rank_of_a_local_launch_ends_the_group(tiny_dir, victim):
    """Local launch, pipeline 2: kill either rank mid-generation; the other exits (the
    leader non-zero) within 30 s and no process is left behind."""
    leader = start("leader", tiny_dir, (1, 2), local_env(), "--forever")
    try:
        pids = [int(x) for x in wait_for_line(leader, "PIDS").split()[1:]]
        wait_for_line(leader, "GENERATING")
        assert len(pids) == 2
        os.kill(pids[0] if victim == "leader" else pids[1], signal.SIGKILL)
        started = time.monotonic()
        if victim == "worker":
            _assert_all_exit({"leader": leader}, pids[1:], started)
        else:
            leader.wait(5)
            _assert_all_exit({}, pids[1:], started)
    finally:
        reap(leader)


@pytest.mark.parametrize("pp", [2, 3, 4, 30])
@pytest.mark.parametrize("vocab", [1000, 49152, 400000])
def test_default_split_balances_stage_weights(builtin_dir, pp, vocab):
    """Every stage gets a layer; the stages' weights (the last one's LM head included) are
    as even as whole layers allow (an LM head heavier than a share leaves the last stage one layer)."""
    from shoal.runtime.models.decoder import balanced_split, head_dim_of
    from shoal.runtime.models.loader import load_config

    cfg = load_config(builtin_dir)
    cfg.vocab_size = vocab
    split = balanced_split(cfg, pp)
    assert len(split) == pp and sum(split) == cfg.num_hidden_layers and min(split) >= 1
    d, h, kv = head_dim_of(cfg), cfg.num_attention_heads, cfg.num_key_value_heads
    layer = cfg.hidden_size * d * (2 * h + 2 * kv) + 3 * cfg.hidden_size * cfg.intermediate_size
    weights = [n * layer for n in split]
    weights[-1] += vocab * cfg.hidden_size
    assert max(weights[:-1]) - min(weights[:-1]) <= layer
    if split[-1] > 1:
        assert abs(weights[-1] - sum(weights) / pp) <= layer / 2


def test_a_rank_dead_before_joining_fails_the_join_at_once(tiny_dir, monkeypatch):
    """exit_on_group_failure=False (a program embedding the offline LLM): a rank that dies
    before it joins raises GroupFailed within seconds, not after group_join_timeout."""
    from shoal import LLM
    from shoal.runtime.executor.distributed_executor import GroupFailed

    monkeypatch.setattr(launch, "spawn_rank", lambda *a, **k: subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"]))
    started = time.monotonic()
    with pytest.raises(GroupFailed, match="joining.*exited with code 3"):
        LLM(str(tiny_dir), tensor_parallel_size=2, extra={"exit_on_group_failure": False, "group_join_timeout": 300})
    assert time.monotonic() - started < EXIT_WITHIN


def test_a_rank_dying_mid_run_raises_group_failed(tiny_dir):
    """exit_on_group_failure=False: the next step after a rank died raises GroupFailed (the
    collective's own error may come before the watchdog's next look), and nothing hangs."""
    from shoal import LLM, SamplingParams
    from shoal.runtime.executor.distributed_executor import GroupFailed

    llm = LLM(str(tiny_dir), tensor_parallel_size=2, kv_cache_memory=kv_memory(_config(tiny_dir), 2, 1),
              extra={"exit_on_group_failure": False})
    params = SamplingParams(max_tokens=4, temperature=0.0)
    assert len(llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids) == 4
    (child,) = llm.engine.executor.children
    child.kill()
    child.wait(10)
    started = time.monotonic()
    with pytest.raises(GroupFailed, match="exited"):
        llm.generate([[8, 9, 10]], params)
    assert time.monotonic() - started < EXIT_WITHIN
    llm.engine.shutdown()


def _config(model_dir):
    from shoal.runtime.models.loader import load_config

    return load_config(model_dir)


# ---------------------------------------------------------------- SIGTERM (issue 19, defect 4)


def test_a_terminated_group_drains_through_its_worker_pod(tiny_dir):
    """Kubernetes signals every pod of a deleted group at once. The worker pod must keep
    serving its stage until the leader has finished the requests in flight and stops the
    group: both exit 0 and the requests finish (a worker that died on SIGTERM, as before,
    failed the leader's drain)."""
    tp, pp, port = 1, 2, free_port()
    env = dict(pod_env(1, tp, pp, port), SHOAL_DRAIN_TIMEOUT="60")
    worker = start("worker", tiny_dir, (tp, pp), env, "--port", "0")
    leader = start("leader", tiny_dir, (tp, pp), pod_env(0, tp, pp, port), "--forever", "--drain-on-sigterm")
    try:
        wait_for_line(leader, "GENERATING")
        os.kill(worker.pid, signal.SIGTERM)
        time.sleep(1.5)  # the worker pod would be gone by now
        assert worker.poll() is None, "the worker pod exited on SIGTERM before the leader stopped the group"
        os.kill(leader.pid, signal.SIGTERM)
        drained = int(wait_for_line(leader, "DRAINED", timeout=120).split()[1])
        assert drained > 0
        assert leader.wait(60) == 0
        assert worker.wait(30) == 0   # stopped by the leader, cleanly
    finally:
        reap(leader, worker)


def test_sigterm_bound_when_the_leader_never_stops_the_group():
    """In-process: SIGTERM does not kill; after the drain timeout (+ margin) the rank exits 0."""
    import threading

    from shoal.runtime.executor import worker_pod

    exits = []
    done = threading.Event()
    old_handler = signal.getsignal(signal.SIGTERM)
    old_margin = worker_pod.WORKER_DRAIN_MARGIN
    worker_pod.WORKER_DRAIN_MARGIN = 0.2
    try:
        assert worker_pod.keep_serving_on_sigterm(0.3, exit_=lambda code: (exits.append(code), done.set()))
        started = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        assert exits == []                       # still here, still serving
        assert done.wait(5)
        assert exits == [0] and time.monotonic() - started >= 0.5
    finally:
        worker_pod.WORKER_DRAIN_MARGIN = old_margin
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGTERM, old_handler)

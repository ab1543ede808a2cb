"""Starting the ranks of a group, on one machine or across the pods of a pod group.

A group is `tensor x pipeline` ranks (docs/design.md, "Pod groups"); global rank =
pipeline_rank * tensor + tensor_rank, and global rank 0 (the leader) runs the engine.

- **Local launch** (`LLM(tensor_parallel_size=2, ...)`, `shoal serve -tp 2 -pp 2` with no
  `SHOAL_*` group): the leader opens a TCPStore on 127.0.0.1 (a free port), then starts
  every other rank as a child process (`python -m shoal.runtime.executor.worker`).
- **Pod-group launch** (the operator's `SHOAL_*` environment): every pod runs `shoal serve`.
  Pod 0 is the leader: it opens the TCPStore on `SHOAL_DIST_PORT` (all interfaces), starts
  its `tensor - 1` local ranks as children and runs the engine. A pod with
  `SHOAL_PIPELINE_RANK` > 0 never builds an engine: `worker_pod.run_worker_pod_if_needed` runs its
  first rank in-process and its other `tensor - 1` ranks as children, serves a minimal
  `/health` and `/ready` on the HTTP port (the operator probes every pod), and returns
  True when the leader tells the group to stop. SIGTERM does not end a worker pod: the
  leader drains the group's in-flight requests first (worker_pod.keep_serving_on_sigterm).

Every rank then joins one torch.distributed world through the leader's store (gloo on
CPU, NCCL on CUDA for the tensor/pipeline data; a gloo group always carries the leader's
control messages). Liveness (`Watchdog`): every rank writes a heartbeat into the store;
the leader watches all of them, its own children, and how long a step has been running;
a worker watches the leader's heartbeat, the store itself, a `failed` flag, its parent
process and its own children. Any failure ends every process of the group non-zero.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from shoal.runtime.distributed import ParallelState

log = logging.getLogger(__name__)

ENV_CONFIG = "SHOAL_WORKER_CONFIG"
STORE_PREFIX = "shoal/"
HEARTBEAT_PERIOD = 0.5


def option(config, name: str, default):
    """An executor option from `config.extra` (e.g. heartbeat_timeout, pipeline_layer_split)."""
    return (getattr(config, "extra", None) or {}).get(name, default)


# ------------------------------------------------------------------ the group's shape


@dataclass
class GroupSpec:
    tensor: int
    pipeline: int
    pipeline_rank: int = 0  # this pod's stage (local launch: 0, this process hosts every rank)
    leader_addr: str = "127.0.0.1"
    port: int = 0  # 0: the leader picks a free port (local launch)
    name: str = "local"
    pod_group: bool = False  # True: ranks of other stages live in other pods

    @property
    def world_size(self) -> int:
        return self.tensor * self.pipeline

    def local_ranks(self) -> list[int]:
        """The global ranks this pod (or, locally, this machine) runs."""
        if not self.pod_group:
            return list(range(self.world_size))
        first = self.pipeline_rank * self.tensor
        return list(range(first, first + self.tensor))


def _env_int(name: str) -> int:
    value = os.environ.get(name, "")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def group_from_env(config=None) -> GroupSpec | None:
    """The pod group the operator described in SHOAL_* variables, or None (local launch)."""
    if not os.environ.get("SHOAL_PIPELINE_RANK") and not os.environ.get("SHOAL_LEADER_ADDR"):
        return None
    missing = [n for n in ("SHOAL_PIPELINE_RANK", "SHOAL_PIPELINE_SIZE", "SHOAL_TENSOR_SIZE", "SHOAL_LEADER_ADDR", "SHOAL_DIST_PORT")
               if not os.environ.get(n)]
    if missing:
        raise ValueError(f"pod-group launch needs {', '.join(missing)} (SHOAL_PIPELINE_RANK is set)")
    spec = GroupSpec(
        tensor=_env_int("SHOAL_TENSOR_SIZE"), pipeline=_env_int("SHOAL_PIPELINE_SIZE"),
        pipeline_rank=_env_int("SHOAL_PIPELINE_RANK"), leader_addr=os.environ["SHOAL_LEADER_ADDR"],
        port=_env_int("SHOAL_DIST_PORT"), name=os.environ.get("SHOAL_GROUP", "group"), pod_group=True,
    )
    if spec.tensor < 1 or spec.pipeline < 1 or not 0 <= spec.pipeline_rank < spec.pipeline:
        raise ValueError(f"bad pod group: tensor {spec.tensor}, pipeline {spec.pipeline}, rank {spec.pipeline_rank}")
    if config is not None:
        for field, value in (("tensor_parallel_size", spec.tensor), ("pipeline_parallel_size", spec.pipeline)):
            mine = getattr(config, field)
            if mine not in (1, value):
                raise ValueError(f"--{field.replace('_', '-')} {mine} disagrees with the pod group's {value} (SHOAL_* environment)")
            setattr(config, field, value)  # the group's shape wins over the default of 1
    return spec


def local_spec(config) -> GroupSpec:
    return group_from_env(config) or GroupSpec(config.tensor_parallel_size, config.pipeline_parallel_size)


def check_parallel_shape(hf_config, tensor: int, pipeline: int, layer_split=None) -> None:
    """Refuse, before any process starts, a model that cannot be split this way."""
    from shoal.runtime.models.decoder import stage_layers

    heads, kv = hf_config.num_attention_heads, hf_config.num_key_value_heads
    problems = []
    if heads % tensor:
        problems.append(f"its {heads} attention heads are not divisible by tensor_parallel_size {tensor}")
    elif kv % tensor and tensor % kv:
        problems.append(f"its {kv} KV heads can neither be split across nor replicated over {tensor} ranks")
    if hf_config.intermediate_size % tensor:
        problems.append(f"its MLP width {hf_config.intermediate_size} is not divisible by {tensor}")
    if hf_config.num_hidden_layers < pipeline:
        problems.append(f"its {hf_config.num_hidden_layers} layers cannot fill {pipeline} pipeline stages")
    else:
        try:
            for p in range(pipeline):
                stage_layers(hf_config, ParallelState(pp_rank=p, pp_size=pipeline), layer_split)
        except ValueError as e:
            problems.append(str(e))
    if problems:
        valid = [t for t in range(1, heads + 1) if heads % t == 0 and (kv % t == 0 or t % kv == 0)
                 and hf_config.intermediate_size % t == 0]
        raise ValueError(
            f"cannot run this model with tensor_parallel_size={tensor}, pipeline_parallel_size={pipeline}: "
            + "; ".join(problems) + f" (tensor sizes that fit: {valid})"
        )


def backend_for(config) -> str:
    return "nccl" if str(config.device).startswith("cuda") else "gloo"


def threads_per_rank(local_ranks: int) -> int:
    if os.environ.get("SHOAL_NUM_THREADS"):
        return max(1, int(os.environ["SHOAL_NUM_THREADS"]))
    return max(1, (os.cpu_count() or 1) // max(1, local_ranks))


# ------------------------------------------------------------------ joining the world


@dataclass
class Membership:
    """One rank's view of the joined group."""

    state: ParallelState
    control: object  # gloo ProcessGroup over every rank: the leader's messages
    store: object  # the (prefixed) rendezvous store
    spec: GroupSpec
    rank: int
    sends: list = field(default_factory=list)  # the leader's messages not yet taken: (work, buffer)


def join_group(spec: GroupSpec, rank: int, backend: str, store=None, join_timeout: float = 600.0) -> Membership:
    """Join the world (blocks until every rank has joined) and build the tensor groups."""
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group (one parallel engine per process)")
    if store is None:
        store = dist.TCPStore(spec.leader_addr, spec.port, spec.world_size, is_master=False,
                              timeout=timedelta(seconds=join_timeout), wait_for_workers=False)
    tp = spec.tensor
    # Generous collective timeouts: a worker idles in the control broadcast as long as the
    # server has no work. Liveness is the watchdog's job, not the collectives'.
    long = timedelta(days=1)
    if rank:  # the leader waits for every rank's arrival first, watching for ranks that die
        store.set(f"arrived/{rank}", "1")
    dist.init_process_group(backend, store=dist.PrefixStore("pg/", store), rank=rank, world_size=spec.world_size, timeout=long)
    tp_group = None
    for stage in range(spec.pipeline):  # every rank creates every group, in the same order
        ranks = list(range(stage * tp, (stage + 1) * tp))
        group = dist.new_group(ranks, timeout=long, backend=backend) if tp > 1 else None
        if rank in ranks:
            tp_group = group
    control = dist.new_group(list(range(spec.world_size)), timeout=long, backend="gloo")
    state = ParallelState(tp_rank=rank % tp, tp_size=tp, pp_rank=rank // tp, pp_size=spec.pipeline, tp_group=tp_group)
    return Membership(state, control, dist.PrefixStore(STORE_PREFIX, store), spec, rank)


def open_leader_store(spec: GroupSpec, join_timeout: float):
    """The rendezvous store, hosted by the leader (local: 127.0.0.1 and a free port)."""
    host = "127.0.0.1" if not spec.pod_group else "0.0.0.0"
    store = dist.TCPStore(host, spec.port, spec.world_size, is_master=True,
                          timeout=timedelta(seconds=join_timeout), wait_for_workers=False)
    spec.port = store.port
    return store


def client_store(spec: GroupSpec, timeout: float = 10.0):
    """A separate connection to the store (for the watchdog thread)."""
    addr = "127.0.0.1" if not spec.pod_group and spec.pipeline_rank == 0 else spec.leader_addr
    raw = dist.TCPStore(addr, spec.port, is_master=False, timeout=timedelta(seconds=timeout), wait_for_workers=False)
    return dist.PrefixStore(STORE_PREFIX, raw)


def spawn_rank(config, spec: GroupSpec, rank: int, max_model_len: int, local_rank: int) -> subprocess.Popen:
    """Start one worker rank as a child process of this one."""
    env = dict(os.environ)
    env[ENV_CONFIG] = json.dumps(dataclasses.asdict(config))
    env.setdefault("SHOAL_NUM_THREADS", str(threads_per_rank(len(spec.local_ranks()))))
    cmd = [sys.executable, "-m", "shoal.runtime.executor.worker", "--rank", str(rank), "--local-rank", str(local_rank),
           "--tensor", str(spec.tensor), "--pipeline", str(spec.pipeline), "--pipeline-rank", str(rank // spec.tensor),
           "--leader-addr", spec.leader_addr if spec.pod_group else "127.0.0.1", "--port", str(spec.port),
           "--group", spec.name, "--max-model-len", str(max_model_len), "--parent-pid", str(os.getpid())]
    if spec.pod_group:
        cmd.append("--pod-group")
    return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)


def stop_children(children: list[subprocess.Popen], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    for child in children:
        try:
            child.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.terminate()
    for child in children:
        try:
            child.wait(3)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


# ------------------------------------------------------------------ liveness


class Watchdog(threading.Thread):
    """Heartbeats and failure detection for one rank, on its own store connection.

    leader=True: watch every rank's heartbeat, this process's children and the running
    step; on failure set `failed` in the store (so every rank exits) and call on_failure.
    leader=False: watch the leader's heartbeat, the store, the `failed`/`stop` flags, the
    parent process and this process's children; exit the process non-zero on failure.
    """

    def __init__(self, spec: GroupSpec, rank: int, *, leader: bool, timeout: float, children=(),
                 on_failure=None, parent_pid: int | None = None, step_timeout: float | None = None):
        super().__init__(name=f"shoal-watchdog-{rank}", daemon=True)
        self.spec, self.rank, self.leader, self.timeout = spec, rank, leader, timeout
        self.children = children if isinstance(children, list) else list(children)  # may grow later
        self.on_failure = on_failure or (lambda reason: die(reason))
        self.parent_pid, self.step_timeout = parent_pid, step_timeout
        self.store = client_store(spec, timeout=max(5.0, timeout))
        self.stopping = threading.Event()
        self.step_started: float | None = None  # set by the leader's executor around a step
        self.joined = False
        self.failed: str | None = None
        self._beat = 0
        self._seen: dict[int, tuple[bytes, float]] = {}
        self.beat()

    def beat(self) -> None:
        self._beat += 1
        self.store.set(f"hb/{self.rank}", str(self._beat))

    def stop(self) -> None:
        self.stopping.set()

    def run(self) -> None:
        errors = 0
        while not self.stopping.wait(HEARTBEAT_PERIOD):
            try:
                self.beat()
                reason = self.check_leader() if self.leader else self.check_worker()
                errors = 0
            except Exception as e:  # the store went away: the leader is gone
                errors += 1
                reason = f"lost the group's store ({e})" if errors >= 3 else None
            if reason and not self.stopping.is_set():
                self.failed = reason
                if self.leader:
                    try:
                        self.store.set("failed", f"rank 0: {reason}")
                    except Exception:
                        pass
                self.on_failure(reason)
                return

    def _stale(self, rank: int, now: float) -> bool:
        value = self.store.get(f"hb/{rank}")
        last = self._seen.get(rank)
        if last is None or last[0] != value:
            self._seen[rank] = (value, now)
            return False
        return now - last[1] > self.timeout

    def dead_child(self) -> str | None:
        for child in self.children:
            code = child.poll()
            if code is not None and not (self.stopping.is_set() and code == 0):
                return f"local rank process {child.pid} exited with code {code}"
        return None

    def check_leader(self) -> str | None:
        if (dead := self.dead_child()):
            return dead
        now = time.monotonic()
        others = range(1, self.spec.world_size)
        if not self.joined:
            self.joined = self.store.check([f"ready/{r}" for r in others]) if self.spec.world_size > 1 else True
        for r in others:
            if self.store.check([f"hb/{r}"]) and self._stale(r, now):
                return f"rank {r} stopped answering (no heartbeat for {self.timeout:g}s)"
        if self.step_timeout and self.step_started is not None and now - self.step_started > self.step_timeout:
            return f"a step has not finished after {self.step_timeout:g}s"
        return None

    def check_worker(self) -> str | None:
        if (dead := self.dead_child()):
            return dead
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            return "the process that started this rank exited"
        if self.store.check(["failed"]):
            return f"the group failed: {self.store.get('failed').decode()}"
        if self.store.check(["stop"]):
            return None  # clean shutdown in progress: the worker loop exits 0 on its own
        if self._stale(0, time.monotonic()):
            return f"the leader stopped answering (no heartbeat for {self.timeout:g}s)"
        return None


def die(reason: str) -> None:
    log.error("shoal group failure, exiting: %s", reason)
    print(f"shoal: group failure, exiting: {reason}", file=sys.stderr, flush=True)
    os._exit(1)

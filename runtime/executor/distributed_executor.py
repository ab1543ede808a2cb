"""The leader's side of a tensor x pipeline group: the same methods as ModelRunner, with
every call broadcast to all ranks (see worker.py for the protocol, launch.py for how
the ranks start, join and watch each other).

Options (EngineConfig.extra):
  pipeline_layer_split   layers per stage, e.g. [20, 10] (default: models.decoder.balanced_split)
  heartbeat_timeout      seconds without a heartbeat before a rank counts as dead (10)
  step_timeout           seconds one step may take before the group counts as hung (300)
  group_join_timeout     seconds to wait for every rank to join (600)
  exit_on_group_failure  exit the process non-zero when the group fails (True), so that
                         Kubernetes restarts the whole group; False: raise GroupFailed
  failure_exit_grace     seconds between noticing a failure and exiting (1.0), so that
                         /ready can answer 503 in between
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import threading
import time

import torch
import torch.distributed as dist

from shoal.runtime import cpu_threads
from shoal.runtime.executor import launch, worker
from shoal.runtime.executor.base import Executor
from shoal.runtime.executor.launch import option

log = logging.getLogger(__name__)


class GroupFailed(RuntimeError):
    """A rank of the group died or stopped answering."""


class DistributedExecutor(Executor):
    pipelined = True

    def __init__(self, config, hf_config, model_dir, max_model_len: int):
        from shoal.runtime.executor.model_runner import ModelRunner

        self.config, self.hf_config = config, hf_config
        spec = self.spec = launch.local_spec(config)
        layer_split = option(config, "pipeline_layer_split", None)
        launch.check_parallel_shape(hf_config, spec.tensor, spec.pipeline, layer_split)  # before any process starts
        if spec.pod_group and spec.pipeline_rank != 0:
            raise RuntimeError("a worker pod (SHOAL_PIPELINE_RANK > 0) runs no engine: call run_worker_pod_if_needed first")
        self.exit_on_failure = bool(option(config, "exit_on_group_failure", True))
        self.grace = float(option(config, "failure_exit_grace", 1.0))
        join_timeout = float(option(config, "group_join_timeout", 600.0))
        self.failed: str | None = None
        self.closed = False
        self._lock = threading.Lock()
        self.children = []
        self._in_flight: list[PendingStep] = []
        if str(config.device) == "cpu":
            cpu_threads.set_threads(launch.threads_per_rank(len(spec.local_ranks()), config.num_threads))
        elif str(config.device).startswith("cuda"):
            torch.cuda.set_device(0)
            config = self.config = _with_device(config, "cuda:0")

        self._store = launch.open_leader_store(spec, join_timeout)
        self.watchdog = launch.Watchdog(spec, 0, leader=True, timeout=float(option(config, "heartbeat_timeout", 10.0)),
                                        children=self.children, on_failure=self._on_failure,
                                        step_timeout=float(option(config, "step_timeout", 300.0)))
        self.watchdog.start()
        try:
            first = spec.local_ranks()[0]
            for rank in spec.local_ranks()[1:]:
                self.children.append(launch.spawn_rank(config, spec, rank, max_model_len, local_rank=rank - first))
            log.info("group %s: waiting for %d ranks to join on port %d", spec.name, spec.world_size, spec.port)
            others = range(1, spec.world_size)
            self._wait_for(self._store, [f"arrived/{r}" for r in others], join_timeout, "joining")
            self.m = launch.join_group(spec, 0, launch.backend_for(config), store=self._store, join_timeout=join_timeout)
            self.runner = ModelRunner(config, hf_config, model_dir, max_model_len, self.m.state, layer_split)
            self.m.store.set("ready/0", "1")
            self._wait_for(self.m.store, [f"ready/{r}" for r in others], join_timeout, "loading their shards")
            self.watchdog.joined = True
        except BaseException:
            self._teardown(clean=False)
            raise
        atexit.register(self.shutdown)
        log.info("group %s: %d x %d ranks joined (%s)", spec.name, spec.tensor, spec.pipeline, launch.backend_for(config))

    # -- the engine's interface ----------------------------------------------------------

    def kv_bytes_per_block(self) -> int:
        return self._kv_bytes

    def num_blocks_for(self, kv_cache_memory) -> int:
        """Blocks that fit on every rank: each rank applies kv_cache_memory to its own device."""
        replies = self._call(("num_blocks", kv_cache_memory), reply=True)
        errors = [r[1] for r in replies if r[0] == "error"]
        if errors:
            raise ValueError("; ".join(errors))
        self._kv_bytes = max(r[2] for r in replies)
        return min(r[1] for r in replies)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self._call(("alloc", num_blocks))

    def copy_block(self, src: int, dst: int) -> None:
        self._call(("copy", src, dst))

    def set_lora(self, slot: int, weights) -> None:
        """Every rank keeps its shard of the adapter (the full tensors travel once)."""
        self._call(("lora", slot, weights))

    def execute(self, step):
        """Every rank runs the step; the leader samples the logits it gets back (the sampling
        parameters never travel to the other ranks)."""
        logits = self._call(("step", dataclasses.replace(step, sampling=None)), timed=True)
        return logits if step.sampling is None else self.runner.sample(logits, step.sampling)

    def execute_async(self, step) -> "PendingStep":
        """Start a step and return once stage 0 has handed it on: the caller may start the
        next (independent) step while later stages still work on this one. Collect results
        in order with .result(). At most `pipeline_parallel_size` steps are worth keeping in
        flight; a step must not depend on the tokens of a step still in flight."""
        if self.failed:
            raise GroupFailed(f"the parallel group failed: {self.failed}")
        if self.closed:
            raise RuntimeError("the executor is shut down")
        sampling, step = step.sampling, dataclasses.replace(step, sampling=None)
        worker.broadcast(("step", step), self.m)
        logits, works = worker.start_step(self.runner, self.m, step)
        pending = PendingStep(self, logits, works, sampling)
        self._in_flight.append(pending)
        if self.watchdog.step_started is None:
            self.watchdog.step_started = time.monotonic()
        return pending

    def group_ready(self) -> bool:
        """Every rank joined and loaded, none dead or silent (the server's /ready)."""
        return not self.closed and self.failed is None and self.watchdog.joined

    def shutdown(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
        try:
            if self.failed is None:
                for pending in list(self._in_flight):  # let the pipe drain first
                    pending.result()
                self.m.store.set("stop", "1")
                worker.broadcast(("stop",), self.m)
        except Exception as e:
            log.warning("group %s: stop message failed: %s", self.spec.name, e)
        self._teardown(clean=True)
        atexit.unregister(self.shutdown)

    # -- inside --------------------------------------------------------------------------

    def _call(self, message, reply: bool = False, timed: bool = False):
        if self.failed:
            raise GroupFailed(f"the parallel group failed: {self.failed}")
        if self.closed:
            raise RuntimeError("the executor is shut down")
        try:
            if timed:
                self.watchdog.step_started = time.monotonic()
            worker.broadcast(message, self.m)
            if message[0] == "step":
                return worker.run_step(self.runner, self.m, message[1])
            if reply:
                return worker.gather(self._local_reply(message), self.m)
            worker.handle(message, self.runner, self.m)
        except Exception as e:
            if (why := self.group_gone()):
                raise GroupFailed(f"the parallel group failed: {why}") from e
            raise
        finally:
            if timed:
                self.watchdog.step_started = None

    def group_gone(self) -> str | None:
        """Why the group cannot go on: the watchdog's finding, or a local rank seen dead now
        (a collective can fail on a dead peer before the next heartbeat check)."""
        if self.failed is None and (dead := self.watchdog.dead_child()):
            self.failed = dead
        return self.failed

    def _wait_for(self, store, keys: list[str], timeout: float, what: str) -> None:
        """Wait until every rank has set its key, failing at once when a rank dies meanwhile
        (a store wait, or torch.distributed's own rendezvous, would sit out the timeout)."""
        deadline = time.monotonic() + timeout
        while not store.check(keys):
            if (why := self.group_gone()):
                raise GroupFailed(f"the parallel group failed while {what}: {why}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"group {self.spec.name}: the ranks were not done {what} after {timeout:g}s")
            time.sleep(0.05)

    def _local_reply(self, message):
        try:
            return ("ok", self.runner.num_blocks_for(message[1]), self.runner.kv_bytes_per_block())
        except Exception as e:
            return ("error", f"rank 0: {e}", 0)

    def _on_failure(self, reason: str) -> None:  # the watchdog thread
        self.failed = reason
        log.error("group %s failed: %s", self.spec.name, reason)
        if self.exit_on_failure:
            time.sleep(self.grace)  # /ready reports 503 meanwhile
            for child in self.children:
                if child.poll() is None:
                    child.kill()
            launch.die(f"group {self.spec.name}: {reason}")
        for child in self.children:  # unblock collectives waiting on them
            if child.poll() is None:
                child.kill()

    def _teardown(self, clean: bool) -> None:
        self.watchdog.stop()
        if not clean:
            for child in self.children:
                if child.poll() is None:
                    child.kill()
        launch.stop_children(self.children, timeout=10.0 if clean else 1.0)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as e:
                log.warning("destroy_process_group: %s", e)
        self._store = None


class PendingStep:
    """A step in the pipe (execute_async); .result() waits for its logits [S, V] and
    samples them when the step carried sampling metadata."""

    def __init__(self, executor: DistributedExecutor, logits, works, sampling=None):
        self.executor, self.logits, self.works, self.sampling = executor, logits, works, sampling
        self.done = not works

    def result(self):
        ex = self.executor
        if not self.done:
            try:
                for w in self.works:
                    if isinstance(w, dist.Work):
                        w.wait()
            except Exception as e:
                if (why := ex.group_gone()):
                    raise GroupFailed(f"the parallel group failed: {why}") from e
                raise
            self.done, self.works = True, []
        if self in ex._in_flight:
            ex._in_flight.remove(self)
            ex.watchdog.step_started = time.monotonic() if ex._in_flight else None
        if self.sampling is not None:
            self.logits, self.sampling = ex.runner.sample(self.logits, self.sampling), None
        return self.logits


def _with_device(config, device: str):
    return dataclasses.replace(config, device=device)

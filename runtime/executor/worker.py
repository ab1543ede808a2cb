"""A worker rank: join the group, load this rank's shard, then run the leader's messages
until told to stop.

The leader (global rank 0) sends every message to every rank on the gloo control group;
every rank, the leader included, then does the same work (`handle`). A step flows stage
to stage: stage s > 0 receives (hidden, residual) from the rank of stage s - 1 with its
own tensor rank, runs its layers and sends them on; the last stage's tensor rank 0 sends
the sample rows' logits to the leader.

Run as `python -m shoal.runtime.executor.worker ...` by launch.spawn_rank (local ranks), or
in-process by worker_pod.run_worker_pod_if_needed (the first rank of a worker pod).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pickle
import signal
import sys

import torch
import torch.distributed as dist

from shoal.runtime import cpu_threads
from shoal.runtime.executor import launch
from shoal.runtime.executor.launch import GroupSpec, Membership, option

log = logging.getLogger(__name__)


# ------------------------------------------------------------------ messages


def broadcast(message, m: Membership):
    """The leader sends `message`; every other rank receives and returns it.

    Point-to-point sends that the leader does not wait for, not a gloo broadcast: that one
    returns only once every rank has taken the message, so the leader could not hand out
    the next step while a later stage is still busy with the last one."""
    if m.rank != 0:
        size = torch.empty(1, dtype=torch.long)
        dist.recv(size, 0, group=m.control)
        data = torch.empty(int(size), dtype=torch.uint8)
        dist.recv(data, 0, group=m.control)
        return pickle.loads(data.numpy().tobytes())
    data = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)
    size = torch.tensor([data.numel()])
    m.sends = [(w, buf) for w, buf in m.sends if not w.is_completed()]  # keep buffers alive until sent
    for rank in range(1, m.spec.world_size):
        m.sends += [(dist.isend(size, rank, group=m.control), size), (dist.isend(data, rank, group=m.control), data)]
    return message


def gather(value, m: Membership) -> list:
    out = [None] * m.spec.world_size
    dist.all_gather_object(out, value, group=m.control)
    return out


@torch.inference_mode()
def run_step(runner, m: Membership, step):
    """This rank's share of one step. The leader gets logits [S, V]; other ranks None."""
    st, tp = m.state, m.state.tp_size
    hidden = residual = None
    if not st.is_first_stage:
        buf = torch.empty(2, step.input_ids.shape[0], runner.hf_config.hidden_size, dtype=runner.dtype, device=runner.device)
        dist.recv(buf, src=m.rank - tp)
        hidden, residual = buf[0], buf[1]
    out = runner.execute(step, hidden, residual)
    num_rows = step.sample_rows.shape[0]
    if not st.is_last_stage:
        dist.send(torch.stack(out).contiguous(), dst=m.rank + tp)
        if m.rank != 0:
            return None
        logits = torch.empty(num_rows, runner.hf_config.vocab_size, dtype=torch.float32, device=runner.device)
        if num_rows:
            dist.recv(logits, src=(st.pp_size - 1) * tp)
        return logits
    if st.pp_size > 1:
        if st.tp_rank == 0 and num_rows:
            dist.send(out.contiguous(), dst=0)
        return None
    return out if m.rank == 0 else None


@torch.inference_mode()
def start_step(runner, m: Membership, step):
    """The leader's side of a step, without waiting for the pipeline: run stage 0, hand the
    hidden states on, and post the receive of the logits. Returns (logits buffer, pending
    works); the logits are there once every work has been waited on."""
    st, tp = m.state, m.state.tp_size
    out = runner.execute(step)
    if st.is_last_stage:  # one stage: nothing in flight
        return out, []
    sent = torch.stack(out).contiguous()
    works = [dist.isend(sent, dst=m.rank + tp)]
    num_rows = step.sample_rows.shape[0]
    logits = torch.empty(num_rows, runner.hf_config.vocab_size, dtype=torch.float32, device=runner.device)
    if num_rows:
        works.append(dist.irecv(logits, src=(st.pp_size - 1) * tp))
    return logits, works + [sent]  # keep the sent tensor alive until its send completes


def handle(message, runner, m: Membership):
    """Do one message's work on this rank. Returns False on "stop"."""
    kind = message[0]
    if kind == "step":
        run_step(runner, m, message[1])
    elif kind == "copy":
        runner.copy_block(message[1], message[2])
    elif kind == "num_blocks":
        try:
            reply = ("ok", runner.num_blocks_for(message[1]), runner.kv_bytes_per_block())
        except Exception as e:  # a bad option: let the leader raise it, not hang
            reply = ("error", f"rank {m.rank}: {e}", 0)
        gather(reply, m)
    elif kind == "lora":
        runner.set_lora(message[1], message[2])
    elif kind == "alloc":
        runner.allocate_kv_cache(message[1])
    elif kind == "stop":
        return False
    else:
        raise RuntimeError(f"unknown message {kind!r} from the leader")
    return True


# ------------------------------------------------------------------ one worker rank


def run_rank(config, spec: GroupSpec, rank: int, local_rank: int, max_model_len: int | None,
             parent_pid: int | None, on_ready=None) -> int:
    """Join the group as `rank`, serve the leader until it says stop; the exit code.

    The first rank of a worker pod also starts (and watches) the pod's other tensor ranks.
    A failure anywhere in the group ends this process non-zero (launch.Watchdog)."""
    from shoal.runtime.executor.model_runner import ModelRunner
    from shoal.runtime.models.loader import load_config, resolve_model

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    model_dir = resolve_model(config.model)
    hf_config = load_config(model_dir)
    layer_split = option(config, "pipeline_layer_split", None)
    launch.check_parallel_shape(hf_config, spec.tensor, spec.pipeline, layer_split)
    if max_model_len is None:
        max_model_len = config.max_model_len or hf_config.max_position_embeddings
    cpu_threads.set_threads(launch.threads_per_rank(len(spec.local_ranks()), config.num_threads))
    if str(config.device).startswith("cuda"):
        torch.cuda.set_device(local_rank)
        config.device = f"cuda:{local_rank}"

    children = []
    if spec.pod_group and local_rank == 0:
        first = spec.pipeline_rank * spec.tensor
        children = [launch.spawn_rank(config, spec, r, max_model_len, local_rank=r - first) for r in range(first + 1, first + spec.tensor)]
    join_timeout = float(option(config, "group_join_timeout", 600.0))
    try:
        m = launch.join_group(spec, rank, launch.backend_for(config), join_timeout=join_timeout)
        watchdog = launch.Watchdog(spec, rank, leader=False, timeout=float(option(config, "heartbeat_timeout", 10.0)),
                                   children=children, parent_pid=parent_pid)
        watchdog.start()
        runner = ModelRunner(config, hf_config, model_dir, max_model_len, m.state, layer_split)
        m.store.set(f"ready/{rank}", "1")
        log.info("rank %d ready (tensor rank %d, stage %d, layers %s)", rank, m.state.tp_rank, m.state.pp_rank, runner.model.layer_range)
        if on_ready:
            on_ready()
        while handle(broadcast(None, m), runner, m):
            pass
    except BaseException as e:
        for child in children:
            child.kill()
        log.error("rank %d failed: %s", rank, e)
        print(f"shoal rank {rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        os._exit(1)
    watchdog.stop()
    launch.stop_children(children)
    bad = [c.returncode for c in children if c.returncode]
    return 1 if bad else 0


def main(argv=None) -> int:
    from shoal.runtime.config import EngineConfig

    p = argparse.ArgumentParser(description="one worker rank of a shoal group (started by the leader or a worker pod)")
    for name in ("rank", "local-rank", "tensor", "pipeline", "pipeline-rank", "port", "max-model-len", "parent-pid"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--leader-addr", required=True)
    p.add_argument("--group", default="local")
    p.add_argument("--pod-group", action="store_true")
    a = p.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the leader's to handle; it stops us
    config = EngineConfig(**json.loads(os.environ[launch.ENV_CONFIG]))
    spec = GroupSpec(a.tensor, a.pipeline, a.pipeline_rank, a.leader_addr, a.port, a.group, a.pod_group)
    return run_rank(config, spec, a.rank, a.local_rank, a.max_model_len, a.parent_pid)


if __name__ == "__main__":
    sys.exit(main())

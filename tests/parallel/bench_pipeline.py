"""Measure what keeping two batches in the pipe gains (not a test; run by hand):

    python tests/parallel/bench_pipeline.py [MODEL] [--pp 2] [--batch 8] [--context 64] [--steps 30]

Drives the DistributedExecutor directly with two independent decode batches A and B
(disjoint KV blocks, garbage context: timing only). "serial": execute(A), execute(B), ...
as the engine does today; "pipelined": execute_async(B) is issued before A's logits are
collected, so stage 0 works on B while stage 1 finishes A.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("SHOAL_NUM_THREADS", "1")

import torch  # noqa: E402

from shoal.runtime.config import EngineConfig  # noqa: E402
from shoal.runtime.executor.distributed_executor import DistributedExecutor  # noqa: E402
from shoal.runtime.executor.base import StepInput  # noqa: E402
from shoal.runtime.layers.attention import AttentionMetadata  # noqa: E402
from shoal.runtime.models.loader import load_config, resolve_model  # noqa: E402


def decode_step(first_seq: int, batch: int, context: int, block: int, vocab: int) -> StepInput:
    nb = -(-(context + 1) // block)
    tables = torch.tensor([[(first_seq + i) * nb + j for j in range(nb)] for i in range(batch)])
    slots = tables[:, context // block] * block + context % block
    meta = AttentionMetadata(slots, batch, tables, torch.full((batch,), context + 1), None, None, None)
    return StepInput(torch.randint(0, vocab, (batch,)), torch.full((batch,), context), meta, torch.arange(batch))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model", nargs="?", default="builtin://smollm2-135m-instruct")
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--steps", type=int, default=30)
    a = p.parse_args()
    torch.set_num_threads(1)
    model_dir = resolve_model(a.model)
    cfg = load_config(model_dir)
    config = EngineConfig(model=a.model, tensor_parallel_size=a.tp, pipeline_parallel_size=a.pp)
    ex = DistributedExecutor(config, cfg, model_dir, 1024)
    nb = -(-(a.context + 1) // config.block_size)
    ex.allocate_kv_cache(2 * a.batch * nb)
    A = decode_step(0, a.batch, a.context, config.block_size, cfg.vocab_size)
    B = decode_step(a.batch, a.batch, a.context, config.block_size, cfg.vocab_size)
    for _ in range(3):
        ex.execute(A), ex.execute(B)
    t = time.perf_counter()
    for _ in range(a.steps):
        la, lb = ex.execute(A), ex.execute(B)
    serial = time.perf_counter() - t
    t = time.perf_counter()
    fa = ex.execute_async(A)
    for _ in range(a.steps):
        fb = ex.execute_async(B)
        la2 = fa.result()
        fa = ex.execute_async(A)
        lb2 = fb.result()
    fa.result()
    piped = time.perf_counter() - t
    assert torch.equal(la.argmax(-1), la2.argmax(-1)) and torch.equal(lb.argmax(-1), lb2.argmax(-1))
    n = 2 * a.steps * a.batch
    print(f"tp{a.tp} x pp{a.pp}, 2 batches of {a.batch} decodes at context {a.context}, {a.steps} rounds:")
    print(f"  serial     {n / serial:8.1f} tok/s  ({1000 * serial / (2 * a.steps):.1f} ms/step)")
    print(f"  pipelined  {n / piped:8.1f} tok/s  ({1000 * piped / (2 * a.steps):.1f} ms/step)  x{serial / piped:.2f}")
    ex.shutdown()


if __name__ == "__main__":
    main()

"""Decode-only steps replayed from CUDA graphs (vLLM's default on GPUs).

A decode step of a 1B model launches ~250 small kernels; launched one by one from Python
they cost more host time than the device spends running them. At start-up the runner
captures the whole decode forward, LM head included, once for each size of a ladder
(1, 2, 4, 8, then every 8 up to max_num_seqs) over static input buffers; a step copies
its inputs into the buffers (padding rows write no cache slot and attend to one token)
and replays the graph of the next size up. Graphs share one memory pool, captured
largest first. Single process only: collectives of a parallel group stay eager.
"""

from __future__ import annotations

import logging

import torch

from shoal.runtime.layers.attention import AttentionMetadata

log = logging.getLogger(__name__)


def ladder(max_batch: int) -> list[int]:
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch + 8, 8))
    return sorted({min(s, max_batch) for s in sizes})


class DecodeGraphs:
    def __init__(self, runner, max_batch: int, max_blocks: int):
        self.runner = runner
        self.sizes = ladder(max_batch)
        dev = runner.device
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slots = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.long, device=dev)
        self.context_lens = torch.ones(n, dtype=torch.long, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _forward(self, size: int) -> torch.Tensor:
        r = self.runner
        meta = AttentionMetadata(slot_mapping=self.slots[:size], num_decode_tokens=size,
                                 decode_block_tables=self.block_tables[:size], decode_context_lens=self.context_lens[:size],
                                 prefill_block_tables=None, prefill_query_start_loc=None, prefill_context_lens=None)
        layer_caches = [(kv, None) for kv in r.kv_caches]
        hidden, _ = r.model(r.ops, self.input_ids[:size], self.positions[:size], layer_caches, meta)
        return r.model.compute_logits(hidden).float()

    @torch.inference_mode()
    def capture(self) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        pool = None
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                for _ in range(2):  # compile and tune the kernels outside the capture
                    self._forward(size)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    out = self._forward(size)
                pool = graph.pool()
                self.graphs[size] = (graph, out)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def fits(self, step) -> bool:
        m = step.meta
        return (m.num_decode_tokens == step.input_ids.shape[0] and 0 < m.num_decode_tokens <= self.sizes[-1]
                and m.decode_plan is None and m.decode_block_tables.shape[1] <= self.block_tables.shape[1]
                and m.group_slot_mapping is None)  # several KV-cache groups' tables: eager

    def run(self, step) -> torch.Tensor:
        """The sample rows' logits [S, V] of a decode-only step (its tensors on the device)."""
        m = step.meta
        b = m.num_decode_tokens
        size = next(s for s in self.sizes if s >= b)
        width = m.decode_block_tables.shape[1]
        self.input_ids[:b].copy_(step.input_ids)
        self.positions[:b].copy_(step.positions)
        self.slots[:b].copy_(m.slot_mapping)
        self.slots[b:size].fill_(-1)  # padding rows write nowhere
        self.context_lens[:b].copy_(m.decode_context_lens)
        self.context_lens[b:size].fill_(1)
        self.block_tables[:b, :width].copy_(m.decode_block_tables)
        self.block_tables[b:size].zero_()
        graph, out = self.graphs[size]
        graph.replay()
        return out[step.sample_rows]

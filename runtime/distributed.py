"""Who this process is in its group, and the collectives the model layers call.

World size = tensor x pipeline; global rank = pipeline_rank * tensor + tensor_rank
(docs/design.md, "Pod groups"). With one rank every collective is a no-op, so the model code
is the same on one process and across a group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tp_group: object = None  # torch.distributed ProcessGroup of this rank's tensor-parallel peers

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


SINGLE = ParallelState()


def tp_all_reduce(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    if state.tp_size > 1:
        dist.all_reduce(x, group=state.tp_group)
    return x


def tp_all_gather_last_dim(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    if state.tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(state.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=state.tp_group)
    return torch.cat(parts, dim=-1)


def shard_range(total: int, state: ParallelState) -> tuple[int, int]:
    """This rank's [start, end) of a dimension split evenly across the tensor-parallel ranks."""
    if total % state.tp_size:
        raise ValueError(f"cannot split {total} across {state.tp_size} tensor-parallel ranks")
    size = total // state.tp_size
    return state.tp_rank * size, (state.tp_rank + 1) * size

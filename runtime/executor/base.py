"""What the engine asks of whatever runs the model (one process or a group of ranks)."""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from shoal.runtime.executor.prompt_logprobs import PromptRows
from shoal.runtime.layers.attention import AttentionMetadata
from shoal.runtime.layers.sampler import Finished, SamplingMetadata


@dataclass
class StepInput:
    """Everything a rank needs to run one step: plain tensors, cheap to send to workers."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # rows of the flat batch whose logits are needed
    sampling: SamplingMetadata | None = None  # set: the step returns sampled tokens, not logits
    prompt_logprobs: PromptRows | None = None  # set: the runner also scores these prompt rows (into it)
    # [2, F] long (async scheduling): input_ids[fill_rows[0]] are the tokens the previous step
    # sampled in its rows fill_rows[1], still on the device when this step was prepared
    fill_rows: torch.Tensor | None = None
    # [T] long: each token's LoRA slot (-1: the base model); None: no token of the step uses one
    lora_slots: torch.Tensor | None = None


class Executor(abc.ABC):
    """The engine's contract with the device side. Subclasses implement the abstract
    methods; the rest have the single-process answer."""

    pipelined = False  # whether steps may be in flight at once (execute_async returns early)
    # whether it fills a step's input ids from the previous step's tokens on the device
    # (StepInput.fill_rows), so the engine may schedule a step before reading the last one
    overlaps_steps = False
    scores_prompts = False  # whether it fills a StepInput's prompt_logprobs rows (executor/prompt_logprobs.py)

    @abc.abstractmethod
    def kv_bytes_per_block(self) -> int: ...

    @abc.abstractmethod
    def num_blocks_for(self, kv_cache_memory: float | None) -> int:
        """KV blocks that fit: bytes, or on a GPU a fraction of free memory (None: the default)."""

    @abc.abstractmethod
    def allocate_kv_cache(self, num_blocks: int) -> None: ...

    @abc.abstractmethod
    def copy_block(self, src: int, dst: int) -> None: ...

    @abc.abstractmethod
    def execute(self, step):
        """Run one step (a StepInput); the sample rows' logits [S, V] float32."""

    def execute_async(self, step):
        """Start a step; .result() of the returned object waits for its logits."""
        return Finished(self.execute(step))

    def set_lora(self, slot: int, weights: dict | None) -> None:
        """Write a LoRA adapter's weights (engine/lora_manager.py) into a device slot."""
        raise NotImplementedError(f"{type(self).__name__} cannot serve LoRA adapters")

    def decode_planner(self, kv_cache_bytes: int):
        """The CPU decode workspace's planner (layers/decode_workspace.py), or None."""
        return None

    def group_ready(self) -> bool:
        """Every rank joined, loaded and alive (the server's /ready)."""
        return True

    def shutdown(self) -> None:
        pass

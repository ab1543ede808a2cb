"""Chooses how a step runs: in this process (one rank), or across tensor x pipeline ranks."""

from __future__ import annotations


def make_executor(config, hf_config, model_dir, max_model_len: int):
    """An object with num_blocks_for, allocate_kv_cache, copy_block, execute and shutdown."""
    if config.tensor_parallel_size * config.pipeline_parallel_size == 1:
        from shoal.runtime.executor.model_runner import ModelRunner

        return ModelRunner(config, hf_config, model_dir, max_model_len)
    from shoal.runtime.executor.distributed_executor import DistributedExecutor

    return DistributedExecutor(config, hf_config, model_dir, max_model_len)

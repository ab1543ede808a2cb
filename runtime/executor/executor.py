"""The choice of what runs the model: this process (ModelRunner) or a tensor x pipeline
group of ranks (DistributedExecutor). Both implement base.Executor."""

from __future__ import annotations

from shoal.runtime.executor.base import Executor


def make_executor(config, hf_config, model_dir, max_model_len: int) -> Executor:
    if config.tensor_parallel_size * config.pipeline_parallel_size == 1:
        from shoal.runtime.executor.model_runner import ModelRunner

        return ModelRunner(config, hf_config, model_dir, max_model_len)
    from shoal.runtime.executor.distributed_executor import DistributedExecutor

    return DistributedExecutor(config, hf_config, model_dir, max_model_len)

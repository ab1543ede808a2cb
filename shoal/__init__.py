"""Shoal: serve large language models on Kubernetes.

`from shoal import LLM, SamplingParams` is the offline API (like `vllm.LLM`).
Imports are lazy so that `shoal operator` never loads torch.
"""

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name):
    if name == "LLM":
        from shoal.runtime.entrypoints.llm import LLM

        return LLM
    if name == "SamplingParams":
        from shoal.runtime.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)

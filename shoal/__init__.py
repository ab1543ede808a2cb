"""Shoal: serve large language models on Kubernetes.

`from shoal import LLM, SamplingParams` is the offline API (like `vllm.LLM`).
Imports are lazy so that `shoal operator` never loads torch.
"""

import os as _os
import sys as _sys

__all__ = ["LLM", "SamplingParams"]


def _unshadow_checkout_root() -> None:
    """Drop the checkout root from sys.path (`python -m`/`-c` in the checkout put it there).

    Its top-level folder kernels/ would otherwise shadow Hugging Face's `kernels` package,
    which transformers imports when it is installed (docs/design.md, Layout); shoal itself is
    found through its install, never through the root.
    """
    root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    if not _os.path.isfile(_os.path.join(root, "setup.py")) or not _os.path.isfile(
            _os.path.join(root, "kernels", "__init__.py")):
        return  # an installed wheel: shoal/ sits in site-packages beside the real packages
    _sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != root]


_unshadow_checkout_root()


def __getattr__(name):
    if name == "LLM":
        from shoal.runtime.entrypoints.llm import LLM

        return LLM
    if name == "SamplingParams":
        from shoal.runtime.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)

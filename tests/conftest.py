"""Shared fixtures: the built-in model (converted once into the user cache), transformers
as the reference implementation, and tiny random-weight models for speed."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from shoal.runtime.cpu_threads import usable_cpus

torch.set_num_threads(2)

# Under pytest-xdist each worker takes its share of the CPUs: an engine (and a server a test
# starts, which inherits this environment) otherwise takes all of them, and the workers' OpenMP
# threads spin waiting on each other.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("SHOAL_NUM_THREADS", str(max(1, usable_cpus() // _WORKERS)))


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: the CPUs this process may use (affinity and cgroup quota, as the runtime counts
    them), where xdist would count the node's cores."""
    return usable_cpus()


@pytest.fixture(scope="session")
def builtin_dir():
    from shoal.runtime.models.loader import resolve_model

    return resolve_model("builtin://smollm2-135m-instruct")


@pytest.fixture(scope="session")
def hf_model(builtin_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(builtin_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer(builtin_dir):
    from shoal.runtime.models.loader import load_tokenizer

    return load_tokenizer(builtin_dir)


@pytest.fixture(scope="session")
def llm():
    """One engine on the built-in model for the whole session (loading takes seconds)."""
    from shoal import LLM

    engine = LLM(dtype="float32", kv_cache_memory=2**28, max_num_batched_tokens=512)  # float32: held to transformers
    yield engine
    engine.engine.shutdown()

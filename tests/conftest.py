"""Shared fixtures: the built-in model (converted once into the user cache), transformers
as the reference implementation, and tiny random-weight models for speed."""

from __future__ import annotations

import shutil

import pytest
import torch

torch.set_num_threads(2)


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

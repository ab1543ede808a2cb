"""Fixtures for the tensor/pipeline-parallel tests: tiny random models (helpers live in
parallel_helpers.py). Each rank gets one torch thread: the machine is small and shared."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # engine_helpers
os.environ["SHOAL_NUM_THREADS"] = "1"
torch.set_num_threads(1)

from engine_helpers import make_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, builtin_dir):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-tp"), builtin_dir, num_hidden_layers=4)


@pytest.fixture(scope="session")
def tiny_mqa_dir(tmp_path_factory, builtin_dir):
    """One KV head: tensor ranks replicate it."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-mqa"), builtin_dir, num_hidden_layers=3, num_key_value_heads=1)


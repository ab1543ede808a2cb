"""Kernel tests: Triton kernels run in Triton's interpreter on CPU tensors.

TRITON_INTERPRET is read when a kernel is decorated, i.e. when its module is imported, so it is
set here, at import time, before anything below imports triton or a kernel module.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import zlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# Tiny tensors: one intra-op thread is faster than two fighting for a shared machine.
torch.set_num_threads(1)


def pytest_report_header(config):
    return "kernels: Triton interpreter (TRITON_INTERPRET=1) on CPU tensors"


@pytest.fixture(autouse=True)
def _seed(request):
    """Fresh random inputs for each test case, reproducible from its id (SHOAL_TEST_SEED varies them)."""
    base = int(os.environ.get("SHOAL_TEST_SEED", "0"))
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()) + base)


@pytest.fixture(autouse=True)
def _poisoned_outputs(monkeypatch):
    """Every output a Triton wrapper allocates starts as NaN, so an element no kernel wrote fails."""
    from shoal.kernels import _common

    def nan_empty(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(_common, "empty", nan_empty)


@pytest.fixture(scope="session")
def triton_ops():
    pytest.importorskip("triton")
    from shoal.kernels import get_ops

    return get_ops("triton", "cpu")

"""Fixtures for the operator tests (no cluster, no torch)."""

from __future__ import annotations

import os

# kopf registers timer intervals when shoal.operator.main is imported: keep them short here.
os.environ.setdefault("SHOAL_OPERATOR_RESYNC_SECONDS", "0.5")

import pytest
import yaml

from shoal_op_helpers import ROOT, make_body

SAMPLES = sorted((ROOT / "manifests" / "samples").glob("*.yaml"))


@pytest.fixture
def body():
    return make_body()


@pytest.fixture(params=[p.name for p in SAMPLES])
def sample(request):
    return yaml.safe_load((ROOT / "manifests" / "samples" / request.param).read_text())


@pytest.fixture
def defaulted():
    from shoal.operator import defaults

    def _make(**spec):
        return defaults.apply_defaults(make_body(**spec))
    return _make


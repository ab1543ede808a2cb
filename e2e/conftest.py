"""e2e fixtures: a real cluster through KUBECONFIG, or a loud skip."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

BANNER = """
======================================================================
  SHOAL E2E SKIPPED: {why}
  These tests need a Kubernetes cluster reachable through KUBECONFIG
  (kind, k3d or a real one) and kubectl on PATH.
  See docs/operator.md, "Running the e2e tests on kind".
======================================================================
"""


def cluster_problem() -> str | None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return "kubectl is not on PATH"
    try:
        r = subprocess.run([kubectl, "version", "--request-timeout=5s", "-o", "json"],
                           capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"kubectl version failed: {e}"
    if r.returncode != 0 or '"serverVersion"' not in r.stdout:
        msg = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no server answered"]
        return f"no cluster reachable ({os.environ.get('KUBECONFIG', '~/.kube/config')}): {msg[0]}"
    return None


_problem: list[str | None] = []


def problem() -> str | None:
    if not _problem:
        _problem.append(cluster_problem())
    return _problem[0]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _problem and _problem[0]:
        terminalreporter.write(BANNER.format(why=_problem[0]), yellow=True, bold=True)


@pytest.fixture(scope="session")
def cluster():
    why = problem()
    if why:
        sys.stderr.write(BANNER.format(why=why))
        pytest.skip(f"SHOAL E2E SKIPPED: {why}")
    return shutil.which("kubectl")

"""The operator's own metrics: the exact names the alerts and dashboards use, served over HTTP."""

from __future__ import annotations

import socket
import urllib.request

import pytest

from shoal.operator import operator_metrics as metrics


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_names_and_http_endpoint():
    with metrics.reconciling():
        pass
    with pytest.raises(ValueError):
        with metrics.reconciling():
            raise ValueError("boom")
    metrics.set_groups("ns", "m", 3, 2)
    metrics.autoscaler_decision("ns", "m", "up")
    port = free_port()
    metrics.serve(port, addr="127.0.0.1")
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in ('shoal_operator_reconcile_total{result="success"}',
                 'shoal_operator_reconcile_total{result="error"}',
                 "shoal_operator_reconcile_errors_total ",
                 "shoal_operator_reconcile_duration_seconds_bucket",
                 'shoal_operator_desired_groups{name="m",namespace="ns"} 3.0',
                 'shoal_operator_ready_groups{name="m",namespace="ns"} 2.0',
                 'shoal_operator_autoscaler_decisions_total{direction="up",name="m",namespace="ns"}'):
        assert line in text, line
    metrics.forget("ns", "m")
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'shoal_operator_desired_groups{name="m"' not in text

"""Fixtures for tests/monitoring: the real tools (promtool, prometheus, lua5.4) and a
real Prometheus server on loopback.

The tools come from Debian packages (`make system-deps`):
    promtool, prometheus   <- apt package `prometheus`
    lua5.4                 <- apt package `lua5.4`
A missing tool skips the tests that need it, loudly, naming the package.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from monitoring_helpers import RULES, free_port

APT_PACKAGE = {"promtool": "prometheus", "prometheus": "prometheus", "lua5.4": "lua5.4"}


def require_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(
            f"SKIPPED LOUDLY: `{name}` is not installed; these monitoring tests need it. "
            f"Install it with `apt-get install -y {APT_PACKAGE.get(name, name)}` (or `make system-deps`)."
        )
    return path


@pytest.fixture(scope="session")
def promtool() -> str:
    return require_tool("promtool")


@pytest.fixture(scope="session")
def lua() -> str:
    return require_tool("lua5.4")


class QueryError(AssertionError):
    pass


class Prometheus:
    """A Prometheus server on 127.0.0.1:<free port>, data in a temporary directory."""

    def __init__(self, binary: str, workdir: Path, scrape_configs: list[dict[str, Any]] | None = None,
                 rule_files: list[Path] | None = None, interval: str = "1s"):
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
            "rule_files": [str(p) for p in rule_files or []],
            "scrape_configs": scrape_configs or [],
        }
        self.config_file = workdir / "prometheus.yml"
        self.config_file.write_text(yaml.safe_dump(config, sort_keys=False))
        self.log_file = workdir / "prometheus.log"
        self._log = open(self.log_file, "wb")
        self.proc = subprocess.Popen(
            [binary,
             f"--config.file={self.config_file}",
             f"--storage.tsdb.path={workdir / 'data'}",
             "--storage.tsdb.retention.time=1h",
             f"--web.listen-address=127.0.0.1:{self.port}",
             "--log.level=warn"],
            stdout=self._log, stderr=subprocess.STDOUT, cwd=workdir,
        )
        self.client = httpx.Client(base_url=self.url, timeout=10.0)
        self._wait_ready()

    def log_tail(self, n: int = 3000) -> str:
        self._log.flush()
        return self.log_file.read_text(errors="replace")[-n:]

    def _wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if self.client.get("/-/ready").status_code == 200:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"prometheus not ready after {timeout}s:\n{self.log_tail()}")

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query; raises QueryError with Prometheus' message when it does not parse or fails."""
        resp = self.client.get("/api/v1/query", params={"query": expr})
        try:
            body = resp.json()
        except ValueError as exc:
            raise QueryError(f"HTTP {resp.status_code} for {expr!r}: {resp.text[:500]}") from exc
        if resp.status_code != 200 or body.get("status") != "success":
            raise QueryError(f"{body.get('errorType')}: {body.get('error')}\n  in: {expr}")
        return body["data"]["result"]

    def wait_for(self, expr: str, predicate=lambda result: bool(result), timeout: float = 60.0,
                 what: str = "") -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        result: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            result = self.query(expr)
            if predicate(result):
                return result
            time.sleep(0.5)
        raise AssertionError(f"timed out after {timeout}s waiting for {what or expr!r}; last result {result}")

    def rules(self) -> list[dict[str, Any]]:
        return self.client.get("/api/v1/rules").json()["data"]["groups"]

    def stop(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self._log.close()


@pytest.fixture(scope="session")
def prometheus_binary() -> str:
    return require_tool("prometheus")


@pytest.fixture(scope="session")
def start_prometheus(prometheus_binary, tmp_path_factory):
    """Factory: start_prometheus(scrape_configs=[...], rule_files=[...]) -> Prometheus.
    Every server it starts is stopped at the end of the session."""
    servers: list[Prometheus] = []

    def start(scrape_configs=None, rule_files=None, interval: str = "1s") -> Prometheus:
        server = Prometheus(prometheus_binary, tmp_path_factory.mktemp("prometheus"), scrape_configs,
                            rule_files, interval)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def prometheus(start_prometheus) -> Prometheus:
    """One idle Prometheus (no targets) with manifests/monitoring/rules.yaml loaded: it
    parses dashboard queries and proves the rules load in a real server."""
    return start_prometheus(rule_files=[RULES])

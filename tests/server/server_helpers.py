"""Start and talk to real `shoal serve` subprocesses (imported by conftest.py and the tests)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

# Small enough to start fast and fit beside other work; large enough for 200 clients.
MAIN_ARGS = ["--max-num-seqs", "256", "--max-model-len", "1024", "--kv-cache-memory", "256MiB", "--max-waiting", "512"]
STARTUP_TIMEOUT = float(os.environ.get("SHOAL_TEST_STARTUP_TIMEOUT", "600"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(args: list[str]) -> list[str]:
    """`shoal serve ARGS` through the top-level CLI (what the console script runs)."""
    return [sys.executable, "-m", "shoal.runtime.cli", "serve", *args]


# Idle pooled connections are dropped before the server's 5 s keep-alive ends them: a request
# sent on one just as the server closes it fails with "Server disconnected" (HTTP/1.1's race),
# which a client with retries hides and these clients, without them, would show as a failure.
KEEP_ALIVE_LIMITS = httpx.Limits(max_connections=1000, max_keepalive_connections=100, keepalive_expiry=2.0)


@dataclass
class Server:
    proc: subprocess.Popen
    base_url: str
    log_path: Path
    saw_unready_while_alive: bool = False
    startup_s: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"

    def openai(self, timeout: float = 120, api_key: str = "unused"):
        """The official `openai` client on this server (no retries: a failure shows)."""
        import openai

        http = openai.DefaultHttpxClient(limits=KEEP_ALIVE_LIMITS)
        return openai.OpenAI(base_url=self.v1, api_key=api_key, max_retries=0, timeout=timeout, http_client=http)

    def http(self, timeout: float = 120) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=timeout, limits=KEEP_ALIVE_LIMITS)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout: float = 60) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def start_server(extra_args: list[str] = (), env: dict | None = None, wait_ready: bool = True) -> Server:
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="shoal-serve-", suffix=".log")[1])
    full_env = dict(os.environ, SHOAL_ACCESS_LOG="0", PYTHONUNBUFFERED="1")
    full_env.pop("SHOAL_API_KEY", None)
    full_env.update(env or {})
    args = ["--host", "127.0.0.1", "--port", str(port), *MAIN_ARGS, *extra_args]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(_command(args), stdout=fh, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
    server = Server(proc, f"http://127.0.0.1:{port}", log)
    if wait_ready:
        wait_until_ready(server)
    return server


@contextmanager
def served(args: list[str] = (), env: dict | None = None, clean_exit: bool = True):
    """A ready `shoal serve ARGS` for a fixture to yield: stopped afterwards, and with
    `clean_exit` its exit status asserted 0 (a server that crashed under the tests fails them)."""
    server = start_server(list(args), env=env)
    try:
        yield server
    finally:
        rc = server.stop()
    if clean_exit:
        assert rc == 0, f"server exited with {rc}:\n{server.log()[-3000:]}"


def wait_until_ready(server: Server, timeout: float = STARTUP_TIMEOUT) -> None:
    t0 = time.monotonic()
    deadline = t0 + timeout
    with httpx.Client(timeout=5) as c:
        while time.monotonic() < deadline:
            if server.proc.poll() is not None:
                raise RuntimeError(f"shoal serve exited with {server.proc.returncode}:\n{server.log()[-4000:]}")
            try:
                ready = c.get(server.base_url + "/ready")
                if ready.status_code == 200:
                    server.startup_s = time.monotonic() - t0
                    return
                if ready.status_code == 503 and c.get(server.base_url + "/health").status_code == 200:
                    server.saw_unready_while_alive = True
            except httpx.TransportError:
                pass
            time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"shoal serve not ready after {timeout:.0f}s:\n{server.log()[-4000:]}")


def metrics_text(base_url: str) -> str:
    return httpx.get(base_url + "/metrics", timeout=30).text


def metric(base_url: str, name: str, **labels) -> float | None:
    from shoal.runtime.metrics import metric_value

    return metric_value(metrics_text(base_url), name, **labels)

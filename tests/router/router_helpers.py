"""Start `shoal serve` groups (a tiny random-weight model) and `shoal router` subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from server_helpers import Server, free_port, wait_until_ready

# small and quick: a 2-layer model, 512 KV blocks of 16 tokens, room for 16 sequences
GROUP_ARGS = ["--max-num-seqs", "16", "--max-model-len", "512", "--kv-cache-memory", "4MiB", "--max-waiting", "64",
              "--max-num-batched-tokens", "512", "--disable-log-stats", "--served-model-name", "m"]


def start_group(model_dir: Path, port: int | None = None, wait: bool = True, extra: tuple[str, ...] = ()) -> Server:
    port = port or free_port()
    log = Path(tempfile.mkstemp(prefix="shoal-group-", suffix=".log")[1])
    env = dict(os.environ, SHOAL_ACCESS_LOG="0", PYTHONUNBUFFERED="1")
    env.pop("SHOAL_API_KEY", None)
    cmd = [sys.executable, "-m", "shoal.runtime.cli", "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port), *GROUP_ARGS, *extra]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    s = Server(proc, f"http://127.0.0.1:{port}", log)
    s.extra["port"] = port
    if wait:
        wait_until_ready(s)
    return s


def start_router(backends: list[str], *extra: str, wait: bool = True) -> Server:
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="shoal-router-", suffix=".log")[1])
    env = dict(os.environ, SHOAL_ACCESS_LOG="0", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "shoal.runtime.cli", "router", "--host", "127.0.0.1", "--port", str(port), "--poll-interval", "0.1", *extra]
    for b in backends:
        cmd += ["--backend", b]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    s = Server(proc, f"http://127.0.0.1:{port}", log)
    if wait:
        wait_router(s)
    return s


def wait_router(s: Server, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if s.proc.poll() is not None:
            raise RuntimeError(f"shoal router exited with {s.proc.returncode}:\n{s.log()[-3000:]}")
        try:
            if httpx.get(s.base_url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    s.stop()
    raise RuntimeError(f"shoal router did not start:\n{s.log()[-3000:]}")


def backends_state(router: Server) -> dict[str, dict]:
    return {b["url"]: b for b in httpx.get(router.base_url + "/router/backends", timeout=10).json()["backends"]}


def wait_for(predicate, timeout: float = 60, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")

"""A pod of a pod group whose SHOAL_PIPELINE_RANK > 0: it runs ranks, not an engine.

`shoal serve` calls run_worker_pod_if_needed first thing (launch.py explains the group)."""

from __future__ import annotations

import json
import sys
import threading

from shoal.runtime.executor.launch import group_from_env, option
from shoal.runtime.executor.worker import run_rank


def serve_probes(host: str, port: int, is_ready) -> object:
    """A minimal /health (alive) and /ready (joined, model loaded) for a worker pod."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Probe(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            path = self.path.split("?")[0]
            if path == "/health":
                code, body = 200, {"status": "ok", "role": "worker"}
            elif path == "/ready":
                ok = is_ready()
                code, body = (200 if ok else 503), {"status": "ready" if ok else "not ready", "role": "worker"}
            else:
                code, body = 404, {"error": {"message": "worker pod: only /health and /ready", "type": "not_found", "param": None, "code": 404}}
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer((host, port), Probe)
    threading.Thread(target=server.serve_forever, name="shoal-worker-probes", daemon=True).start()
    return server


def run_worker_pod_if_needed(config, host: str = "0.0.0.0", port: int | None = None) -> bool:
    """For `shoal serve`, first thing: in a pod group's pod with SHOAL_PIPELINE_RANK > 0, run
    this pod's ranks until the leader stops the group, and return True (the process is
    done: exit 0). Anywhere else return False (and, in a pod group's pod 0, take the
    group's shape from the environment into `config`). A failure exits the process non-zero.
    """
    spec = group_from_env(config)
    if spec is None or spec.pipeline_rank == 0:
        return False
    if port is None:
        port = int(option(config, "port", 8000))
    ready = threading.Event()
    probes = serve_probes(host, port, ready.is_set) if port else None
    try:
        code = run_rank(config, spec, spec.pipeline_rank * spec.tensor, local_rank=0, max_model_len=None,
                        parent_pid=None, on_ready=ready.set)
    finally:
        if probes is not None:
            probes.shutdown()
    if code:
        sys.exit(code)
    return True

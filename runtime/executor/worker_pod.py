"""A pod of a pod group whose SHOAL_PIPELINE_RANK > 0: it runs ranks, not an engine.

`shoal serve` calls run_worker_pod_if_needed first thing (launch.py explains the group)."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading

from shoal.runtime.executor.launch import group_from_env, option
from shoal.runtime.executor.worker import run_rank

log = logging.getLogger(__name__)


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


ENV_DRAIN_TIMEOUT = "SHOAL_DRAIN_TIMEOUT"  # the operator renders --drain-timeout here too
DEFAULT_DRAIN_TIMEOUT = 30.0                # `shoal serve --drain-timeout`'s default
WORKER_DRAIN_MARGIN = 10.0                  # the leader's shutdown after its drain (< the pod's grace margin)


def keep_serving_on_sigterm(timeout: float, exit_=os._exit) -> bool:
    """A worker pod's SIGTERM: keep serving, since the group's in-flight requests need every
    stage, until the leader (which drains on its own SIGTERM) stops the group; exit 0 after
    `timeout` + WORKER_DRAIN_MARGIN seconds if it never does.

    Kubernetes signals every pod of a group at once: a worker that died at once would fail
    the leader's drain. The main thread may sit in a blocking collective (where Python
    handlers do not run), so the signal reaches a thread through the wakeup fd.
    False (nothing installed) off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return False
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.signal(signal.SIGTERM, lambda *_: None)  # not the default (die); the thread below acts
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    bound = max(0.0, timeout) + WORKER_DRAIN_MARGIN

    def expire() -> None:
        log.warning("SIGTERM %.0f s ago and the leader has not stopped the group: exiting", bound)
        print(f"shoal: worker pod: the leader did not stop the group within {bound:g}s of SIGTERM, exiting",
              file=sys.stderr, flush=True)
        exit_(0)

    def watch() -> None:
        while True:
            try:
                data = os.read(r, 64)
            except OSError:
                return
            if int(signal.SIGTERM) in data:
                log.warning("SIGTERM: serving the group's in-flight requests until the leader stops it "
                            "(at most %.0f s)", bound)
                timer = threading.Timer(bound, expire)
                timer.daemon = True  # a group stopped in time exits without waiting for it
                timer.start()
                return

    threading.Thread(target=watch, name="shoal-worker-sigterm", daemon=True).start()
    return True


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
    keep_serving_on_sigterm(float(os.environ.get(ENV_DRAIN_TIMEOUT) or DEFAULT_DRAIN_TIMEOUT))
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

"""`shoal serve` flags. Cheap to import: the server (and torch) load only in `run`."""

from __future__ import annotations

import argparse
import os


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from shoal.runtime.config import add_engine_args

    add_engine_args(parser)
    g = parser.add_argument_group("server")
    # 0.0.0.0 by default: in a pod the kubelet probes the pod IP, so loopback would fail
    # every probe. Pass --host 127.0.0.1 to keep a workstation server private.
    g.add_argument("--host", default=os.environ.get("SHOAL_HOST", "0.0.0.0"), help="address to bind (default 0.0.0.0)")
    g.add_argument("--port", type=int, default=int(os.environ.get("SHOAL_PORT", "8000")))
    g.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/*; default: $SHOAL_API_KEY (probes and /metrics stay open)",
    )
    g.add_argument("--max-waiting", type=int, default=512, help="requests allowed to wait for a batch slot; beyond it 503 + Retry-After")
    g.add_argument("--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get to finish after SIGTERM")
    g.add_argument("--stall-timeout", type=float, default=60.0, help="/health fails when work is pending and no step finished for this long")
    g.add_argument("--max-body-bytes", type=int, default=8 * 2**20, help="largest request body accepted (413 beyond)")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shoal.runtime.entrypoints.server import serve

    if args.api_key is None:
        args.api_key = os.environ.get("SHOAL_API_KEY") or None
    for name in ("max_waiting", "max_body_bytes"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("drain_timeout", "stall_timeout"):
        if getattr(args, name) <= 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be > 0")
    return serve(args)

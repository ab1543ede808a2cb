"""`shoal router` flags and the process entry (cheap to import: the router loads in `run`)."""

from __future__ import annotations

import argparse
import os


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", action="append", default=[], metavar="URL",
                   help="a `shoal serve` group's base URL, e.g. http://10.0.0.5:8000 (repeatable)")
    p.add_argument("--backends-from-dns", metavar="NAME:PORT",
                   help="the backends are every address of NAME (a headless Service), on PORT; re-resolved every second")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default=None,
                   help="the served model (builtin://NAME, a directory, a .gguf): its tokenizer hashes prompts (default: the built-in model)")
    p.add_argument("--tokenizer", default=None, help="a directory with the model's tokenizer.json (instead of --model's)")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file, if the servers were given one")
    p.add_argument("--policy", choices=["prefix", "round-robin"], default="prefix",
                   help="prefix: by prefix-cache match and load; round-robin: every ready backend in turn (a baseline)")
    p.add_argument("--prefix-weight", type=float, default=1.0, help="weight of the matched fraction of the prompt's blocks (default: 1)")
    p.add_argument("--load-weight", type=float, default=1.0, help="weight of the load, max(p/(p+8), kv usage) (default: 1)")
    p.add_argument("--session-header", default=None, metavar="NAME",
                   help="send requests with the same value of this header (e.g. x-session-id) to the same backend while it is ready")
    p.add_argument("--max-pending", type=int, default=1024, help="requests held while no backend is ready; more get 503 (default: 1024)")
    p.add_argument("--pending-timeout", type=float, default=60.0, help="seconds a held request waits for a ready backend before 503 (default: 60)")
    p.add_argument("--poll-interval", type=float, default=0.2, help="seconds between polls of each backend's /kv/blocks (default: 0.2)")
    p.add_argument("--max-body-bytes", type=int, default=8 * 2**20, help="largest request body accepted (default: 8 MiB)")
    p.add_argument("--log-level", default=os.environ.get("SHOAL_LOG_LEVEL", "info"), choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run)


def load_tokenizer(args):
    """The tokenizer that hashes prompts: --tokenizer's, else --model's (the built-in model by default)."""
    from shoal.runtime.models.loader import load_tokenizer as load, resolve_model

    if args.tokenizer:
        return load(args.tokenizer)
    return load(resolve_model(args.model or "builtin://smollm2-135m-instruct"))


def run(args) -> int:
    import uvicorn

    from shoal.runtime.entrypoints.logs import configure_logging
    from shoal.runtime.entrypoints.middleware import GuardMiddleware
    from shoal.runtime.router.app import HotPath, Router, build_app
    from shoal.runtime.router.backends import Backends
    from shoal.runtime.router.hashing import PromptHasher

    configure_logging(args.log_level)
    if not args.backend and not args.backends_from_dns:
        raise SystemExit("shoal router: give --backend URL (repeatable) or --backends-from-dns NAME:PORT")
    if args.backends_from_dns and not args.backends_from_dns.rpartition(":")[2].isdigit():
        raise SystemExit("shoal router: --backends-from-dns takes NAME:PORT")
    template = open(args.chat_template).read() if args.chat_template else None
    hasher = PromptHasher(load_tokenizer(args) if args.policy == "prefix" else None, chat_template=template)
    backends = Backends(args.backend, poll_interval=args.poll_interval, dns=args.backends_from_dns)
    router = Router(backends, hasher, prefix_weight=args.prefix_weight, load_weight=args.load_weight, policy=args.policy,
                    session_header=args.session_header, max_pending=args.max_pending, pending_timeout=args.pending_timeout,
                    max_body_bytes=args.max_body_bytes)
    app = GuardMiddleware(HotPath(build_app(router), router), None, args.max_body_bytes)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_config=None, log_level=args.log_level,
                            access_log=os.environ.get("SHOAL_ACCESS_LOG", "1") != "0", lifespan="on", ws="none",
                            timeout_graceful_shutdown=30, timeout_keep_alive=5, backlog=4096)

    class RouterServer(uvicorn.Server):
        """SIGTERM: stop accepting, let streams finish, exit 0 (uvicorn would re-raise the signal)."""

        def handle_exit(self, sig, frame):
            if self.should_exit:
                self.force_exit = True
            self.should_exit = True

    RouterServer(config).run()
    return 0

"""`shoal serve | router | bench | operator`: one entry point, each subcommand in its own module."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shoal", description="Serve LLMs on Kubernetes")
    sub = parser.add_subparsers(dest="command", required=True)

    from shoal.runtime.entrypoints import serve_args

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server", formatter_class=serve_args.HelpFormatter)

    serve_args.add_arguments(serve)

    router = sub.add_parser("router", help="prefix- and load-aware front for several `shoal serve` groups (docs/router.md)")
    from shoal.runtime.router import args as router_args

    router_args.add_arguments(router)

    bench = sub.add_parser("bench", help="throughput, latency and serving benchmarks")
    from shoal.runtime.bench import args as bench_args

    bench_args.add_arguments(bench)

    op = sub.add_parser("operator", help="the Kubernetes operator")
    from shoal.operator import operator_cli

    operator_cli.add_arguments(op)

    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

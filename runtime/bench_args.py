"""`shoal bench throughput | latency | serve | kernels`: flags only (cheap to import)."""

from __future__ import annotations

import argparse

from shoal.runtime.config import add_engine_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", required=True)

    tp = sub.add_parser("throughput", help="offline throughput on a named workload")
    add_engine_args(tp)
    tp.add_argument("--workload", default="public", choices=["public", "sharegpt", "shared-prefix"])
    tp.add_argument("--num-prompts", type=int)
    tp.add_argument("--workload-seed", type=int, default=0)
    tp.add_argument("--compare-hf", action="store_true", help="also run transformers' static batching in this run")
    tp.add_argument("--hf-batch-size", type=int, default=8)
    tp.add_argument("--json", help="write the results as JSON to this file")
    tp.set_defaults(func=_run("throughput"))

    lat = sub.add_parser("latency", help="batch-1 time to first token, decode and prefill speed")
    add_engine_args(lat)
    lat.add_argument("--input-len", type=int, default=128)
    lat.add_argument("--output-len", type=int, default=128)
    lat.add_argument("--prefill-len", type=int, default=512)
    lat.add_argument("--iters", type=int, default=3)
    lat.add_argument("--compare-hf", action="store_true")
    lat.add_argument("--json")
    lat.set_defaults(func=_run("latency"))

    serve = sub.add_parser("serve", help="load test a running server (Poisson arrivals)")
    from shoal.runtime import bench_serve

    bench_serve.add_arguments(serve)

    kern = sub.add_parser("kernels", help="check and time the Triton kernels on a GPU")
    kern.add_argument("rest", nargs=argparse.REMAINDER)
    kern.set_defaults(func=lambda args: __import__("shoal.kernels.bench", fromlist=["main"]).main(args.rest))


def _run(name):
    def run(args):
        from shoal.runtime import bench

        return getattr(bench, name)(args)

    return run

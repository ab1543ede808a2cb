"""Compile every Triton kernel for a real GPU target on a machine without one.

    python -m shoal.kernels.compile_check [--arch 90] [--dtypes bfloat16,float16,float32]

The interpreter (what the tests run) checks what the kernels compute, not that they compile:
a dot shape, a loop-carried type or a shared-memory budget only fails in the compiler. This
drives each wrapper in shoal.kernels with CPU tensors while every launch is turned into an
ahead-of-time compile for the target (Triton's bundled ptxas runs on the CPU), and prints
each variant's shared memory. Needs TRITON_INTERPRET unset. Exit status 1 on any failure.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import torch

_SIG = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int64: "i64", torch.int32: "i32"}


@contextlib.contextmanager
def compile_instead_of_launch(arch: int, results: list):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile
    from triton.runtime.jit import JITFunction

    seen = set()

    def run(self, *args, grid, warmup, **kwargs):
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
        bound = dict(zip(self.arg_names, args), **kwargs)
        signature, constexprs = {}, {}
        for p, name in zip(self.params, self.arg_names):
            v = bound[name]
            if p.is_constexpr:
                signature[name], constexprs[name] = "constexpr", v
            elif isinstance(v, torch.Tensor):
                signature[name] = "*" + _SIG[v.dtype]
            elif isinstance(v, bool):
                signature[name] = "i1"
            elif isinstance(v, int):
                signature[name] = "i32" if -(2**31) <= v < 2**31 else "i64"
            else:
                signature[name] = "fp32"
        key = (self.__name__, str(sorted(signature.items())), str(sorted(constexprs.items())), str(options))
        if key in seen:
            return
        seen.add(key)
        t = time.perf_counter()
        try:
            k = triton_compile(ASTSource(fn=self, signature=signature, constexprs=constexprs),
                               target=GPUTarget("cuda", arch, 32), options=options)
            results.append((self.__name__, constexprs, time.perf_counter() - t, k.metadata.shared, None))
        except Exception as exc:  # reported, and the run goes on to the next variant
            results.append((self.__name__, constexprs, time.perf_counter() - t, None, exc))

    saved = JITFunction.run
    JITFunction.run = run
    try:
        yield
    finally:
        JITFunction.run = saved


def drive(dtypes, shapes=((32, 8, 128, 16), (12, 4, 80, 32), (8, 8, 96, 16), (8, 1, 64, 32)), hidden=(576, 4096)):
    """Call every wrapper once per configuration, with CPU tensors (never launched)."""
    from shoal.kernels import activation, cache_write, fused_moe, norm, paged_attention, rotary

    for dt in dtypes:
        for h, kvh, d, bs in shapes:
            kc = torch.zeros(8, bs, kvh, d, dtype=dt)
            bt, ctx = torch.zeros(2, 40, dtype=torch.long), torch.tensor([5, 9])
            q, k = torch.zeros(2, h, d, dtype=dt), torch.zeros(2, kvh, d, dtype=dt)
            paged_attention.decode(q, kc, kc, bt[:, :4], ctx, 0.1)  # one split
            paged_attention.decode(q, kc, kc, bt, ctx, 0.1)  # split-K and the reduce pass
            paged_attention.prefill(torch.zeros(14, h, d, dtype=dt), kc, kc, bt, torch.tensor([0, 5, 14]), ctx, 0.1)
            cache_write.write_kv_cache(k, k, kc, kc, torch.tensor([0, 1]))
            for neox in (True, False):
                rotary.rotary_embedding(torch.tensor([0, 1]), q, k, torch.zeros(10, d, dtype=dt), neox)
        for H in hidden:
            x = torch.zeros(4, H, dtype=dt)
            norm.rms_norm(x, torch.zeros(H, dtype=dt), 1e-6)
            norm.rms_norm(x, torch.zeros(H, dtype=dt), 1e-6, x)
            activation.silu_and_mul(x)
            E, I = 4, 128  # both grouped GEMMs of the experts (routing is torch, run for real)
            w13, w2 = torch.zeros(E, 2 * I, H, dtype=dt), torch.zeros(E, H, I, dtype=dt)
            for T in (4, 128):  # decode-sized and prefill-sized tiles
                ids = torch.arange(2 * T).view(T, 2) % E
                fused_moe.fused_moe(torch.zeros(T, H, dtype=dt), w13, w2, torch.ones(T, 2), ids)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shoal.kernels.compile_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability as one number (80, 89, 90, ...)")
    parser.add_argument("--dtypes", default="bfloat16,float16,float32")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("compile_check: unset TRITON_INTERPRET (it replaces the compiler with the interpreter)", file=sys.stderr)
        return 2
    results: list = []
    with compile_instead_of_launch(args.arch, results):
        drive([getattr(torch, n) for n in args.dtypes.split(",")])
    failed = 0
    for name, constexprs, secs, shared, exc in results:
        brief = ", ".join(f"{k}={getattr(v, 'name', v)}" for k, v in constexprs.items())
        if exc is None:
            print(f"ok    sm_{args.arch} {name}({brief}) {secs:.1f}s shared={shared}B")
        else:
            failed += 1
            print(f"FAIL  sm_{args.arch} {name}({brief}): {type(exc).__name__}: {str(exc)[:500]}")
    print(f"{len(results) - failed} of {len(results)} kernel variants compiled for sm_{args.arch}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

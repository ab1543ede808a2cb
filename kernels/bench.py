"""Check and time every Triton kernel against its torch reference on a CUDA device.

    python -m shoal.kernels.bench            # on a CUDA machine: one table, well under 5 minutes
    python -m shoal.kernels.bench --cpu      # no GPU: time the torch references on CPU (small sizes)
    TRITON_INTERPRET=1 python -m shoal.kernels.bench --cpu --iters 1 --warmup 0   # smoke-test this script

For each kernel, on random data of realistic size: the largest difference from the torch
reference (and whether it is within tolerance), the median time over many runs (CUDA events,
after warm-up), and the bandwidth that time implies for the bytes the kernel must move at the
least (each input read once, each output written once) as a share of the device's peak. The
attention rows add TFLOP/s, since prefill is bound by compute rather than memory.

Exit status: 0 when every check passes (or there is nothing to run), 1 when any check fails.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

from shoal.kernels import reference as ref

BUDGET_S = 240.0  # stop starting new cases past this, so the whole run stays under 5 minutes

# Peak DRAM bandwidth, GB/s, from the vendors' spec sheets; matched on the device name, most specific first.
PEAK_GBPS = [
    ("GB200", 8000), ("B200", 8000), ("B100", 8000), ("GH200", 4000), ("H200", 4800),
    ("H100 NVL", 3900), ("H100 PCIe", 2000), ("H100", 3350), ("H800", 3350), ("H20", 4000),
    ("A100-SXM4-80GB", 2039), ("A100 80GB PCIe", 1935), ("A100-PCIE-40GB", 1555), ("A100", 1555),
    ("A800", 2039), ("A40", 696), ("A30", 933), ("A10G", 600), ("A10", 600), ("L40S", 864), ("L40", 864),
    ("L4", 300), ("T4", 320), ("V100", 900), ("RTX 6000 Ada", 960), ("RTX A6000", 768),
    ("RTX 5090", 1792), ("RTX 4090", 1008), ("RTX 4080", 717), ("RTX 3090", 936), ("RTX 3080", 760),
    ("MI300X", 5300), ("MI250", 3277),
]


def peak_bandwidth(device) -> tuple[float | None, str]:
    """(GB/s, where it came from) for a CUDA device: the spec-sheet table, else the driver's clocks."""
    name = torch.cuda.get_device_name(device)
    for key, gbps in PEAK_GBPS:
        if key.lower() in name.lower():
            return float(gbps), f"spec sheet for {key}"
    try:
        import triton

        props = triton.runtime.driver.active.utils.get_device_properties(torch.device(device).index or 0)
        gbps = 2 * props["mem_clock_rate"] * 1e3 * props["mem_bus_width"] / 8 / 1e9  # DDR: two transfers a clock
        return gbps, "driver: memory clock x bus width"
    except Exception:
        return None, "unknown"


@dataclass
class Case:
    kernel: str
    shape: str
    run_triton: Callable[[], object] | None
    run_ref: Callable[[], object]
    bytes: int  # the least the kernel must move
    flops: int = 0
    check: Callable[[], tuple[float, bool]] | None = None  # (max |triton - reference|, within tolerance)


def _blocked_cache(lens, bs, kvh, d, dtype, dev, gen):
    """A K/V cache holding `lens` tokens, blocks shuffled across sequences; its block table."""
    need = [math.ceil(n / bs) for n in lens]
    nb = sum(need)
    perm = torch.randperm(nb, device=dev, generator=gen)
    width = max(need)
    bt = torch.zeros(len(lens), width, dtype=torch.long, device=dev)
    used = 0
    for b, n in enumerate(need):
        bt[b, :n] = perm[used : used + n]
        used += n
    k = torch.randn(nb, bs, kvh, d, device=dev, generator=gen).to(dtype)
    v = torch.randn(nb, bs, kvh, d, device=dev, generator=gen).to(dtype)
    return k, v, bt, torch.tensor(lens, dtype=torch.long, device=dev)


def _maxdiff(a, b) -> float:
    if isinstance(a, tuple):
        return max(_maxdiff(x, y) for x, y in zip(a, b))
    return float((a.float() - b.float()).abs().max())


def _excess(a, b, tol) -> float:
    """How far past `tol` (as atol and rtol) the worst element of a is from b: <= 1 passes."""
    if isinstance(a, tuple):
        return max(_excess(x, y, tol) for x, y in zip(a, b))
    a, b = a.float(), b.float()
    if a.isnan().any():
        return math.inf
    return float(((a - b).abs() / (tol + tol * b.abs())).max())


def _upcast(args):
    return tuple(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


# prefill tile shapes timed beside the default: (block_m, block_n, num_warps, num_stages)
PREFILL_TILES = [None, (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3)]


# decode tile shapes timed beside the default: (keys a tile, num_warps)
DECODE_TILES = [None, (128, 4), (128, 8), (32, 4)]


def _decode_with(tiles):
    from shoal.kernels import paged_attention as pa

    block_n, num_warps = tiles
    return lambda *a: pa.decode(*a, block_n=block_n, num_warps=num_warps)


def _prefill_with(tiles):
    from shoal.kernels import paged_attention as pa

    block_m, block_n, num_warps, num_stages = tiles
    return lambda *a: pa.prefill(*a, block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages)


def build_cases(dev, dtype, small: bool, tri) -> list[Case]:
    """The benchmark's cases. `tri` is the Triton ops namespace (None: references only)."""
    gen = torch.Generator(device=dev).manual_seed(0)
    el = torch.tensor([], dtype=dtype).element_size()
    rnd = lambda *s: torch.randn(*s, device=dev, generator=gen).to(dtype)  # noqa: E731
    tol = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}[dtype]  # atol and rtol
    cases = []
    s = (lambda big, little: little) if small else (lambda big, little: big)

    def add(kernel, shape, fn_name, args, nbytes, flops=0, triton_fn=None):
        rf = getattr(ref, fn_name)
        tf = triton_fn or (getattr(tri, fn_name) if tri is not None else None)
        def check():  # against the reference in float32, so the reference's own rounding stays out of it
            got, want = tf(*args), rf(*_upcast(args))
            return _maxdiff(got, want), _excess(got, want, tol) <= 1

        cases.append(Case(kernel, shape, (lambda: tf(*args)) if tf else None, lambda: rf(*args), nbytes, flops,
                          check if tf is not None else None))

    # cache write: T tokens of K and V into shuffled slots
    T, kvh, d, bs = s(8192, 64), 8, 128, 16
    nb = s(4096, 16)
    key, val = rnd(T, kvh, d), rnd(T, kvh, d)
    kc, vc = torch.zeros(nb, bs, kvh, d, device=dev, dtype=dtype), torch.zeros(nb, bs, kvh, d, device=dev, dtype=dtype)
    slots = torch.randperm(nb * bs, device=dev, generator=gen)[:T]
    if tri is not None:
        kc2, vc2 = kc.clone(), vc.clone()

        def check_write():
            tri.write_kv_cache(key, val, kc, vc, slots)
            ref.write_kv_cache(key, val, kc2, vc2, slots)
            diff = max(_maxdiff(kc, kc2), _maxdiff(vc, vc2))
            return diff, diff == 0  # a copy: bit-exact

    cases.append(Case(
        "write_kv_cache", f"T={T} kvh={kvh} d={d} bs={bs}",
        (lambda: tri.write_kv_cache(key, val, kc, vc, slots)) if tri else None,
        lambda: ref.write_kv_cache(key, val, kc, vc, slots),
        4 * T * kvh * d * el + 8 * T, 0, check_write if tri else None,
    ))

    # decode: a full batch of ragged contexts, and a few long ones (split-K)
    for B, h, kvh, d, bs, lo, hi in (s((128, 32, 8, 128, 16, 512, 4096), (4, 8, 2, 128, 16, 16, 200)),
                                     s((4, 32, 8, 128, 16, 32768, 32768), (1, 4, 1, 128, 16, 600, 600)),
                                     s((64, 12, 4, 80, 32, 256, 2048), (4, 6, 2, 80, 32, 10, 100))):
        lens = torch.randint(lo, hi + 1, (B,), generator=torch.Generator().manual_seed(B)).tolist()
        k, v, bt, ctx = _blocked_cache(lens, bs, kvh, d, dtype, dev, gen)
        q = rnd(B, h, d)
        tokens = sum(lens)
        nbytes = 2 * tokens * kvh * d * el + 2 * B * h * d * el + bt.numel() * 8 + B * 8
        flops = 4 * tokens * h * d
        add("paged_attention_decode", f"B={B} h={h}/{kvh} d={d} bs={bs} ctx~{tokens // B}", "paged_attention_decode",
            (q, k, v, bt, ctx, d**-0.5), nbytes, flops)

    # prefill: chunks of new tokens behind cached prefixes (prefix caching / chunked prefill)
    for seqs, h, kvh, d, bs in (s(([(1024, 1024)] * 4, 32, 8, 128, 16), ([(16, 20), (0, 9)], 8, 2, 128, 16)),
                                s(([(0, 2048), (3000, 512), (0, 1), (100, 1500)], 32, 8, 128, 32), ([(33, 7)], 4, 4, 96, 32))):
        lens = [p + n for p, n in seqs]
        k, v, bt, ctx = _blocked_cache(lens, bs, kvh, d, dtype, dev, gen)
        qsl = torch.tensor([0] + [n for _, n in seqs], device=dev).cumsum(0)
        Tq = int(qsl[-1])
        q = rnd(Tq, h, d)
        nbytes = 2 * sum(lens) * kvh * d * el + 2 * Tq * h * d * el
        flops = sum(4 * n * (p + (n + 1) / 2) * h * d for p, n in seqs)  # causal: half the new-new square
        add("paged_attention_prefill", f"Tq={Tq} seqs={len(seqs)} h={h}/{kvh} d={d} bs={bs}", "paged_attention_prefill",
            (q, k, v, bt, qsl, ctx, d**-0.5), nbytes, int(flops))

    # decode at batch 128 and ~2k tokens of context (the GPU issue's ≥ 70% of bandwidth shape) on the
    # 1B-shaped model's heads (32/8, d 128), under a few (keys a tile, warps): the default first
    B, h, kvh, d, bs = s((128, 32, 8, 128, 16), (4, 8, 2, 64, 16))
    lens = torch.randint(*s((1536, 2560), (16, 200)), (B,), generator=torch.Generator().manual_seed(1)).tolist()
    k, v, bt, ctx = _blocked_cache(lens, bs, kvh, d, dtype, dev, gen)
    args = (rnd(B, h, d), k, v, bt, ctx, d**-0.5)
    for tiles in DECODE_TILES:
        add("paged_attention_decode", f"B={B} h={h}/{kvh} d={d} bs={bs} ctx~{sum(lens) // B} "
            f"tiles {'default' if tiles is None else 'x'.join(map(str, tiles))}", "paged_attention_decode", args,
            2 * sum(lens) * kvh * d * el + 2 * B * h * d * el + bt.numel() * 8 + B * 8, 4 * sum(lens) * h * d,
            triton_fn=None if tri is None or tiles is None else _decode_with(tiles))

    # the prefill of 4 prompts of 4k tokens (the GPU issue's ≥ 400 TFLOP/s shape) under a few
    # tile shapes, (rows of query heads x tokens, keys, warps, pipeline stages): the default first
    seqs, h, kvh, d, bs = s(([(0, 4096)] * 4, 32, 8, 128, 16), ([(0, 70)] * 2, 8, 2, 128, 16))
    lens = [n for _, n in seqs]
    k, v, bt, ctx = _blocked_cache(lens, bs, kvh, d, dtype, dev, gen)
    qsl = torch.tensor([0] + lens, device=dev).cumsum(0)
    q = rnd(int(qsl[-1]), h, d)
    args = (q, k, v, bt, qsl, ctx, d**-0.5)
    flops = int(sum(4 * n * (n + 1) / 2 * h * d for _, n in seqs))
    for tiles in PREFILL_TILES:
        add("paged_attention_prefill", f"Tq={int(qsl[-1])} seqs={len(seqs)} h={h}/{kvh} d={d} bs={bs} "
            f"tiles {'default' if tiles is None else 'x'.join(map(str, tiles))}", "paged_attention_prefill",
            args, 2 * sum(lens) * kvh * d * el + 2 * int(qsl[-1]) * h * d * el, flops,
            triton_fn=None if tri is None or tiles is None else _prefill_with(tiles))

    # small fused ops
    T, H = s(8192, 16), s(4096, 576)
    x, r, w = rnd(T, H), rnd(T, H), (1 + 0.1 * rnd(H))
    add("rms_norm", f"T={T} H={H}", "rms_norm", (x, w, 1e-6), 2 * T * H * el + H * el)
    add("rms_norm+residual", f"T={T} H={H}", "rms_norm", (x, w, 1e-6, r), 4 * T * H * el + H * el)
    T, h, kvh, d = s(8192, 16), 32, 8, 128
    cs = torch.cat([torch.cos(torch.rand(4096, d // 2, device=dev, generator=gen) * 6),
                    torch.sin(torch.rand(4096, d // 2, device=dev, generator=gen) * 6)], -1).to(dtype)
    pos = torch.randint(0, 4096, (T,), device=dev, generator=gen)
    q, k = rnd(T, h, d), rnd(T, kvh, d)
    for neox in (True, False):
        add("rotary_embedding" + ("" if neox else " (GPT-J)"), f"T={T} h={h}/{kvh} d={d}", "rotary_embedding",
            (pos, q, k, cs, neox), 2 * T * (h + kvh) * d * el + T * (d * el + 8))
    T, I = s(8192, 16), s(14336, 200)
    x = rnd(T, 2 * I)
    add("silu_and_mul", f"T={T} I={I}", "silu_and_mul", (x,), 3 * T * I * el)

    # mixture of experts: Qwen3-30B-A3B's layer (128 experts, top-8), a decode batch and a prefill
    H, I, E, k = s(2048, 64), s(768, 32), s(128, 8), s(8, 2)
    w13, w2 = rnd(E, 2 * I, H) / H**0.5, rnd(E, H, I) / I**0.5
    for T in s((64, 4096), (3, 40)):
        scores = torch.rand(T, E, device=dev, generator=gen)
        weights, ids = scores.softmax(-1).topk(k, dim=-1)
        hit = int(ids.unique().numel())  # experts whose weights are read
        add("fused_moe", f"T={T} H={H} I={I} E={E} k={k}", "fused_moe", (rnd(T, H), w13, w2, weights, ids),
            3 * hit * I * H * el + 2 * T * H * el, 6 * T * k * I * H)
    return cases


def _time_cuda(fn, warmup: int, iters: int) -> float:
    """Median milliseconds of `fn` over `iters` runs, each between its own pair of CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _time_cpu(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _table(rows, headers) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" if i < 2 else f"{{:>{w}}}" for i, w in enumerate(widths))
    lines = [fmt.format(*headers), "  ".join("-" * w for w in widths)]
    lines += [fmt.format(*map(str, r)) for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shoal bench kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="no GPU: time the torch references on CPU, small sizes")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--iters", type=int, default=100, help="timed runs per kernel (the median is reported)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--small", action="store_true", help="tiny sizes (a smoke test of the script itself)")
    parser.add_argument("--kernels", default="", help="comma-separated kernel names to run (default: all)")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    t_start = time.perf_counter()

    if args.cpu:
        dev, tri, peak, peak_src = torch.device("cpu"), None, None, "-"
        timer = _time_cpu
        iters, warmup = min(args.iters, 10), min(args.warmup, 2)
        what = "torch references"
        if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):  # the interpreter: checks the script itself
            from shoal.kernels import get_ops

            tri, what = get_ops("triton", dev), "torch references and Triton kernels (interpreter)"
        print(f"shoal kernel bench: {what} on CPU ({torch.get_num_threads()} threads), {args.dtype}, small sizes")
    else:
        if not torch.cuda.is_available():
            print("shoal kernel bench: no CUDA device here, nothing to check or time "
                  "(run it on a GPU machine, or pass --cpu to time the torch references on CPU)")
            return 0
        if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            print("shoal kernel bench: TRITON_INTERPRET is set; unset it to time compiled kernels", file=sys.stderr)
            return 1
        from shoal.kernels import get_ops

        dev = torch.device("cuda", torch.cuda.current_device())
        tri = get_ops("triton", dev)
        peak, peak_src = peak_bandwidth(dev)
        timer, iters, warmup = _time_cuda, args.iters, args.warmup
        print(f"shoal kernel bench: {torch.cuda.get_device_name(dev)}, peak "
              f"{'?' if peak is None else f'{peak:.0f}'} GB/s ({peak_src}), {args.dtype}, "
              f"median of {iters} runs after {warmup} warm-up")

    small = args.small or args.cpu
    cases = build_cases(dev, dtype, small, tri)
    if args.kernels:
        wanted = {k.strip() for k in args.kernels.split(",")}
        cases = [c for c in cases if c.kernel.split()[0].split("+")[0] in wanted]
    rows, failed, skipped = [], 0, 0
    for c in cases:
        if time.perf_counter() - t_start > BUDGET_S:
            skipped += 1
            continue
        err, ok = "-", "-"
        if c.check is not None:
            try:
                diff, passed = c.check()
                ok = "ok" if passed else "FAIL"
                err = f"{diff:.1e}"
            except Exception as exc:  # a kernel that fails to compile or launch is a failed check, not a crash
                ok, err = "FAIL", type(exc).__name__
                print(f"{c.kernel} [{c.shape}]: {exc!r}", file=sys.stderr)
            failed += ok == "FAIL"
        ref_ms = timer(c.run_ref, warmup, iters)
        tri_ms = timer(c.run_triton, warmup, iters) if c.run_triton is not None and ok == "ok" else None
        ms = tri_ms if tri_ms is not None else ref_ms
        gbps = c.bytes / ms / 1e6
        row = [c.kernel, c.shape, ok, err, f"{ref_ms:.3f}", "-" if tri_ms is None else f"{tri_ms:.3f}",
               "-" if tri_ms is None else f"{ref_ms / tri_ms:.1f}x", f"{c.bytes / 1e6:.3g}", f"{gbps:.3g}",
               "-" if peak is None or tri_ms is None else f"{100 * gbps / peak:.0f}%",
               f"{c.flops / ms / 1e9:.3g}" if c.flops else "-"]
        rows.append(row)
    headers = ["kernel", "shape", "check", "max err", "torch ms", "triton ms", "speedup", "MB moved", "GB/s",
               "% peak BW", "TFLOP/s"]
    print(_table(rows, headers))
    note = "GB/s and TFLOP/s are the Triton kernel's" if tri is not None else "GB/s and TFLOP/s are the torch reference's"
    print(f"{note}; 'MB moved' is the floor (inputs read once, outputs written once). "
          f"{time.perf_counter() - t_start:.0f} s in all.")
    if skipped:
        print(f"{skipped} case(s) skipped: past the {BUDGET_S:.0f} s budget")
    if failed:
        print(f"{failed} check(s) FAILED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

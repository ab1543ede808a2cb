"""The backend selection API, and the two backends agreeing through a tiny attention layer."""

import inspect
import os
import subprocess
import sys

import pytest
import torch

import kernel_naive as naive
from shoal.kernels import OPS, get_ops
from shoal.kernels import reference as ref


def _run(code, **env):
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    environ.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ, timeout=120)


def test_torch_backend_is_the_reference():
    ops = get_ops("torch", "cpu")
    assert ops.backend == "torch"
    for name in OPS:
        assert getattr(ops, name) is getattr(ref, name)


def test_auto_on_cpu_is_torch():
    assert get_ops("auto", "cpu").backend == "torch"
    assert get_ops("auto", torch.device("cpu")).backend == "torch"


def test_unknown_backend():
    with pytest.raises(ValueError, match="torch, triton, auto"):
        get_ops("cuda", "cpu")


def test_no_triton_import_and_no_triton_on_cpu_without_the_interpreter():
    """One fresh interpreter (no TRITON_INTERPRET): the package, the torch and auto backends and the
    bench load without triton; asking for triton on CPU then fails with a clear message."""
    r = _run(
        "import sys; import shoal.kernels as k; k.get_ops('auto', 'cpu'); k.get_ops('torch', 'cpu');"
        "import shoal.kernels.bench; assert 'triton' not in sys.modules, 'triton was imported';"
        "k.get_ops('triton', 'cpu')"
    )
    assert "triton was imported" not in r.stderr, r.stderr
    if k_has_triton():
        assert r.returncode != 0 and "TRITON_INTERPRET=1" in r.stderr, r.stderr


def k_has_triton():
    from shoal.kernels import triton_available

    return triton_available()


def test_auto_on_cuda_picks_triton():
    pytest.importorskip("triton")
    assert get_ops("auto", "cuda").backend == "triton"  # choosing touches no device


def test_triton_ops_have_the_reference_signatures(triton_ops):
    assert triton_ops.backend == "triton"
    for name in OPS:
        assert inspect.signature(getattr(triton_ops, name)) == inspect.signature(getattr(ref, name)), name


def _layer(ops, x, positions, w, caches, block_tables, context_lens, slot_mapping, prefill_meta):
    """One Llama-style decoder layer over the paged cache, written only against `ops`."""
    T, H = x.shape
    h, kvh, d = w["h"], w["kvh"], w["d"]
    hn, res = ops.rms_norm(x, w["ln1"], 1e-6, w["res"])
    qkv = hn @ w["qkv"]
    q = qkv[:, : h * d].view(T, h, d)
    k = qkv[:, h * d : (h + kvh) * d].view(T, kvh, d)
    v = qkv[:, (h + kvh) * d :].view(T, kvh, d)
    q, k = ops.rotary_embedding(positions, q, k, w["rope"], True)
    ops.write_kv_cache(k, v, caches[0], caches[1], slot_mapping)
    if prefill_meta is None:
        attn = ops.paged_attention_decode(q, caches[0], caches[1], block_tables, context_lens, d**-0.5)
    else:
        attn = ops.paged_attention_prefill(q, caches[0], caches[1], block_tables, prefill_meta, context_lens, d**-0.5)
    x = attn.reshape(T, h * d) @ w["o"]
    hn, res = ops.rms_norm(x, w["ln2"], 1e-6, res)
    return ops.silu_and_mul(hn @ w["up"]) @ w["down"] + res


def test_backends_agree_through_a_layer(triton_ops):
    """Chunked prefill of two sequences (one behind a cached prefix), then a decode step."""
    torch_ops = get_ops("torch", "cpu")
    H, h, kvh, d, bs, inter = 64, 4, 2, 64, 16, 96
    w = dict(h=h, kvh=kvh, d=d, ln1=1 + 0.1 * torch.randn(H), ln2=1 + 0.1 * torch.randn(H),
             qkv=torch.randn(H, (h + 2 * kvh) * d) / 8, o=torch.randn(h * d, H) / 16,
             up=torch.randn(H, 2 * inter) / 8, down=torch.randn(inter, H) / 10, rope=naive.rope_cache(128, d))
    block_tables = torch.tensor([[5, 2, 7], [0, 6, 3]])
    slot = lambda b, p: int(block_tables[b, p // bs]) * bs + p % bs  # noqa: E731
    caches = {name: [torch.zeros(8, bs, kvh, d), torch.zeros(8, bs, kvh, d)] for name in ("torch", "triton")}
    outs = {}
    for name, ops in (("torch", torch_ops), ("triton", triton_ops)):
        # step 1: sequence 0 prefills positions 0..20, sequence 1 positions 0..11
        steps = [((0, 21), (0, 12)), ((21, 33), (12, 13)), ((33, 34), (13, 14))]  # prefill, chunk, decode
        torch.manual_seed(1)
        for i, chunk in enumerate(steps):
            positions = torch.tensor([p for a, b in chunk for p in range(a, b)])
            slots = torch.tensor([slot(s, p) for s, (a, b) in enumerate(chunk) for p in range(a, b)])
            ctx = torch.tensor([b for _, b in chunk])
            qsl = torch.tensor([0] + [b - a for a, b in chunk]).cumsum(0)
            x = torch.randn(len(positions), H)
            w["res"] = torch.randn(len(positions), H)
            meta = None if i == 2 else qsl
            outs[name, i] = _layer(ops, x, positions, w, caches[name], block_tables, ctx, slots, meta)
    for i in range(3):
        assert not outs["triton", i].isnan().any()
        torch.testing.assert_close(outs["triton", i], outs["torch", i], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(caches["triton"][0], caches["torch"][0], atol=1e-5, rtol=1e-5)

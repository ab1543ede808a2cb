"""The C decode step (runtime/models/cpu_llama.c) against the torch model it replaces: the same
logits and the same keys and values written into the paged cache, step after step, for
batch sizes that hit every code path; the library's prefill kernels against the torch
references; and, in the engine, transformers' greedy tokens."""

from __future__ import annotations

import pytest
import torch

from shoal import LLM, SamplingParams
from shoal.kernels import get_ops, reference
from shoal.runtime.models.cpu_llama import CpuDecoder, cpu_supported, unsupported_reason
from shoal.runtime.layers.attention import AttentionMetadata
from shoal.runtime.models.decoder import DecoderForCausalLM
from shoal.runtime.models.loader import iter_weights, load_config
import gguf_files
from engine_helpers import hf_greedy, make_tiny_model

pytestmark = pytest.mark.skipif(cpu_supported() is not None, reason=f"C decode step: {cpu_supported()}")

NUM_BLOCKS = 160


def load(model_dir):
    cfg = load_config(model_dir)
    model = DecoderForCausalLM(cfg, max_positions=512)
    model.load_weights(iter_weights(model_dir))
    return model.eval()


def new_caches(model, block):
    """Per layer, [2, blocks, block, kvh, d] views of [2, kvh, blocks, block, d] storage (the engine's layout)."""
    shape = (2, model.num_kv_heads, NUM_BLOCKS, block, model.head_dim)
    return [torch.zeros(shape).permute(0, 2, 3, 1, 4) for _ in model.layers]


def torch_step(model, caches, ids, pos, slots, tables, ctx):
    meta = AttentionMetadata(slots, len(ids), tables, ctx, None, None, None)
    with torch.inference_mode():
        hidden, _ = model(get_ops("torch", "cpu"), ids, pos, [(c, None) for c in caches], meta)
        return model.compute_logits(hidden)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny(request, tmp_path_factory, builtin_dir):
    """Random tiny models: Llama (untied LM head), Qwen2 (QKV biases), Qwen3 (per-head q/k norms,
    head_dim 16 != hidden / heads, tied); 8 query heads over 2 KV heads."""
    path = tmp_path_factory.mktemp(request.param)
    extra = {"qwen2": {"use_sliding_window": False}, "qwen3": {"head_dim": 16, "tie_word_embeddings": True}}
    make_tiny_model(path, builtin_dir, request.param, hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                    intermediate_size=96, num_hidden_layers=3, **extra.get(request.param, {}))
    model = load(path)
    if request.param == "qwen3":  # norms of ones would hide a q/k norm the C step skipped
        torch.manual_seed(1)
        for layer in model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.data.add_(torch.randn_like(norm.weight) * 0.3)
    return model


@pytest.mark.parametrize("batch", [1, 3, 4, 6, 17])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("block", [4, 16])  # 16: keys go 8 at a time; 4: one by one
def test_decode_steps_match_the_torch_model(tiny, batch, threads, block):
    """Sequences with prompts already in the cache decode 5 tokens; each step the C decoder and
    the torch model start from identical caches and must leave identical caches and logits."""
    model = tiny
    decoder = CpuDecoder.create(model, num_threads=threads)
    assert decoder is not None
    check_steps_against_torch(model, decoder, batch, block, max_context=400, steps=5)  # within the 512 positions


def check_steps_against_torch(model, decoder, batch: int, block: int, max_context: int, steps: int) -> None:
    """`steps` decode steps of `batch` sequences with prompts already in the cache: each step the
    C decoder and the torch model start from identical caches and must leave identical caches
    and logits. Closes the decoder."""
    ours, theirs = new_caches(model, block), new_caches(model, block)
    decoder.attach(ours)
    per_seq = min(NUM_BLOCKS // batch, max_context // block)
    tables = torch.randperm(NUM_BLOCKS)[: batch * per_seq].view(batch, per_seq)  # disjoint, scattered blocks
    ctx = torch.randint(1, per_seq * block - steps, (batch,))
    for c in ours:
        c.normal_()  # stands for the prompts' keys and values
    for a, b in zip(ours, theirs):
        b.copy_(a)
    for _ in range(steps):
        pos = ctx - 1
        slots = tables.gather(1, (pos // block)[:, None])[:, 0] * block + pos % block
        ids = torch.randint(0, model.cfg.vocab_size, (batch,))
        expected = torch_step(model, theirs, ids, pos, slots, tables, ctx)
        got = decoder.step(ids, pos, slots, tables, ctx)
        # float32 sums in another order, through every layer: relative to the logits' scale
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=2e-5 * float(expected.abs().max()))
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        ctx = ctx + 1
    decoder.close()


@pytest.mark.parametrize("rows,half", [(1, 96), (7, 12), (33, 1536)])  # 12: a tail past the 8-wide lanes
@pytest.mark.parametrize("threads", [1, 2])
def test_silu_and_mul_matches_the_reference(tiny, rows, half, threads):
    decoder = CpuDecoder.create(tiny, threads)
    x = torch.randn(rows, 2 * half, generator=torch.Generator().manual_seed(rows)) * 8  # past exp's easy range
    torch.testing.assert_close(decoder.silu_and_mul(x), reference.silu_and_mul(x), rtol=1e-5, atol=1e-6)
    strided = torch.randn(2 * half, rows).t()  # not contiguous (rows > 1): handed to the reference
    torch.testing.assert_close(decoder.silu_and_mul(strided), reference.silu_and_mul(strided), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("heads,kv_heads,d,block", [(9, 3, 64, 16), (8, 2, 40, 32), (4, 4, 24, 8), (6, 1, 64, 4)])
@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_attention_matches_the_reference(tiny, heads, kv_heads, d, block, threads):
    """A ragged step: whole prompts, chunks after a cached prefix, a one-token chunk, a prompt
    shorter than a block; scattered blocks; queries strided as the QKV split leaves them;
    head sizes that are not a multiple of 16 and GQA ratios from 1 to 6."""
    decoder = CpuDecoder.create(tiny, threads)
    g = torch.Generator().manual_seed(heads * d + block)
    blocks = 160
    store = torch.randn(2, kv_heads, blocks, block, d, generator=g)  # the engine's layout
    k_cache, v_cache = store[0].permute(1, 2, 0, 3), store[1].permute(1, 2, 0, 3)
    ctx = torch.tensor([37, 100, 5, 64, 1, 90])
    q_len = torch.tensor([37, 20, 5, 33, 1, 1])
    starts = torch.cat((torch.zeros(1, dtype=torch.long), q_len.cumsum(0)))
    width = -(-int(ctx.max()) // block)
    tables = torch.randperm(blocks, generator=g)[: len(ctx) * width].view(len(ctx), width)
    T = int(q_len.sum())
    q = torch.randn(T, (heads + 2 * kv_heads) * d, generator=g)[:, : heads * d].view(T, heads, d)
    args = (q, k_cache, v_cache, tables, starts, ctx, d**-0.5)
    torch.testing.assert_close(decoder.paged_attention_prefill(*args), reference.paged_attention_prefill(*args),
                               rtol=1e-5, atol=1e-5)
    wide = (q.double(), k_cache.double(), v_cache.double(), *args[3:])  # not float32: handed to the reference
    torch.testing.assert_close(decoder.paged_attention_prefill(*wide), reference.paged_attention_prefill(*wide))


def test_batch_beyond_the_c_limit_is_refused(tiny):
    decoder = CpuDecoder.create(tiny)
    decoder.attach(new_caches(tiny, 16))
    B = decoder.max_batch + 1
    one = torch.ones(B, dtype=torch.long)
    with pytest.raises(ValueError, match="sequences"):
        decoder.step(one, one, one, one[:, None], one)


def test_models_it_cannot_run_are_named(tmp_path, builtin_dir):
    """A head size that is not a multiple of 8: the engine says why and runs the torch model."""
    path = make_tiny_model(tmp_path / "odd", builtin_dir, hidden_size=36, num_attention_heads=2, num_key_value_heads=1,
                           intermediate_size=40)
    assert "multiples of 8" in unsupported_reason(load(path))
    llm = LLM(str(path), kv_cache_memory=2**24)
    assert llm.engine.executor.cpu_decoder is None
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, min_tokens=4, temperature=0.0))
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert out[0].outputs[0].token_ids == hf_greedy(hf, [5, 6, 7], 4)


def test_engine_decodes_in_c_and_matches_transformers(llm, hf_model, tokenizer):
    """Small decode batches of the built-in model go through the C step, and greedy tokens
    stay transformers' own."""
    runner = llm.engine.executor
    assert runner.cpu_decoder is not None
    calls = []
    step = runner.cpu_decoder.step

    def spy(*args):
        calls.append(args[0].shape[0])
        return step(*args)

    runner.cpu_decoder.step = spy
    try:
        prompts = [tokenizer(t).input_ids for t in ("Once upon a time", "The capital of France is", "1, 2, 3,")]
        params = SamplingParams(max_tokens=24, min_tokens=24, temperature=0.0)
        outs = llm.generate(prompts, params)
    finally:
        del runner.cpu_decoder.step
    assert calls and max(calls) == 3
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf_model, p, 24) for p in prompts]
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks


def test_engine_decodes_qwen3_in_c_and_matches_transformers(tmp_path, builtin_dir):
    """A tiny Qwen3 (q/k norms randomized, head_dim != hidden / heads, tied) decodes through the
    C step in the engine; greedy tokens and first-step log-probabilities are transformers'."""
    from family_models import check_against_reference, hf_reference, make_family_model, mixed_prompts

    path, hf = make_family_model(tmp_path / "qwen3", builtin_dir, "qwen3")
    prompts = mixed_prompts()
    tokens, first = hf_reference(hf, prompts, 16)
    llm = LLM(str(path), kv_cache_memory=2**24)
    decoder = llm.engine.executor.cpu_decoder
    assert decoder is not None
    calls = []
    step = decoder.step
    decoder.step = lambda *args: calls.append(args[0].shape[0]) or step(*args)
    check_against_reference(llm, ("qwen3", path, prompts, tokens, first), 16)
    assert calls and max(calls) == len(prompts)


def test_families_the_c_step_does_not_run_are_named(tmp_path, builtin_dir):
    """OLMo 2's all-heads q/k norm (and every other family switch) stays on the torch model."""
    from family_models import make_family_model

    path, _ = make_family_model(tmp_path / "olmo2", builtin_dir, "olmo2")
    assert "shape" in unsupported_reason(load(path))


# ---- quantized weights: GGUF blocks read as stored, against gguf.quants ---------------------

QUANT = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}


def _activation_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[B, N] bound on |x w^T - x' w^T| where x' is x rounded to 8-bit blocks of 32 (scale
    max|x| / 127 a block, so each value moves by at most half a step)."""
    step = x.view(x.shape[0], -1, 32).abs().amax(-1) / 127
    half = step.repeat_interleave(32, dim=1) / 2
    return half @ w.abs().T * 1.001 + 1e-5


@pytest.mark.parametrize("qtype", sorted(QUANT))
@pytest.mark.parametrize("batch", [1, 3, 5, 17])
def test_quantized_products_match_gguf_dequantized(qtype, batch):
    """The decode step's kernels on GGUF blocks against gguf.quants' own dequantization: batches
    above 4 run the float tiles on dequantized panels (float32 sums); small batches take 8-bit
    dot products, off by no more than rounding the inputs to 8-bit blocks allows."""
    import gguf.quants
    from gguf import GGMLQuantizationType

    from shoal.runtime.models.cpu_llama import quantized_matmul

    t = GGMLQuantizationType[qtype]
    gen = torch.Generator().manual_seed(batch)
    w = torch.randn(40, 96, generator=gen)
    blocks = gguf.quants.quantize(w.numpy(), t)
    w_ref = torch.from_numpy(gguf.quants.dequantize(blocks, t).copy())
    x = torch.randn(batch, 96, generator=gen)
    got = quantized_matmul(QUANT[qtype], torch.from_numpy(blocks.copy()), x)
    expected = x.double() @ w_ref.double().T
    if batch > 4:
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)
    else:
        err = (got.double() - expected).abs()
        assert bool((err <= _activation_bound(x, w_ref).double()).all()), float(err.max())
        assert float(err.max()) > 0  # the 8-bit path did run


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_reference_kquantizer_writes_the_published_layout(qtype):
    """tests/gguf_files.py's K-quant blocks, read back by gguf.quants: the weights within one
    quantization step (the layout is right, or the values would land elsewhere)."""
    import gguf.quants
    from gguf import GGMLQuantizationType

    from gguf_files import quantize

    w = torch.randn(8, 512, generator=torch.Generator().manual_seed(0)).numpy()
    back = gguf.quants.dequantize(quantize(w, qtype), GGMLQuantizationType[qtype])
    levels = {"Q4_K": 15, "Q5_K": 31, "Q6_K": 31}[qtype]  # Q6_K: 31 steps a side of zero
    span = w.reshape(-1, 16).max(-1) - w.reshape(-1, 16).min(-1) if qtype != "Q6_K" else abs(w).reshape(-1, 16).max(-1)
    step = span.max() / levels  # loose: the largest sub-block's step, scales rounded to 6 or 8 bits
    assert abs(back - w).max() < step


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("batch", [1, 3, 5, 17])
def test_kquant_products_match_gguf_dequantized(qtype, batch):
    """Q4_K/Q5_K/Q6_K rows (super-blocks of 256) through the decode step's kernels against
    gguf.quants' dequantization and a float64 matmul: batches above 4 on dequantized float
    panels (float32 sums), small batches on 8-bit inputs within the bound their rounding allows,
    by the AVX2 kernels and by the portable loop alike (the two agree to float rounding)."""
    import gguf.quants
    from gguf import GGMLQuantizationType

    from gguf_files import TYPES, quantize
    from shoal.runtime.models.cpu_llama import quantized_matmul

    gen = torch.Generator().manual_seed(batch)
    w = torch.randn(40, 512, generator=gen) * torch.rand(40, 1, generator=gen)  # rows of different ranges
    w[3, :256] = 0  # a zero super-block (scales 0)
    blocks = torch.from_numpy(quantize(w.numpy(), qtype))
    w_ref = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), GGMLQuantizationType[qtype]).copy())
    x = torch.randn(batch, 512, generator=gen)
    expected = x.double() @ w_ref.double().T
    fast, portable = (quantized_matmul(TYPES[qtype], blocks, x, scalar=s) for s in (False, True))
    torch.testing.assert_close(fast, portable, rtol=1e-5, atol=1e-4)
    if batch > 4:
        torch.testing.assert_close(fast.double(), expected, rtol=1e-5, atol=1e-4)
    else:
        err = (fast.double() - expected).abs()
        assert bool((err <= _activation_bound(x, w_ref).double()).all()), float(err.max())
        assert float(err.max()) > 0  # the 8-bit path did run


def _quantize_model(model_dir, types: dict[str, str]):
    """The tiny model's linear weights (and LM head) as GGUF blocks of the given types, and the
    torch model loaded with exactly the weights those blocks hold."""
    import gguf.quants
    from gguf import GGMLQuantizationType

    blocks, weights = {}, []
    for name, tensor in iter_weights(model_dir):
        kind = next((k for k in types if name.endswith(k + ".weight")), None)
        if kind is not None:
            t = GGMLQuantizationType[types[kind]]
            rows = gguf_files.quantize(tensor.float().numpy(), types[kind])
            blocks[name] = (int(t), rows)
            tensor = torch.from_numpy(gguf.quants.dequantize(rows, t).copy())
        weights.append((name, tensor))
    model = DecoderForCausalLM(load_config(model_dir), max_positions=512)
    model.load_weights(iter(weights))
    return model.eval(), blocks


@pytest.fixture(scope="module")
def quantized_tiny(tmp_path_factory, builtin_dir):
    path = make_tiny_model(tmp_path_factory.mktemp("quant"), builtin_dir, hidden_size=64, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=96, num_hidden_layers=2, initializer_range=0.05)
    types = {"q_proj": "Q8_0", "k_proj": "Q8_0", "v_proj": "Q8_0", "o_proj": "Q4_0", "gate_proj": "Q4_1",
             "up_proj": "Q4_1", "down_proj": "Q4_0", "lm_head": "Q8_0"}
    return _quantize_model(path, types)


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("float_panels", [True, False])
def test_decoder_on_quantized_blocks_matches_the_dequantized_model(quantized_tiny, batch, threads, float_panels):
    """A decode step reading Q8_0/Q4_0/Q4_1 blocks against the torch model holding the same
    weights dequantized by gguf.quants: the same logits for a batch of 8 (float tiles, on float
    panels or on panels dequantized as they go), and log-probabilities within 0.05 of them where
    the inputs are rounded to 8 bits (batches <= 4)."""
    model, blocks = quantized_tiny
    decoder = CpuDecoder.create(model, num_threads=threads, quantized=blocks, float_panels=float_panels)
    assert decoder.quantized_types == [8, 2, 3, 2] * 2 + [8]
    ours, theirs = new_caches(model, 16), new_caches(model, 16)
    decoder.attach(ours)
    tables = torch.randperm(NUM_BLOCKS)[: batch * 4].view(batch, 4)
    ctx = torch.randint(1, 60, (batch,))
    for _ in range(3):
        pos = ctx - 1
        slots = tables.gather(1, (pos // 16)[:, None])[:, 0] * 16 + pos % 16
        ids = torch.randint(0, model.cfg.vocab_size, (batch,))
        expected = torch_step(model, theirs, ids, pos, slots, tables, ctx)
        got = decoder.step(ids, pos, slots, tables, ctx)
        if batch > 4:
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=2e-5 * float(expected.abs().max()))
        else:
            diff = (got.log_softmax(-1) - expected.log_softmax(-1)).abs()
            top = expected.topk(20, dim=-1).indices  # where the probability is
            assert 0 < float(diff.gather(1, top).max()) < 0.05
        for a, b in zip(ours, theirs):
            if batch > 4:
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
            b.copy_(a)  # the next step starts from identical caches
        ctx = ctx + 1


@pytest.fixture(scope="module")
def kquant_tiny(tmp_path_factory, builtin_dir):
    """A tiny model (hidden 256: rows of whole K-quant super-blocks) with Q4_K, Q5_K, Q6_K matrices."""
    path = make_tiny_model(tmp_path_factory.mktemp("kquant"), builtin_dir, hidden_size=256, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=512, num_hidden_layers=2, initializer_range=0.05)
    types = {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q4_K", "o_proj": "Q5_K", "gate_proj": "Q4_K",
             "up_proj": "Q4_K", "down_proj": "Q6_K", "lm_head": "Q6_K"}
    return _quantize_model(path, types)


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("threads", [1, 2])
def test_decoder_on_kquant_blocks_matches_the_dequantized_model(kquant_tiny, batch, threads):
    """A decode step reading Q4_K/Q5_K/Q6_K blocks against the torch model holding the same
    weights dequantized by gguf.quants: the same logits for a batch of 8 (float panels), and
    the top tokens' log-probabilities within 0.1 where the inputs are rounded to 8 bits (batches <= 4)."""
    model, blocks = kquant_tiny
    decoder = CpuDecoder.create(model, num_threads=threads, quantized=blocks)
    assert decoder.quantized_types == [12, 13, 12, 14] * 2 + [14]
    ours, theirs = new_caches(model, 16), new_caches(model, 16)
    decoder.attach(ours)
    tables = torch.randperm(NUM_BLOCKS)[: batch * 4].view(batch, 4)
    ctx = torch.randint(1, 60, (batch,))
    for _ in range(3):
        pos = ctx - 1
        slots = tables.gather(1, (pos // 16)[:, None])[:, 0] * 16 + pos % 16
        ids = torch.randint(0, model.cfg.vocab_size, (batch,))
        expected = torch_step(model, theirs, ids, pos, slots, tables, ctx)
        got = decoder.step(ids, pos, slots, tables, ctx)
        if batch > 4:
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=2e-5 * float(expected.abs().max()))
        else:
            diff = (got.log_softmax(-1) - expected.log_softmax(-1)).abs()
            top = expected.topk(20, dim=-1).indices  # 8-bit inputs through 2 layers of K 256-512, vocab 49k:
            assert 0 < float(diff.gather(1, top).max()) < 0.1  # measured up to 0.05
        for a, b in zip(ours, theirs):
            b.copy_(a)  # the next step starts from identical caches
        ctx = ctx + 1


def test_engine_serves_a_kquant_gguf_from_its_blocks(tmp_path, monkeypatch):
    """A Llama GGUF whose linear weights are Q4_K, Q5_K and Q6_K (q/k rows permuted as llama.cpp
    writes them), served with --quantization gguf against the same file on the float32 path
    (the weights gguf.quants dequantizes): the C step reads the blocks of every matrix, and the
    greedy tokens' log-probabilities stay within 0.1 of the float path's while the tokens agree."""
    from gguf_files import tiny_llama, write_tiny_gguf

    monkeypatch.setenv("SHOAL_CACHE", str(tmp_path / "cache"))
    model = tiny_llama(hidden_size=256, intermediate_size=512, seed=3)
    path = tmp_path / "tiny-kquants.gguf"
    write_tiny_gguf(path, model, {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q5_K",
                                  "gate_proj": "Q4_K", "up_proj": "Q4_K", "down_proj": "Q6_K", "lm_head": "Q6_K"})
    prompts = [[1, 50, 60, 70], [1, 100, 7, 259, 261], [1, 3]]
    params = SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0, logprobs=0)
    runs = {}
    for quantization in (None, "gguf"):
        llm = LLM(str(path), quantization=quantization, dtype="auto" if quantization else "float32", kv_cache_memory=2**24)
        decoder = llm.engine.executor.cpu_decoder
        # q and k are Q4_K but v is Q6_K: the fused qkv matrix stays float (one type a matrix)
        expected_types = [0, 13, 12, 14] * 2 + [14] if quantization else [0] * 9
        assert decoder is not None and decoder.quantized_types == expected_types
        runs[quantization] = [o.outputs[0] for o in llm.generate(prompts, params)]
        llm.engine.shutdown()
    compared = 0
    for fp32, quant in zip(runs[None], runs["gguf"]):
        for a, b, la, lb in zip(fp32.token_ids, quant.token_ids, fp32.logprobs, quant.logprobs):
            if a != b:
                break
            assert abs(la[a] - lb[b]) < 0.1
            compared += 1
    assert compared >= 12


def test_engine_serves_the_builtin_model_from_its_q4_1_blocks(builtin_dir, tokenizer):
    """By default the built-in model's C step reads its Q4_1 blocks (Q8_0 LM head); `dtype
    float32` keeps the dequantized path. Greedy tokens against the float32 path, and each
    chosen token's log-probability."""
    from shoal.runtime.models.gguf_convert import gguf_source

    assert gguf_source(builtin_dir) is not None
    prompts = [tokenizer(t).input_ids for t in ("Once upon a time", "The capital of France is", "def fib(n):")]
    params = SamplingParams(max_tokens=16, min_tokens=16, temperature=0.0, logprobs=0)
    runs = {}
    for kind, options in (("float32", dict(dtype="float32")), ("default", {})):
        llm = LLM("builtin://smollm2-135m-instruct", kv_cache_memory=2**26, **options)
        decoder = llm.engine.executor.cpu_decoder
        assert llm.engine.config.quantization == (None if options else "gguf")
        assert decoder is not None and set(decoder.quantized_types) == ({0} if options else {3, 8})
        runs[kind] = [o.outputs[0] for o in llm.generate(prompts, params)]
        llm.engine.shutdown()
    diffs = []
    for fp32, quant in zip(runs["float32"], runs["default"]):
        same = 0
        for a, b, la, lb in zip(fp32.token_ids, quant.token_ids, fp32.logprobs, quant.logprobs):
            if a != b:
                break
            same += 1
            diffs.append(abs(la[a] - lb[b]))
        assert same >= 4, (fp32.token_ids, quant.token_ids)
    # the same weights; 8-bit inputs to each product move a chosen token's log-probability
    # by ~0.03 on average (measured 0.03 mean, 0.27 max over 213 tokens)
    assert sum(diffs) / len(diffs) < 0.1 and max(diffs) < 0.6, diffs


def test_gguf_blocks_are_the_default_only_where_they_run():
    """The blocks are the default for a model named as a GGUF, in one CPU process with the C
    step, no dtype asked for and no LoRA; anything else keeps the float path it asked for."""
    from shoal.runtime.config import EngineConfig

    assert EngineConfig().quantization == "gguf"
    assert EngineConfig(model="/models/x.Q4_1.gguf").quantization == "gguf"
    for options in (dict(dtype="float32"), dict(device="cuda"), dict(tensor_parallel_size=2), dict(cpu_decode_max_seqs=0),
                    dict(enable_lora=True), dict(model="/models/llama-dir"), dict(quantization="fp8")):
        assert EngineConfig(**options).quantization == options.get("quantization"), options


def test_quantization_needs_a_gguf_model(tmp_path, builtin_dir):
    from shoal.runtime.config import EngineConfig

    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int3")
    path = make_tiny_model(tmp_path / "hf", builtin_dir)
    with pytest.raises(ValueError, match="needs a GGUF model"):
        LLM(str(path), quantization="gguf", kv_cache_memory=2**24)

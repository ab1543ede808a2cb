"""The CPU decode step in C (cpu_llama.c): build it, pack a model's weights for it, run it.

    decoder = CpuDecoder.create(model)   # before oneDNN packing; None where it cannot run
    decoder.attach(kv_caches)            # once the KV cache exists
    logits = decoder.step(input_ids, positions, slots, block_tables, context_lens)

The library is compiled at first use (with AVX-512 where torch uses it) with the system's C compiler into
``$SHOAL_CACHE/kernels/`` (named by a hash of the source, written atomically), like
Triton's cache. A machine without a compiler or without AVX2/FMA gets None, and the
engine runs the torch model instead. The decoder keeps its own copy of the linear
weights in 8-row panels (as much memory again as the weights); the KV cache is shared
with the torch model, in place.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

from shoal.kernels import reference
from shoal.runtime.cpu_memory import huge_page_zeros

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_llama.c")
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fPIC", "-shared", "-fopenmp"]
AVX512_FLAGS = ["-mavx512f"]  # the wider matmul tile, where torch's own kernels use AVX-512 too
P = ctypes.POINTER
F32P = P(ctypes.c_float)
I64 = ctypes.c_int64
U8P = P(ctypes.c_uint8)
# GGUF block types the C step reads as they are (ggml's numbers) -> (weights, bytes) per block
QUANT_TYPES = {2: (32, 18), 3: (32, 20), 8: (32, 34),  # Q4_0, Q4_1, Q8_0
               12: (256, 144), 13: (256, 176), 14: (256, 210)}  # Q4_K, Q5_K, Q6_K


class _Model(ctypes.Structure):
    _fields_ = [(n, I64) for n in ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate", "vocab",
                                   "block_size", "num_blocks", "max_positions")] + [
        ("eps", ctypes.c_double), ("scale", ctypes.c_double),
        ("embed", F32P), ("final_norm", F32P), ("lm_head", F32P), ("cos_sin", F32P),
    ] + [(n, P(F32P)) for n in ("input_norm", "post_norm", "qkv", "qkv_bias", "o", "gate_up", "down", "kv")] + [
        (n, P(U8P)) for n in ("qkv_q", "o_q", "gate_up_q", "down_q")] + [("lm_head_q", U8P), ("types", P(I64))] + [
        (n, P(F32P)) for n in ("q_norm", "k_norm")] + [
        (n, I64) for n in ("num_experts", "top_k", "moe_intermediate", "norm_topk_prob")] + [
        (n, P(F32P)) for n in ("router", "expert_gate_up", "expert_down")] + [("shared_intermediate", I64)] + [
        (n, P(F32P)) for n in ("shared_gate_up", "shared_down", "shared_gate")]


class _Step(ctypes.Structure):
    _fields_ = [("batch", I64), ("token_ids", P(I64)), ("positions", P(I64)), ("slots", P(I64)),
                ("block_tables", P(I64)), ("max_blocks", I64), ("context_lens", P(I64)), ("logits", F32P)]


class _Prefill(ctypes.Structure):
    _fields_ = [("q", F32P), ("q_stride", I64), ("k_cache", F32P), ("v_cache", F32P), ("block_stride", I64),
                ("head_stride", I64), ("block_size", I64), ("block_tables", P(I64)), ("max_blocks", I64),
                ("query_start_loc", P(I64)), ("context_lens", P(I64)), ("batch", I64), ("heads", I64),
                ("kv_heads", I64), ("head_dim", I64), ("scale", ctypes.c_double), ("out", F32P)]


def _cache_dir() -> Path:
    from shoal.runtime.models.loader import cache_dir

    return cache_dir() / "kernels"


def compile_flags() -> list[str]:
    """AVX2 and FMA always; AVX-512 too where torch dispatches to it (ATEN_CPU_CAPABILITY=avx2
    turns both down)."""
    return FLAGS + (AVX512_FLAGS if torch.backends.cpu.get_cpu_capability() == "AVX512" else [])


def _compile() -> Path:
    """The shared library for this source and these flags, compiled once (atomic rename)."""
    source = SOURCE.read_bytes()
    flags = compile_flags()
    key = hashlib.sha256(source + " ".join(flags).encode()).hexdigest()[:16]
    out = _cache_dir() / f"cpu_llama-{key}.so"
    if out.exists():
        return out
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, "-o", tmp, str(SOURCE), "-lm"], check=True, capture_output=True, text=True)
        os.replace(tmp, out)
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"compiling {SOURCE.name} failed:\n{e.stderr}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


_LIB: ctypes.CDLL | None = None


def load_library() -> ctypes.CDLL:
    global _LIB
    if _LIB is None:
        lib = ctypes.CDLL(str(_compile()))
        lib.shoal_decoder_new.restype = ctypes.c_void_p
        lib.shoal_decoder_new.argtypes = [P(_Model), I64]
        lib.shoal_decoder_step.restype = I64
        lib.shoal_decoder_step.argtypes = [ctypes.c_void_p, P(_Step)]
        lib.shoal_decoder_free.argtypes = [ctypes.c_void_p]
        lib.shoal_max_batch.restype = I64
        lib.shoal_silu_and_mul.argtypes = [F32P, F32P, I64, I64, I64]
        lib.shoal_quantized_matmul.restype = I64
        lib.shoal_quantized_matmul.argtypes = [I64, U8P, I64, I64, F32P, I64, F32P, I64]
        lib.shoal_sample_top_p.restype = I64
        lib.shoal_sample_top_p.argtypes = [F32P, I64, I64, F32P, F32P, P(ctypes.c_double), P(I64), I64]
        lib.shoal_prefill_attention.restype = I64
        lib.shoal_prefill_attention.argtypes = [P(_Prefill), I64]
        _LIB = lib
    return _LIB


def cpu_supported() -> str | None:
    """Why this CPU cannot run the decoder, or None when it can."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"needs AVX2 and FMA (this CPU: {torch.backends.cpu.get_cpu_capability()})"
    return None


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N/8), K, 8]: each run of 8 rows stored column by column (zero rows pad N)."""
    N, K = weight.shape
    padded = torch.zeros(-(-N // 8) * 8, K, dtype=torch.float32)
    padded[:N] = weight
    return padded.view(-1, 8, K).transpose(1, 2).contiguous()


def pack_gate_up(weight: torch.Tensor, intermediate: int) -> torch.Tensor:
    """Fused [gate; up] -> panels alternating 8 gate rows and the matching 8 up rows."""
    gate, up = weight[:intermediate], weight[intermediate:]
    paired = torch.stack((gate.view(-1, 8, gate.shape[1]), up.view(-1, 8, up.shape[1])), dim=1)
    return pack_panels(paired.reshape(weight.shape))


class Arena:
    """One buffer for all packed weights, backed by transparent huge pages where the kernel
    allows (madvise): the hardware prefetchers stop at every 4 KiB page boundary, and a
    decode step streams every weight once. All tensors of one dtype."""

    def __init__(self, tensors: list[torch.Tensor], dtype: torch.dtype = torch.float32):
        align = 64 // dtype.itemsize
        sizes = [-(-t.numel() // align) * align for t in tensors]  # 64-byte aligned slices
        self.buffer = huge_page_zeros(max(1, sum(sizes)), dtype)
        self.views, offset = [], 0
        for t, size in zip(tensors, sizes):
            view = self.buffer[offset : offset + t.numel()].view(t.shape)
            view.copy_(t)
            self.views.append(view)
            offset += size


def _ptr(t: torch.Tensor | None):
    return ctypes.cast(t.data_ptr(), F32P) if t is not None and t.numel() else None


def _i64(t: torch.Tensor):
    return ctypes.cast(t.data_ptr(), P(I64))


def sample_top_p(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor,
                 num_threads: int | None = None) -> torch.Tensor:
    """[S] tokens from logits [S, V] float32: argmax where temperature is 0, else a draw of
    softmax(logits / temperature) within each row's top-p nucleus (top_p 1: all), u [S] float64
    in (0, 1] each row's uniform; exactly the distribution that sorting and cumsum give
    (layers/sampler.py), in a few passes over each row (cpu_llama.c, sample_row)."""
    lib = load_library()
    logits = logits.float().contiguous()
    S, V = logits.shape
    temperature, top_p = temperature.float().contiguous(), top_p.float().contiguous()
    u = u.double().contiguous()
    tokens = torch.empty(S, dtype=torch.int64)
    if lib.shoal_sample_top_p(_ptr(logits), S, V, _ptr(temperature), _ptr(top_p), ctypes.cast(u.data_ptr(), P(ctypes.c_double)),
                              _i64(tokens), num_threads or torch.get_num_threads()):
        raise MemoryError("sample_top_p: out of memory for its scratch")
    return tokens


def quantized_matmul(qtype: int, rows: torch.Tensor, x: torch.Tensor, scalar: bool = False) -> torch.Tensor:
    """x [B, K] float32 times the quantized rows [N, bytes a row] of GGUF type `qtype`, transposed:
    [B, N], by the decode step's kernels (batches up to 4 in 8-bit integer dot products; `scalar`:
    the K-quants' portable loop instead of their AVX2 kernels)."""
    lib = load_library()
    rows, x = rows.contiguous(), x.float().contiguous()
    y = torch.empty(x.shape[0], rows.shape[0], dtype=torch.float32)
    weights, nbytes = QUANT_TYPES[qtype]
    K = rows.shape[1] // nbytes * weights
    if lib.shoal_quantized_matmul(qtype, ctypes.cast(rows.data_ptr(), U8P), rows.shape[0], K, _ptr(x), x.shape[0], _ptr(y),
                                  int(scalar)):
        raise ValueError("shoal_quantized_matmul: bad arguments")
    return y


def quantized_matrices(blocks: dict, model) -> list[tuple[int, torch.Tensor] | None]:
    """Per layer qkv, o, gate_up, down, then the LM head: (GGUF type, uint8 rows [N, row bytes])
    in the row order of the C step's panels, from `blocks` ({HF weight name: (type, rows)},
    gguf_convert.quantized_weights), or None where a matrix stays float (a type the C step does
    not read, parts of mixed types, a name missing)."""
    def get(*names):
        parts = [blocks.get(n) for n in names]
        if any(p is None for p in parts) or len({p[0] for p in parts}) != 1 or parts[0][0] not in QUANT_TYPES:
            return None
        return parts[0][0], torch.from_numpy(np.concatenate([p[1] for p in parts]))  # a writable copy

    out = []
    for i in range(len(model.layers)):
        pre = f"model.layers.{i}."
        gate_up = get(pre + "mlp.gate_proj.weight", pre + "mlp.up_proj.weight")
        if gate_up is not None:  # 8 gate rows, their 8 up rows, ... as pack_gate_up
            rows = gate_up[1]
            half = rows.shape[0] // 2
            gate_up = gate_up[0], torch.stack((rows[:half].view(-1, 8, rows.shape[1]), rows[half:].view(-1, 8, rows.shape[1])),
                                              dim=1).reshape(rows.shape)
        out += [get(*(pre + f"self_attn.{n}_proj.weight" for n in "qkv")), get(pre + "self_attn.o_proj.weight"),
                gate_up, get(pre + "mlp.down_proj.weight")]
    out.append(get("lm_head.weight") or get("model.embed_tokens.weight") if model.cfg.tie_word_embeddings
               else get("lm_head.weight"))
    return out


def unsupported_reason(model) -> str | None:
    """Why the C decoder cannot run this model, or None."""
    cfg, state = model.cfg, model.state
    if state.tp_size != 1 or state.pp_size != 1:
        return "it runs single-process models only"
    if model.norm.weight.dtype != torch.float32 or model.norm.weight.device.type != "cpu":
        return "it runs float32 on the CPU only"
    if model.cos_sin.shape[-1] != model.head_dim:
        return "partial rotary embeddings are not supported"
    if any(n % 8 for n in (cfg.hidden_size, cfg.intermediate_size, model.head_dim)):
        return "hidden, intermediate and head sizes must be multiples of 8"
    if getattr(cfg, "mlp_bias", False):
        return "MLP biases are not supported"
    if not model.spec.c_step:
        return f"{cfg.model_type}'s decoder differs from Llama's (and Qwen3's) shape, or routes its experts otherwise"
    moe = [layer.mlp for layer in model.layers if _is_moe(layer)]
    if moe and (moe[0].topk_softmax or moe[0].grouped is not None
                or (moe[0].shared_expert is not None and moe[0].shared_expert_gate is None)):
        return "it routes experts by a softmax over all of them and top-k only, a shared expert only gated"
    if moe and (moe[0].experts.local % 8 or moe[0].shared_expert is not None
                and moe[0].shared_expert.down_proj.weight.shape[1] % 8):
        return "the experts' intermediate sizes must be multiples of 8"
    return cpu_supported()


def _is_moe(layer) -> bool:
    from shoal.runtime.layers.moe import SparseMoeBlock

    return isinstance(layer.mlp, SparseMoeBlock)


def pack_experts(moe) -> list[torch.Tensor]:
    """A MoE block's router as panels, each expert's gate_up and down panels (expert after expert),
    then its shared expert's gate_up and down panels and gate vector (empty where it has none)."""
    w13, w2, Im = moe.experts.w13.data.float(), moe.experts.w2.data.float(), moe.experts.local
    out = [pack_panels(moe.gate.data.float()), torch.stack([pack_gate_up(w, Im) for w in w13]),
           torch.stack([pack_panels(w) for w in w2])]
    s = moe.shared_expert
    if s is None:
        return out + [torch.empty(0)] * 3
    down = s.down_proj.weight.data.float()
    return out + [pack_gate_up(s.gate_up_proj.weight.data.float(), down.shape[1]), pack_panels(down),
                  moe.shared_expert_gate.data.float().reshape(-1)]


class CpuDecoder:
    """One model's decoder: its packed weights and the C handle (steps run on the caller's
    OpenMP team, torch's own)."""

    def __init__(self, model, num_threads: int, quantized: dict | None = None, float_panels: bool = True):
        self.lib = load_library()
        self.max_batch = int(self.lib.shoal_max_batch())
        cfg = model.cfg
        self.vocab = cfg.vocab_size
        layers = model.layers
        self._keep = []  # every tensor and pointer array the C side points into
        hold, table = self._hold, self._table

        def plain(module):  # the layer's weight before oneDNN packing dropped it
            return module.weight.data.float()

        I = cfg.intermediate_size
        attn = [layer.self_attn for layer in layers]
        quant = quantized_matrices(quantized, model) if quantized else [None] * (4 * len(layers) + 1)
        self.quantized_types = [q[0] if q else 0 for q in quant]
        packed = []  # in the order a step reads them; an empty panel where the blocks are read instead
        none = lambda: torch.empty(0)  # noqa: E731  (a MoE layer's dense MLP)
        for i, (a, l) in enumerate(zip(attn, layers)):
            moe = _is_moe(l)
            makers = [lambda: pack_panels(plain(a.qkv_proj)), lambda: pack_panels(plain(a.o_proj)),
                      none if moe else lambda: pack_gate_up(plain(l.mlp.gate_up_proj), I),
                      none if moe else lambda: pack_panels(plain(l.mlp.down_proj))]
            packed += [torch.empty(0) if quant[4 * i + j] and not float_panels else make() for j, make in enumerate(makers)]
        packed.append(torch.empty(0) if quant[-1] and not float_panels
                      else pack_panels(model.lm_head.weight.data[: cfg.vocab_size].float()))
        self.arena = Arena(packed)
        self.block_arena = Arena([q[1] if q else torch.empty(0, dtype=torch.uint8) for q in quant], torch.uint8)
        del packed
        panels, blocks = self.arena.views, self.block_arena.views
        u8 = lambda t: ctypes.cast(t.data_ptr(), U8P) if t.numel() else None  # noqa: E731
        types = self._hold(torch.tensor(self.quantized_types, dtype=torch.int64))
        embed = hold(model.embed_tokens.weight.data[: cfg.vocab_size].contiguous())
        cos_sin = hold(model.cos_sin.float().contiguous())
        self._model = _Model(
            num_layers=len(layers), hidden=cfg.hidden_size, num_heads=attn[0].qkv_proj.local_heads,
            num_kv_heads=attn[0].qkv_proj.local_kv_heads, head_dim=model.head_dim, intermediate=I,
            vocab=cfg.vocab_size, max_positions=cos_sin.shape[0], eps=layers[0].input_layernorm.eps, scale=attn[0].scale,
            embed=_ptr(embed), final_norm=_ptr(hold(model.norm.weight.data.float().contiguous())),
            lm_head=_ptr(panels[-1]), cos_sin=_ptr(cos_sin),
            input_norm=table([hold(l.input_layernorm.weight.data.float().contiguous()) for l in layers]),
            post_norm=table([hold(l.post_attention_layernorm.weight.data.float().contiguous()) for l in layers]),
            qkv=table(panels[0:-1:4]),
            qkv_bias=table([hold(a.qkv_proj.bias.data.float().contiguous()) if a.qkv_proj.bias is not None else None for a in attn]),
            o=table(panels[1:-1:4]),
            gate_up=table(panels[2:-1:4]),
            down=table(panels[3:-1:4]),
            qkv_q=self._bytes_table([u8(t) for t in blocks[0:-1:4]]), o_q=self._bytes_table([u8(t) for t in blocks[1:-1:4]]),
            gate_up_q=self._bytes_table([u8(t) for t in blocks[2:-1:4]]),
            down_q=self._bytes_table([u8(t) for t in blocks[3:-1:4]]),
            lm_head_q=u8(blocks[-1]), types=_i64(types),
        )
        moe = [l.mlp for l in layers if _is_moe(l)]
        if moe:  # each MoE layer's router and experts in their own arena; dense layers' entries NULL
            self.moe_arena = Arena([t for block in moe for t in pack_experts(block)])
            views, at = iter(self.moe_arena.views), {}
            for i, l in enumerate(layers):
                if _is_moe(l):
                    at[i] = [next(views) for _ in range(6)]
            self._model.num_experts, self._model.top_k = moe[0].experts.num_experts, moe[0].top_k
            self._model.moe_intermediate, self._model.norm_topk_prob = moe[0].experts.local, int(moe[0].renormalize)
            names = ["router", "expert_gate_up", "expert_down"]
            if moe[0].shared_expert is not None:  # Qwen2-MoE
                self._model.shared_intermediate = moe[0].shared_expert.down_proj.weight.shape[1]
                names += ["shared_gate_up", "shared_down", "shared_gate"]
            for j, name in enumerate(names):
                setattr(self._model, name, table([at[i][j] if i in at else None for i in range(len(layers))]))
        if attn[0].qk_norm == "head":  # Qwen3: each head's RMSNorm before RoPE (with the model's eps)
            self._model.q_norm = table([hold(a.q_norm.weight.data.float().contiguous()) for a in attn])
            self._model.k_norm = table([hold(a.k_norm.weight.data.float().contiguous()) for a in attn])
        self.num_threads = num_threads
        self.handle = None

    def _hold(self, t: torch.Tensor) -> torch.Tensor:
        self._keep.append(t)
        return t

    def _table(self, tensors):
        """A C array of pointers to the tensors (None: NULL), kept alive with the decoder."""
        arr = self._hold((F32P * len(tensors))(*[_ptr(t) for t in tensors]))
        return ctypes.cast(arr, P(F32P))

    def _bytes_table(self, pointers):
        arr = self._hold((U8P * len(pointers))(*pointers))
        return ctypes.cast(arr, P(U8P))

    def attach(self, kv_caches) -> None:
        """Point the decoder at the KV cache (per layer, [2, num_blocks, block_size, kvh, d] views
        of tensors stored [2, kvh, num_blocks, block_size, d])."""
        for cache in kv_caches:  # the C side indexes the storage directly
            if cache.dtype != torch.float32 or not cache.permute(0, 3, 1, 2, 4).is_contiguous():
                raise ValueError("the C decoder needs a float32 KV cache stored [2, kvh, num_blocks, block_size, d]")
        self.close()
        self._model.num_blocks, self._model.block_size = kv_caches[0].shape[1], kv_caches[0].shape[2]
        self._model.kv = self._table(list(kv_caches))
        self.kv_caches = kv_caches
        self.handle = self.lib.shoal_decoder_new(ctypes.byref(self._model), self.num_threads)
        if not self.handle:
            raise RuntimeError(f"cpu decoder: bad thread count {self.num_threads}")

    @classmethod
    def create(cls, model, num_threads: int | None = None, quantized: dict | None = None,
               float_panels: bool = True) -> "CpuDecoder | None":
        """The decoder for this model (whose linear weights are still plain), or None (logged)
        where it cannot run. `quantized`: GGUF blocks that small batches read instead of float
        weights ({HF weight name: (type, rows)}, gguf_convert.quantized_weights); larger
        batches run on float panels (`float_panels`) or on panels dequantized as they go."""
        reason = unsupported_reason(model)
        if reason is None:
            try:
                return cls(model, num_threads or torch.get_num_threads(), quantized, float_panels)
            except (RuntimeError, OSError) as e:
                reason = str(e)
        log.info("C decode step not used: %s", reason)
        return None

    def step(self, input_ids, positions, slots, block_tables, context_lens) -> torch.Tensor:
        """One decode token for each of B sequences (after attach): int64 tensors [B] (block_tables [B, nb]) ->
        logits [B, vocab]. Writes the new keys and values into the KV cache."""
        B = input_ids.shape[0]
        if not 1 <= B <= self.max_batch:
            raise ValueError(f"cpu decoder runs 1..{self.max_batch} sequences, got {B}")
        args = [t.contiguous().to(torch.int64) for t in (input_ids, positions, slots, block_tables, context_lens)]
        if int(args[1].max()) >= self._model.max_positions:  # the C side reads RoPE rows unchecked
            raise ValueError(f"position {int(args[1].max())} is past the model's {self._model.max_positions}")
        logits = torch.empty(B, self.vocab, dtype=torch.float32)
        i64 = [_i64(t) for t in args]
        step = _Step(B, i64[0], i64[1], i64[2], i64[3], args[3].shape[1], i64[4], _ptr(logits))
        self.lib.shoal_decoder_step(self.handle, ctypes.byref(step))
        return logits

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """ops.silu_and_mul (kernels/reference.py) in one C pass for contiguous float32 CPU rows."""
        if x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous() or x.shape[-1] % 2:
            return reference.silu_and_mul(x)
        half = x.shape[-1] // 2
        out = torch.empty(*x.shape[:-1], half, dtype=torch.float32)
        self.lib.shoal_silu_and_mul(_ptr(x), _ptr(out), x.numel() // x.shape[-1], half, self.num_threads)
        return out

    def paged_attention_prefill(self, q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale: float):
        """ops.paged_attention_prefill (kernels/reference.py) in C, reading the paged cache in
        place: float32 on the CPU, each head's d values contiguous; else the reference."""
        T, h, d = q.shape
        kvh = k_cache.shape[2]
        ok = (q.dtype == k_cache.dtype == v_cache.dtype == torch.float32 and q.device.type == "cpu"
              and q.stride(2) == 1 and q.stride(1) == d and k_cache.stride() == v_cache.stride()
              and k_cache.stride(1) == d and k_cache.stride(3) == 1 and h % kvh == 0)
        if not ok:
            return reference.paged_attention_prefill(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale)
        meta = [t.contiguous().to(torch.int64) for t in (block_tables, query_start_loc, context_lens)]
        out = torch.empty(T, h, d, dtype=torch.float32)
        args = _Prefill(
            q=_ptr(q), q_stride=q.stride(0), k_cache=_ptr(k_cache), v_cache=_ptr(v_cache), block_stride=k_cache.stride(0),
            head_stride=k_cache.stride(2), block_size=k_cache.shape[1], block_tables=_i64(meta[0]),
            max_blocks=meta[0].shape[1], query_start_loc=_i64(meta[1]), context_lens=_i64(meta[2]),
            batch=meta[2].shape[0], heads=h, kv_heads=kvh,
            head_dim=d, scale=scale, out=_ptr(out))
        if self.lib.shoal_prefill_attention(ctypes.byref(args), self.num_threads):
            raise MemoryError("cpu prefill attention: out of memory for its scratch")
        return out

    def close(self) -> None:
        if self.handle:
            self.lib.shoal_decoder_free(self.handle)
            self.handle = None

    def __del__(self):
        self.close()

"""Plain-torch references of every kernel: readable, batched, and what CPU inference runs.

Shapes (T new tokens in a step, B sequences, h query heads, kvh KV heads, d head size):
  k_cache, v_cache   [num_blocks, block_size, kvh, d]   one pair per layer; any strides with
                     (num_blocks, block_size) mergeable. The engine stores them physically as
                     [kvh, num_blocks, block_size, d] (a permuted view), so that gathering a
                     batch's blocks yields each KV head's keys contiguous, ready for bmm.
  block_tables       [B, max_blocks] int64, padded with any valid block id (masked by lengths)
  context_lens       [B] int64: tokens in the cache for each sequence, new ones included
  slot_mapping       [T] int64: block_id * block_size + offset of each new token
  window             0, or a sliding window: a query at position p sees keys p - window < k <= p
  softcap            0, or Gemma 2's cap on attention scores: s -> softcap * tanh(s / softcap)
  sinks              None, or [h] float: gpt-oss's attention sinks, a learned logit per query head
                     that joins each softmax's denominator (its own probability is dropped)
  k_scale, v_scale   a float8 e4m3 cache (--kv-cache-dtype fp8) holds key / k_scale and
                     value / v_scale (saturated at +-448); the kernels read them back times
                     the scale. A cache in the model's dtype ignores them.
The Triton kernels in this package take the same arguments and return the same values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shoal.kernels.quant_reference import int4_dequantize_experts, quantize_fp8


FP8 = torch.float8_e4m3fn


def to_cache(x, cache, scale: float):
    """x in the cache's dtype: a float8 cache stores x / scale, saturated."""
    if cache.dtype != FP8:
        return x.to(cache.dtype)
    return (x.float() / scale).clamp_(-448.0, 448.0).to(FP8)


def write_kv_cache(key, value, k_cache, v_cache, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Store new keys/values [T, kvh, d] into their cache slots, in place."""
    kvh, d = key.shape[-2:]
    for x, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        x = to_cache(x, cache, scale)
        if cache.dtype == FP8:  # index_copy_ has no float8 kernel on CPU: copy the bytes
            cache, x = cache.view(torch.uint8), x.view(torch.uint8)
        cache.view(-1, kvh, d).index_copy_(0, slot_mapping, x)


def _gather(cache, block_tables, dtype=None, scale: float = 1.0):
    """[num_blocks, bs, kvh, d] by [B, nb] -> [kvh, B, nb*bs, d], contiguous (a float8 cache
    read back in `dtype`, times its scale)."""
    B, nb = block_tables.shape
    _, bs, kvh, d = cache.shape
    out = cache.permute(2, 0, 1, 3).index_select(1, block_tables.reshape(-1)).view(kvh, B, nb * bs, d)
    if cache.dtype == FP8:
        out = out.to(dtype).mul_(scale)
    return out


def _softcap(scores, softcap: float):
    return scores.div_(softcap).tanh_().mul_(softcap) if softcap else scores


def _softmax(scores, sinks=None):
    """Softmax over the last dim; with `sinks` (broadcastable to scores[..., :1]), each row's sink
    logit joins the denominator and its probability is dropped (gpt-oss)."""
    if sinks is None:
        return scores.softmax(-1)
    sink = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    return torch.cat((scores, sink), -1).softmax(-1)[..., :-1]


def paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale: float, window: int = 0,
                           softcap: float = 0.0, k_scale: float = 1.0, v_scale: float = 1.0, sinks=None):
    """One query token per sequence: q [B, h, d] -> [B, h, d]."""
    B, h, d = q.shape
    kvh = k_cache.shape[2]
    g = h // kvh  # grouped-query: g query heads share one KV head
    k = _gather(k_cache, block_tables, q.dtype, k_scale).view(kvh * B, -1, d)
    v = _gather(v_cache, block_tables, q.dtype, v_scale).view(kvh * B, -1, d)
    L = k.shape[1]
    qh = q.view(B, kvh, g, d).transpose(0, 1).reshape(kvh * B, g, d)
    scores = _softcap(torch.bmm(qh, k.transpose(1, 2)).mul_(scale), softcap)  # [kvh*B, g, L]
    steps = torch.arange(L, device=q.device)[None, :]
    pad = steps >= context_lens[:, None]
    if window:
        pad |= steps <= (context_lens - 1 - window)[:, None]
    scores.view(kvh, B, g, L).masked_fill_(pad[None, :, None, :], float("-inf"))
    if sinks is not None:  # head kv * g + j sits at row (kv, b, j)
        sinks = sinks.view(kvh, 1, g, 1).expand(kvh, B, g, 1).reshape(kvh * B, g, 1)
    out = torch.bmm(_softmax(scores, sinks), v)  # [kvh*B, g, d]
    return out.view(kvh, B, g, d).transpose(0, 1).reshape(B, h, d)


def paged_attention_prefill(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale: float,
                            window: int = 0, softcap: float = 0.0, k_scale: float = 1.0, v_scale: float = 1.0,
                            sinks=None):
    """A ragged batch of new tokens, causal over each sequence's cached prefix + new tokens.

    q [Tq, h, d] holds sequence b's tokens at rows query_start_loc[b]:query_start_loc[b+1];
    they sit at the last positions of its context_lens[b] tokens. Returns [Tq, h, d].
    """
    kv_scales = (k_scale, v_scale)
    if window or softcap or sinks is not None:  # what SDPA's causal kernel cannot express: explicit masks
        return _prefill_masked(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, window, softcap,
                               kv_scales, sinks)
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    # Placing each query at its absolute position lets SDPA's causal kernel skip the upper
    # triangle (half the work of a first chunk), but computes a row for every cached
    # position too: worth it unless the new tokens are a short suffix of a long prefix.
    if 2 * int(q_lens.max()) >= int(context_lens.max()):
        return _prefill_causal(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, kv_scales)
    return _prefill_masked(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, kv_scales=kv_scales)


def length_buckets(lengths: list[int], max_buckets: int = 3) -> list[list[int]]:
    """Group sequences (indices into `lengths`) into at most `max_buckets` runs of similar
    length, minimising the padded attention work sum(count * longest^2): a few batched
    calls instead of one padded to the longest sequence (or a loop over sequences)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    n = len(order)
    cuts = sorted({round(i * n / 16) for i in range(17)})  # candidate run edges: bounded work
    m = len(cuts) - 1
    # best[k][j]: cheapest split of the sequences before cuts[j] into k runs
    best = [[0.0] + [float("inf")] * m] + [[float("inf")] * (m + 1) for _ in range(max_buckets)]
    back = [[0] * (m + 1) for _ in range(max_buckets + 1)]
    for k in range(1, max_buckets + 1):
        for j in range(1, m + 1):
            for i in range(j):
                c = best[k - 1][i] + (cuts[j] - cuts[i]) * lengths[order[cuts[i]]] ** 2
                if c < best[k][j]:
                    best[k][j], back[k][j] = c, i
    k = min(range(1, max_buckets + 1), key=lambda k: best[k][m])
    runs, j = [], m
    while j > 0:
        i = back[k][j]
        runs.append(order[cuts[i] : cuts[j]])
        j, k = i, k - 1
    return runs[::-1]


def _prefill_causal(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale: float, kv_scales=(1.0, 1.0)):
    """Row p of a sequence's padded queries is its token at position p (dummies before its new
    tokens), so the plain causal mask of SDPA is the right one for every sequence. Sequences
    run in a few length buckets so that short ones do not pay for the longest."""
    Tq = q.shape[0]
    out = torch.empty_like(q)
    bs = k_cache.shape[1]
    for bucket in length_buckets(context_lens.tolist()):
        idx = torch.tensor(bucket, device=q.device)
        starts, ctx = query_start_loc[idx], context_lens[idx]
        q_lens = query_start_loc[idx + 1] - starts
        L = int(ctx.max())
        steps = torch.arange(L, device=q.device)
        first = ctx - q_lens  # position of each sequence's first new token
        rows = (starts[:, None] + steps - first[:, None]).clamp_(0, max(Tq - 1, 0))  # [n, L]
        valid = (steps >= first[:, None]) & (steps < ctx[:, None])
        tables = block_tables[idx, : -(-L // bs)]
        k = _gather(k_cache, tables, q.dtype, kv_scales[0]).transpose(0, 1)[:, :, :L]  # [n, kvh, L, d]
        v = _gather(v_cache, tables, q.dtype, kv_scales[1]).transpose(0, 1)[:, :, :L]
        o = F.scaled_dot_product_attention(q[rows].transpose(1, 2), k, v, is_causal=True, scale=scale, enable_gqa=True)
        out[rows[valid]] = o.transpose(1, 2)[valid]
    return out


def _prefill_masked(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale: float,
                    window: int = 0, softcap: float = 0.0, kv_scales=(1.0, 1.0), sinks=None):
    """Only the new tokens as queries, with an explicit mask of what each one sees."""
    Tq, h, d = q.shape
    dev = q.device
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    max_q = int(q_lens.max())
    steps = torch.arange(max_q, device=dev)
    rows = (query_start_loc[:-1, None] + steps).clamp_(max=Tq - 1)  # [B, max_q]
    valid = steps[None, :] < q_lens[:, None]
    k = _gather(k_cache, block_tables, q.dtype, kv_scales[0]).transpose(0, 1)  # [B, kvh, L, d]
    v = _gather(v_cache, block_tables, q.dtype, kv_scales[1]).transpose(0, 1)
    L = k.shape[2]
    pos = (context_lens - q_lens)[:, None] + steps  # absolute position of each query
    keys = torch.arange(L, device=dev)[None, None, :]
    visible = keys <= pos[:, :, None]  # [B, max_q, L]
    if window:
        visible &= keys > pos[:, :, None] - window
    if softcap or sinks is not None:  # scores by hand: SDPA has no cap and no sink
        kvh = k.shape[1]
        qg = q[rows].view(len(rows), max_q, kvh, h // kvh, d).permute(0, 2, 3, 1, 4)  # [B, kvh, g, max_q, d]
        scores = _softcap(torch.matmul(qg, k[:, :, None].transpose(-1, -2)).mul_(scale), softcap)
        scores.masked_fill_(~visible[:, None, None], float("-inf"))
        sink = None if sinks is None else sinks.view(1, kvh, h // kvh, 1, 1)
        out = torch.matmul(_softmax(scores, sink), v[:, :, None]).reshape(len(rows), h, max_q, d)
    else:
        out = F.scaled_dot_product_attention(
            q[rows].transpose(1, 2), k, v, attn_mask=visible[:, None], scale=scale, enable_gqa=True
        )  # [B, h, max_q, d]
    return out.transpose(1, 2)[valid]


def rms_norm(x, weight, eps: float, residual=None):
    """RMSNorm; with `residual`, first adds it (fused residual add) and returns (out, x + residual)."""
    if residual is not None:
        x = x + residual
        residual = x
    out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
    return out if residual is None else (out, residual)


def rotary_embedding(positions, q, k, cos_sin_cache, is_neox: bool = True):
    """Rotate q [T, h, d] and k [T, kvh, d] by their positions; returns new (q, k).

    cos_sin_cache [max_pos, d] holds cos in its first half and sin in its second (scaling,
    e.g. llama3 or YaRN, is already folded into the cache). neox rotates the two halves of
    each head; GPT-J rotates interleaved pairs. The results keep q's and k's dtypes (a float32
    cache with a half-precision model computes in float32, then rounds once).
    """
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, d/2] each

    def rotate(x):
        if is_neox:
            x1, x2 = x.chunk(2, dim=-1)
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2).to(x.dtype)

    return rotate(q), rotate(k)


def silu_and_mul(x):
    """SwiGLU activation of a fused gate/up projection: x [T, 2I] -> silu(gate) * up [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x):
    """GeGLU (Gemma's MLP): x [T, 2I] -> gelu_tanh(gate) * up [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def swiglu_oai_and_mul(x, alpha: float = 1.702, limit: float = 7.0):
    """gpt-oss's clamped SwiGLU: x [T, 2I] (gate, then up) -> (up + 1) * gate * sigmoid(alpha * gate)
    [T, I], the gate clamped to at most `limit` and up to [-limit, limit] first."""
    gate, up = x.chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


def _gated(x, activation: str, alpha: float, limit: float):
    if activation == "silu":
        return silu_and_mul(x)
    if activation == "swiglu_oai":
        return swiglu_oai_and_mul(x, alpha, limit)
    raise ValueError(f"unknown expert activation {activation!r}")


def fused_moe(x, w13, w2, topk_weights, topk_ids, w13_bias=None, w2_bias=None, activation: str = "silu",
              alpha: float = 1.702, limit: float = 7.0, w13_scale=None, w2_scale=None, a13_scale=None, a2_scale=None,
              w13_int4=None, w2_int4=None):
    """Gated experts, each token through its top-k: x [T, H] -> sum_j w_j * expert_{id_j}(x) [T, H].

    w13 [E, 2I, H] holds each expert's gate rows then its up rows, w2 [E, H, I] its down
    projection; topk_weights [T, k] (float32), topk_ids [T, k] int. An id outside [0, E) names
    an expert this rank does not hold (expert parallelism): that pair adds nothing. The T*k
    (token, expert) pairs are sorted by expert and each projection is one grouped GEMM over the
    experts' segments, not a loop over experts. The result keeps x's dtype; the weighted sum
    over k is taken in float32. gpt-oss: w13_bias [E, 2I] and w2_bias [E, H] join each
    expert's projections (the weight multiplies the down projection with its bias), and
    activation "swiglu_oai" is its clamped SwiGLU (swiglu_oai_and_mul, alpha and limit);
    "silu" is SwiGLU.

    FP8 W8A8 experts (w13_scale given): w13 and w2 float8 e4m3 with a scale per output row,
    w13_scale [E, 2I] and w2_scale [E, H] float32; each GEMM's input is rounded to float8 as
    the dense fp8 layers do (quant_reference.quantize_fp8: per row, or by the static a13_scale /
    a2_scale), the product taken in float32 and scaled by both.

    Int4 experts (w13_int4 / w2_int4 given: (scales, zeros, g_idx) of quant_reference's layout
    stacked over the experts, w13 [E, H/8, 2I] and w2 [E, I/8, H] the packed int32): the
    experts are dequantized into x's dtype, then the float grouped GEMMs. On the CPU only the
    experts the step's tokens chose are (a decode step of a few tokens picks a few of E); on a
    GPU all of them, since a data-dependent count would break a CUDA graph.
    """
    if w13_int4 is not None:
        if x.device.type == "cpu":
            w13, w13_int4, w2, w2_int4, topk_ids = _experts_in_use(topk_ids, w13, w13_int4, w2, w2_int4)
        w13 = int4_dequantize_experts(w13, *w13_int4).to(x.dtype)
        w2 = int4_dequantize_experts(w2, *w2_int4).to(x.dtype)
    T, k = topk_ids.shape
    E = w13.shape[0]
    flat = topk_ids.reshape(-1).long()
    here = (flat >= 0) & (flat < E)
    flat = torch.where(here, flat, E)  # pairs for other ranks sort last, past every segment
    order = flat.argsort(stable=True)  # pair indices, expert by expert
    token = order // k
    expert = flat[order].clamp(max=E - 1)  # each sorted row's expert (rows of other ranks: any, dropped below)
    # bincount reads its input's max on the host (a sync, no CUDA graph); a scatter does not
    counts = torch.zeros(E + 1, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))[:E]
    if w13_scale is None:
        gate_up = _grouped_linear(x[token], w13, counts)  # [T*k, 2I]
    else:
        gate_up = _fp8_grouped_linear(x, token, w13, w13_scale, a13_scale, counts, expert)
    if w13_bias is not None:
        gate_up = gate_up + w13_bias[expert]
    h = _gated(gate_up, activation, alpha, limit)  # [T*k, I]
    if w2_scale is None:
        down = _grouped_linear(h, w2, counts)
    else:
        down = _fp8_grouped_linear(h, None, w2, w2_scale, a2_scale, counts, expert)
    if w2_bias is not None:
        down = down + w2_bias[expert]
    y = down.float() * topk_weights.reshape(-1)[order, None].float()
    y = torch.where(here[order, None], y, 0.0)  # rows past the segments were never computed
    return torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device).index_add_(0, token, y).to(x.dtype)


def _experts_in_use(topk_ids, w13, w13_meta, w2, w2_meta):
    """Only the experts topk_ids names (ids outside [0, E) stay outside, as other ranks' pairs):
    the int4 tensors and their (scales, zeros, g_idx) cut to them, the ids renumbered in order."""
    E = w13.shape[0]
    here = (topk_ids >= 0) & (topk_ids < E)
    chosen = torch.zeros(E, dtype=torch.bool).index_fill_(0, topk_ids[here].long(), True)
    chosen[0] |= not chosen.any()  # no pair here: keep one expert, so that every shape stays non-empty
    used = chosen.nonzero().squeeze(1)
    renumber = torch.full((E,), -1, dtype=topk_ids.dtype)
    renumber[used] = torch.arange(len(used), dtype=topk_ids.dtype)
    ids = torch.where(here, renumber[topk_ids.long().clamp(0, E - 1)], -1)
    cut = lambda t, meta: (t[used], tuple(m[used] for m in meta))  # noqa: E731
    return (*cut(w13, w13_meta), *cut(w2, w2_meta), ids)


def _fp8_grouped_linear(x, index, w, w_scale, a_scale, counts, expert):
    """W8A8 grouped GEMM: x (its rows `index`, or all) rounded to float8 as quant_reference's
    dense fp8 GEMM does, times w [E, N, K] float8, scaled per row and per output channel;
    returns x's dtype, like the dense layers."""
    a, s = quantize_fp8(x, a_scale)  # per token before gathering: each token rounds once, whichever expert
    if index is not None:
        a, s = a[index], s[index]
    out = _grouped_linear(a.float(), w.float(), counts) * s * w_scale.float()[expert]
    return out.to(x.dtype)


def _grouped_linear(rows, w, counts):
    """rows [N, K] sorted by expert (counts[e] rows for expert e, then rows of no expert here),
    w [E, Nout, K] -> [N, Nout]; rows past sum(counts) are left undefined."""
    if _grouped_mm_fits(rows, w):
        offs = counts.cumsum(0).to(torch.int32)
        return torch._grouped_mm(rows, w.transpose(1, 2), offs=offs)
    # Fallback: every expert's segment padded to the longest one, then one bmm.
    N = rows.shape[0]
    out = rows.new_zeros(N, w.shape[1])
    if N == 0 or int(counts.sum()) == 0:
        return out
    starts = counts.cumsum(0) - counts
    steps = torch.arange(int(counts.max()), device=rows.device)
    valid = steps[None, :] < counts[:, None]  # [E, longest]
    padded = rows[(starts[:, None] + steps).clamp_(max=N - 1)] * valid[..., None]
    out[: int(counts.sum())] = torch.bmm(padded, w.transpose(1, 2))[valid]
    return out


def _grouped_mm_fits(rows, w) -> bool:
    """torch._grouped_mm (a CPU kernel in torch >= 2.9) takes float32/16 and bf16 operands whose
    strides are multiples of 16 bytes; on CUDA it is left to the Triton kernel."""
    size = rows.element_size()
    return (
        hasattr(torch, "_grouped_mm") and rows.device.type == "cpu" and rows.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and w.dtype == rows.dtype and w.is_contiguous() and rows.is_contiguous()
        and (rows.shape[1] * size) % 16 == 0 and (w.shape[1] * size) % 16 == 0
        and rows.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0
    )


def lora_delta(x, a, b, token_slot, groups, out):
    """Add each token's LoRA delta to `out` in place: the tokens grouped by adapter slot
    (Punica's SGMV, segment by segment), one shrink and one expand per slot in use.

    x [T, K]; a [S, C, K] each slot's shrink; b [S, N, C] each slot's expand (the adapter's
    scaling folded in); token_slot [T] long, -1: no adapter (the Triton kernel reads it);
    groups: [(slot, token indices [n] long, or None for every token)], the same mapping
    grouped on the host once per step. A loop over the slots of the step (at most
    --max-loras), never over requests; base tokens are not touched."""
    for slot, idx in groups:
        if idx is None:
            out.addmm_(x @ a[slot].T, b[slot].T)
        else:
            out.index_add_(0, idx, (x.index_select(0, idx) @ a[slot].T) @ b[slot].T)
    return out

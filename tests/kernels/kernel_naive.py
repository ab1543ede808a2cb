"""Independent float64 implementations, written for clarity (explicit slots, masks, loops).

They share nothing with shoal.kernels.reference; both the references and the Triton kernels
are checked against these.
"""

from __future__ import annotations

import math

import torch


def seq_kv(cache, block_table, length):
    """The first `length` tokens of one sequence, [length, kvh, d] in float64, slot by slot."""
    bs = cache.shape[1]
    t = torch.arange(length)
    return cache[block_table[t // bs], t % bs].double()  # token t lives in slot t % bs of block table[t // bs]


def dense_attention(q, k, v, mask, scale, softcap=0.0, sinks=None):
    """q [M, h, d], k/v [L, kvh, d], mask [M, L] (True = may attend) -> [M, h, d], float64.
    sinks [h]: each head's logit added to the softmax's denominator, exp(sink) / sum."""
    M, h, d = q.shape
    kvh = k.shape[1]
    g = h // kvh
    out = torch.empty(M, h, d, dtype=torch.float64)
    for head in range(h):
        kv = head // g  # query head `head` reads KV head head // g
        scores = (q[:, head].double() @ k[:, kv].T) * scale  # [M, L]
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~mask, -math.inf)
        if sinks is None:
            p = torch.softmax(scores, dim=-1)
        else:  # exp(s_i) / (sum_j exp(s_j) + exp(sink)), written out
            top = torch.maximum(scores.max(-1, keepdim=True).values, torch.tensor(float(sinks[head])))
            e = torch.exp(scores - top)
            p = e / (e.sum(-1, keepdim=True) + math.exp(float(sinks[head])) * torch.exp(-top))
        out[:, head] = p @ v[:, kv]
    return out


def decode(q, k_cache, v_cache, block_tables, context_lens, scale, window=0, softcap=0.0, sinks=None):
    out = []
    for b in range(q.shape[0]):
        L = int(context_lens[b])
        k = seq_kv(k_cache, block_tables[b], L)
        v = seq_kv(v_cache, block_tables[b], L)
        mask = torch.ones(1, L, dtype=torch.bool)
        if window:  # the query sits at L - 1 and sees the last `window` positions
            mask[0, : max(0, L - window)] = False
        out.append(dense_attention(q[b : b + 1], k, v, mask, scale, softcap, sinks)[0])
    return torch.stack(out)


def prefill(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, window=0, softcap=0.0, sinks=None):
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(len(context_lens)):
        s, e = int(query_start_loc[b]), int(query_start_loc[b + 1])
        if e == s:
            continue
        L, n = int(context_lens[b]), e - s
        k = seq_kv(k_cache, block_tables[b], L)
        v = seq_kv(v_cache, block_tables[b], L)
        mask = torch.zeros(n, L, dtype=torch.bool)
        for i in range(n):  # new token i sits at position L - n + i and sees positions 0..L - n + i
            p = L - n + i
            mask[i, (max(0, p - window + 1) if window else 0) : p + 1] = True
        out[s:e] = dense_attention(q[s:e], k, v, mask, scale, softcap, sinks)
    return out


def write_kv_cache(key, value, k_cache, v_cache, slot_mapping):
    bs = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_cache[slot // bs, slot % bs] = key[t]
        v_cache[slot // bs, slot % bs] = value[t]


def rms_norm(x, weight, eps, residual=None):
    x = x.double() if residual is None else x.double() + residual.double()
    out = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight.double()
    return out if residual is None else (out, x)


def rotary_embedding(positions, q, k, cos_sin_cache, is_neox=True):
    """Rotation of each pair as a complex multiply by cos + i sin, pairs picked by index."""
    d = q.shape[-1]
    half = d // 2

    def rotate(x):
        x = x.double()
        out = torch.empty_like(x)
        for t, p in enumerate(positions.tolist()):
            for i in range(half):
                a, b = (i, i + half) if is_neox else (2 * i, 2 * i + 1)
                c, s = float(cos_sin_cache[p, i]), float(cos_sin_cache[p, half + i])
                z = torch.complex(x[t, :, a], x[t, :, b]) * complex(c, s)
                out[t, :, a], out[t, :, b] = z.real, z.imag
        return out

    return rotate(q), rotate(k)


def gelu_tanh_and_mul(x):
    x = x.double()
    n = x.shape[-1] // 2
    gate, up = x[..., :n], x[..., n:]
    return 0.5 * gate * (1 + torch.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3))) * up


def silu_and_mul(x):
    x = x.double()
    n = x.shape[-1] // 2
    gate, up = x[..., :n], x[..., n:]
    return gate / (1 + torch.exp(-gate)) * up


def rope_cache(max_pos, d, base=10000.0, dtype=torch.float32):
    """A real cos/sin cache: cos in the first half, sin in the second."""
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).to(dtype)


def paged_kv(context_lens, block_size, kvh, d, dtype=torch.float32, spare_blocks=3, pad_cols=1):
    """A paged K/V cache holding `context_lens` tokens per sequence, for attention tests.

    Blocks are handed out in a random order (block tables not sorted, not contiguous); slots
    outside every context stay NaN, and the padding of each block-table row points at NaN
    blocks, so a kernel that reads anything it should mask fails. Returns
    (k_cache, v_cache, block_tables, context_lens).
    """
    need = [-(-int(n) // block_size) for n in context_lens]
    width = max(need) + pad_cols
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks)
    k_cache = torch.full((num_blocks, block_size, kvh, d), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    spare = perm[sum(need):]
    block_tables = spare[torch.randint(len(spare), (len(need), width))] if len(spare) else torch.zeros(len(need), width, dtype=torch.long)
    used = 0
    for b, (n, L) in enumerate(zip(need, context_lens)):
        block_tables[b, :n] = perm[used : used + n]
        used += n
        t = torch.arange(int(L))
        blk, off = block_tables[b, t // block_size], t % block_size
        k_cache[blk, off] = torch.randn(len(t), kvh, d).to(dtype)
        v_cache[blk, off] = torch.randn(len(t), kvh, d).to(dtype)
    return k_cache, v_cache, block_tables.long(), torch.tensor(context_lens, dtype=torch.long)


def finite(cache):
    """The cache as the torch reference needs it: its math multiplies masked slots by zero, so
    slots outside every context must hold finite values (stale data, as in a real engine)."""
    return cache.nan_to_num(nan=7.0)


TOL = {torch.float32: dict(atol=3e-5, rtol=1e-4), torch.float16: dict(atol=3e-3, rtol=3e-3),
       torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def swiglu_oai_and_mul(x, alpha=1.702, limit=7.0):
    x = x.double()
    n = x.shape[-1] // 2
    gate, up = x[..., :n].clamp(max=limit), x[..., n:].clamp(-limit, limit)
    return (up + 1) * gate / (1 + torch.exp(-alpha * gate))


def fused_moe(x, w13, w2, topk_weights, topk_ids, w13_bias=None, w2_bias=None, activation="silu", alpha=1.702, limit=7.0):
    """Token by token, expert by expert, in float64: sum_j weight_j * (down(act(gate_up(x) + b13)) + b2)."""
    T, k = topk_ids.shape
    I = w2.shape[2]
    out = torch.zeros(T, x.shape[1], dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            e = int(topk_ids[t, j])
            if not 0 <= e < w13.shape[0]:  # another rank's expert
                continue
            gate_up = w13[e].double() @ x[t].double()
            if w13_bias is not None:
                gate_up = gate_up + w13_bias[e].double()
            act = silu_and_mul if activation == "silu" else lambda v: swiglu_oai_and_mul(v, alpha, limit)
            h = act(gate_up[None])[0] if I else gate_up[:0]
            y = w2[e].double() @ h
            if w2_bias is not None:
                y = y + w2_bias[e].double()
            out[t] += float(topk_weights[t, j]) * y
    return out

"""Plain-torch references of the quantized GEMMs (what the CPU runs; the Triton kernels in
quant_gemm.py take the same arguments and return the same values).

FP8 (W8A8): weights float8 e4m3 [N, K] with a scale per output row (a per-tensor scale is
repeated), activations quantized per token (dynamic) or by one static scale; the product is
taken in float32 and scaled by both.

Int4 (AWQ, GPTQ, compressed-tensors W4A16), one layout for all three (the formats repack
into it at load): qweight [K / 8, N] int32, eight 4-bit values of consecutive input rows
in each element (row 8r + i in bits 4i..4i+3), scales and zero points [G, N] float, g_idx
[K] the group of each input row (act-order GPTQ: any order). W[k, n] = (q[k, n] - zero[g, n])
* scale[g, n] with g = g_idx[k]; out = x @ W.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8 [M, K], float32 scale [M, 1]): per token from each row's largest
    magnitude (scale None), else by the given static per-tensor scale."""
    xf = x.float()
    if scale is None:
        scale = (xf.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
    else:
        scale = scale.float().reshape(1, 1).expand(x.shape[0], 1)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_scaled_mm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """a float8 [M, K] with a_scale [M, 1], w float8 [N, K] with w_scale [N] -> [M, N] out_dtype."""
    out = (a.float() @ w.float().t()) * a_scale.float() * w_scale.float()[None, :]
    return out.to(out_dtype)


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """[R / 8, C] int32 -> [R, C] int32 in 0..15 (row 8r + i from bits 4i..4i+3 of row r)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    q = (packed[:, None, :] >> shifts[None, :, None]) & 0xF
    return q.reshape(-1, packed.shape[1])


def pack_int4_rows(q: torch.Tensor) -> torch.Tensor:
    """[R, C] values in 0..15 -> [R / 8, C] int32 (the inverse of unpack_int4_rows)."""
    q = q.to(torch.int64).reshape(-1, 8, q.shape[-1])
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=q.device)
    packed = (q << shifts[None, :, None]).sum(1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def int4_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """-> W [K, N] float32."""
    return _scale_groups(unpack_int4_rows(qweight), scales, zeros, g_idx)


def _scale_groups(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """q [..., K, N] in 0..15 -> (q - zero) * scale in float32, row k with group g_idx[..., k]'s
    zero and scale [..., G, N]. Where the rows are in group order (no act-order, the groups whole)
    each group's row pair broadcasts over its rows; else each row's is gathered (~2x the time).
    The order is checked on the CPU only: on a GPU the check would sync inside a CUDA graph."""
    K, G = q.shape[-2], scales.shape[-2]
    if q.device.type == "cpu" and K % G == 0 and torch.equal(g_idx.long(), (torch.arange(K, device=q.device) // (K // G)).expand_as(g_idx)):
        grouped = q.view(*q.shape[:-2], G, K // G, q.shape[-1]).float()
        return ((grouped - zeros.float().unsqueeze(-2)) * scales.float().unsqueeze(-2)).view(q.shape)
    g = g_idx.long()[..., None].expand(*g_idx.shape, q.shape[-1])
    return (q.float() - zeros.float().gather(-2, g)) * scales.float().gather(-2, g)


def int4_gemm(x: torch.Tensor, qweight, scales, zeros, g_idx) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype, computed in float32."""
    return (x.float() @ int4_dequantize(qweight, scales, zeros, g_idx)).to(x.dtype)


def int4_dequantize_experts(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                            g_idx: torch.Tensor) -> torch.Tensor:
    """Stacked experts in the int4 layout (qweight [E, K / 8, N], scales and zeros [E, G, N],
    g_idx [E, K]) -> W [E, N, K] float32, each expert's (out, in) weight as fused_moe takes it."""
    E, K8, N = qweight.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    q = ((qweight[:, :, None, :] >> shifts[None, None, :, None]) & 0xF).reshape(E, K8 * 8, N)
    return _scale_groups(q, scales, zeros, g_idx).transpose(1, 2)

"""Triton kernels of the manifold-constrained hyper-connections (mHC): one program per token does the
RMS factor, the pre/post/comb maps with the whole Sinkhorn loop in registers, and the collapse, where
plain torch launches some 90 small kernels per call; DeepSeek-V4.1's collapse by a given ``pre`` alone."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def hc_pre_kernel(
    streams_ptr, stride_st, stride_sn, mixes_ptr, stride_mt, base_ptr, scale_ptr,
    pre_ptr, post_ptr, comb_ptr, out_ptr, stride_ot,
    N, D, D_SLICE, iters, hc_eps, norm_eps,
    HEAD: tl.constexpr, COLLAPSE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """``mixes`` holds fn . flatten(streams) (not yet RMS-normalised: the factor is applied here).
    HEAD: the final collapse (``pre`` only, one scale). Program (t, j) collapses channels
    [j * D_SLICE, (j + 1) * D_SLICE) of token t; each computes the RMS factor and ``pre`` over the whole
    row, the same values, and program j = 0 writes ``post`` and ``comb``. COLLAPSE off (DeepSeek-V4.1's
    ``hc_mixes``, one program a token): ``pre`` stored beside them instead of the collapse."""
    t = tl.program_id(0)
    j = tl.program_id(1)
    offs_n = tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    row = streams_ptr + t * stride_st + offs_n[:, None] * stride_sn
    sq = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        m = n_mask[:, None] & (offs_d < D)[None, :]
        x = tl.load(row + offs_d[None, :], mask=m, other=0.0).to(tl.float32)
        sq += x * x
    inv = 1.0 / tl.sqrt(tl.sum(tl.sum(sq, axis=1), axis=0) / (N * D) + norm_eps)
    mixes = mixes_ptr + t * stride_mt
    m_pre = tl.load(mixes + offs_n, mask=n_mask, other=0.0) * inv
    pre = tl.sigmoid(m_pre * tl.load(scale_ptr) + tl.load(base_ptr + offs_n, mask=n_mask, other=0.0)) + hc_eps
    if not HEAD:
        if j == 0:
            if not COLLAPSE:
                tl.store(pre_ptr + t * N + offs_n, pre, mask=n_mask)
            m_post = tl.load(mixes + N + offs_n, mask=n_mask, other=0.0) * inv
            post = 2.0 * tl.sigmoid(m_post * tl.load(scale_ptr + 1) + tl.load(base_ptr + N + offs_n, mask=n_mask,
                                                                                other=0.0))
            tl.store(post_ptr + t * N + offs_n, post, mask=n_mask)
            jk = offs_n[:, None] * N + offs_n[None, :]
            jk_mask = n_mask[:, None] & n_mask[None, :]
            logits = tl.load(mixes + 2 * N + jk, mask=jk_mask, other=0.0) * inv * tl.load(scale_ptr + 2)
            logits = logits + tl.load(base_ptr + 2 * N + jk, mask=jk_mask, other=0.0)
            logits = tl.where(jk_mask, logits, float("-inf"))
            e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
            e = tl.where(jk_mask, e, 0.0)
            comb = tl.where(jk_mask, e / tl.sum(e, axis=1)[:, None] + hc_eps, 0.0)
            comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
            for _ in range(iters - 1):
                comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
                comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
            tl.store(comb_ptr + t * N * N + jk, comb, mask=jk_mask)
    if COLLAPSE:
        out = out_ptr + t * stride_ot
        d_hi = tl.minimum(j * D_SLICE + D_SLICE, D)
        for d0 in range(j * D_SLICE, d_hi, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            m = n_mask[:, None] & (offs_d < d_hi)[None, :]
            x = tl.load(row + offs_d[None, :], mask=m, other=0.0).to(tl.float32)
            collapsed = tl.sum(pre[:, None] * x, axis=0)
            tl.store(out + offs_d, collapsed.to(out_ptr.dtype.element_ty), mask=offs_d < d_hi)


@triton.jit
def hc_collapse_kernel(
    streams_ptr, stride_st, stride_sn, pre_ptr, stride_pt, out_ptr, stride_ot, N, D,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """``out[t] = sum_i pre[t, i] * streams[t, i]`` in float32: program (t, j) on channels
    [j * BLOCK_D, (j + 1) * BLOCK_D) of token t, the n streams summed in registers."""
    t = tl.program_id(0)
    offs_n = tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    pre = tl.load(pre_ptr + t * stride_pt + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    x = tl.load(streams_ptr + t * stride_st + offs_n[:, None] * stride_sn + offs_d[None, :],
                mask=n_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    collapsed = tl.sum(pre[:, None] * x, axis=0)
    tl.store(out_ptr + t * stride_ot + offs_d, collapsed.to(out_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def hc_post_kernel(
    x_ptr, stride_xt, streams_ptr, stride_st, stride_sn, post_ptr, comb_ptr, out_ptr, stride_ot, stride_on,
    N, D, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    offs_n = tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    m = n_mask[:, None] & d_mask[None, :]
    s = tl.load(streams_ptr + t * stride_st + offs_n[:, None] * stride_sn + offs_d[None, :], mask=m,
                other=0.0).to(tl.float32)
    comb = tl.load(comb_ptr + t * N * N + offs_n[:, None] * N + offs_n[None, :],
                   mask=n_mask[:, None] & n_mask[None, :], other=0.0).to(tl.float32)
    post = tl.load(post_ptr + t * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + t * stride_xt + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    mixed = tl.sum(comb[:, :, None] * s[:, None, :], axis=0)
    out = post[:, None] * x[None, :] + mixed
    tl.store(out_ptr + t * stride_ot + offs_n[:, None] * stride_on + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m)

"""Triton kernels of batch-invariant mode (imported lazily, like :mod:`.triton_kernels`).

Each one computes a row (token, or (token, slot) pair) from that row's inputs alone, with block sizes
chosen by the launcher from the weights' shapes and the dtype, never from the number of rows, and
every reduction runs in one fixed order inside one program: no split-K, no atomics.
"""

from __future__ import annotations

import triton
import triton.language as tl

# --- GEMM: out[m, g, :] = x[m, g, :] . w[g]^T (+ bias), one (M-tile, N-tile, group) per program ------


@triton.jit(do_not_specialize=["M"])  # one compiled kernel whatever the row count (M = 1 included)
def matmul_kernel(
    a_ptr, stride_am, stride_ag,
    b_ptr, stride_bg, stride_bn,
    bias_ptr,
    c_ptr, stride_cm, stride_cg,
    M, N, K,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr,
):
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    group = tl.program_id(2).to(tl.int64)
    m_mask = offs_m < M
    n_mask = offs_n < N
    a = a_ptr + group * stride_ag
    b = b_ptr + group * stride_bg
    compute_ty = a_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(a + offs_m[:, None] * stride_am + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w = tl.load(b + offs_n[None, :] * stride_bn + offs_k[:, None], mask=k_mask[:, None] & n_mask[None, :],
                    other=0.0)
        acc += tl.dot(x, w.to(compute_ty), input_precision=DOT_PREC)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + group * stride_cg + offs_m[:, None] * stride_cm + offs_n[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# --- SwiGLU ----------------------------------------------------------------------------------------


@triton.jit
def swiglu_kernel(x_ptr, stride_x, out_ptr, stride_o, I, limit, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    gate = tl.load(x_ptr + t * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_x + I + offs, mask=mask, other=0.0).to(tl.float32)
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    tl.store(out_ptr + t * stride_o + offs, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=mask)


# --- MoE routing -----------------------------------------------------------------------------------

SQRTSOFTPLUS, SIGMOID, SOFTMAX = 0, 1, 2


@triton.jit
def _log1p(u):
    # log(1 + u) without losing small u (the log of the rounded 1 + u, rescaled by the part it kept)
    w = 1.0 + u
    return tl.where(w == 1.0, u, tl.log(w) * (u / (w - 1.0)))


@triton.jit
def _score(x, row_max, row_sum, FUNC: tl.constexpr):
    if FUNC == 0:
        return tl.sqrt(tl.where(x > 20.0, x, _log1p(tl.exp(x))))
    elif FUNC == 1:
        return tl.sigmoid(x)
    else:
        return tl.exp(x - row_max) / row_sum


@triton.jit
def moe_route_kernel(
    logits_ptr, stride_l, bias_ptr, fixed_ptr, stride_f,
    weights_ptr, ids_ptr, E, TOP_K, scaling,
    FUNC: tl.constexpr, HAS_BIAS: tl.constexpr, FIXED: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One token: scores, the top_k of scores + bias (ties towards the lower expert id, one pick at a
    time) or the fixed ids, and the normalised weights. Scores are rounded to the logits' dtype, as
    the reference computes them there."""
    t = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    e_mask = offs_e < E
    row = logits_ptr + t * stride_l
    x = tl.load(row + offs_e, mask=e_mask, other=float("-inf")).to(tl.float32)
    row_max = tl.max(x, 0)
    row_sum = tl.sum(tl.where(e_mask, tl.exp(x - row_max), 0.0), 0)
    out_ty = weights_ptr.dtype.element_ty
    offs_k = tl.arange(0, BLOCK_K)
    if FIXED:
        ids = tl.load(fixed_ptr + t * stride_f + offs_k, mask=offs_k < TOP_K, other=0).to(tl.int64)
    else:
        choice = _score(x, row_max, row_sum, FUNC).to(out_ty).to(tl.float32)
        if HAS_BIAS:
            choice += tl.load(bias_ptr + offs_e, mask=e_mask, other=0.0).to(tl.float32)
        choice = tl.where(e_mask, choice, float("-inf"))
        ids = tl.zeros([BLOCK_K], dtype=tl.int64)
        for i in range(TOP_K):
            best = tl.max(choice, 0)
            pick = tl.min(tl.where((choice == best) & e_mask, offs_e, BLOCK_E), 0)
            ids = tl.where(offs_k == i, pick.to(tl.int64), ids)
            choice = tl.where(offs_e == pick, float("-inf"), choice)
    k_mask = offs_k < TOP_K
    picked = tl.load(row + ids, mask=k_mask, other=0.0).to(tl.float32)
    w = tl.where(k_mask, _score(picked, row_max, row_sum, FUNC).to(out_ty).to(tl.float32), 0.0)
    w = w / (tl.sum(w, 0) + 1e-20) * scaling
    tl.store(weights_ptr + t * TOP_K + offs_k, w.to(out_ty), mask=k_mask)
    tl.store(ids_ptr + t * TOP_K + offs_k, ids, mask=k_mask)


# --- MoE: a token's k expert outputs summed in slot order ------------------------------------------


@triton.jit
def sum_slots_kernel(src_ptr, out_ptr, TOP_K, D, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = offs < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in range(TOP_K):
        acc += tl.load(src_ptr + (t * TOP_K + j) * D + offs, mask=mask, other=0.0)
    tl.store(out_ptr + t * D + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)

"""Triton kernels of the nvidia_sm100 backend (imported lazily: only when a Triton op first runs).

Every kernel accumulates in float32. Gathers read a pool row only where its index is valid
(``0 <= index < rows``): masked loads never touch memory, so NaN in unused rows cannot leak. ``DOT_PREC``
is ``"ieee"`` for float32 operands (no TF32: float32 must match the float32 reference) and ``"tf32"``
otherwise, where it has no effect on bf16/fp16 dots.
"""

from __future__ import annotations

import triton
import triton.language as tl

# --- sparse attention (shared-KV MQA over gathered rows, with per-head sinks) ------------------------


@triton.jit
def _attend_rows(
    m_i, l_i, acc,
    q_ptr, stride_qh, offs_h, h_mask,
    pool_ptr, stride_pool, pool_rows,
    idx_ptr, k_lo, k_hi, scale,
    D, dv_start,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """The online softmax over index columns [k_lo, k_hi) of one query's list."""
    compute_ty = q_ptr.dtype.element_ty
    offs_v = dv_start + tl.arange(0, BLOCK_DV)
    v_mask = offs_v < D
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(idx_ptr + offs_k, mask=offs_k < k_hi, other=-1).to(tl.int64)
        valid = (idx >= 0) & (idx < pool_rows)
        rows = tl.where(valid, idx, 0)
        s = tl.zeros([BLOCK_H, BLOCK_K], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_DK):
            offs_d = d0 + tl.arange(0, BLOCK_DK)
            d_mask = offs_d < D
            qc = tl.load(q_ptr + offs_h[:, None] * stride_qh + offs_d[None, :],
                         mask=h_mask[:, None] & d_mask[None, :], other=0.0)
            kc = tl.load(pool_ptr + rows[:, None] * stride_pool + offs_d[None, :],
                         mask=valid[:, None] & d_mask[None, :], other=0.0)
            s += tl.dot(qc, tl.trans(kc.to(compute_ty)), input_precision=DOT_PREC)
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(pool_ptr + rows[:, None] * stride_pool + offs_v[None, :],
                    mask=valid[:, None] & v_mask[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(compute_ty), v.to(compute_ty), input_precision=DOT_PREC)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def sparse_attention_kernel(
    q_ptr, stride_qt, stride_qh,
    kv_ptr, stride_kv, kv_rows,
    idx_ptr, stride_it, n_idx,
    ekv_ptr, stride_ekv, ekv_rows,
    eidx_ptr, stride_eit, n_eidx,
    sink_ptr, out_ptr, stride_ot, stride_oh,
    H, D, scale,
    HAS_EXTRA: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    dv_start = tl.program_id(2) * BLOCK_DV
    sink = tl.load(sink_ptr + offs_h, mask=h_mask, other=0.0).to(tl.float32)
    # the sink starts the running max and sum: it only ever enters the denominator
    m_i = tl.maximum(sink, -1e30)
    l_i = tl.exp(sink - m_i)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    q_t = q_ptr + t * stride_qt
    m_i, l_i, acc = _attend_rows(
        m_i, l_i, acc, q_t, stride_qh, offs_h, h_mask, kv_ptr, stride_kv, kv_rows,
        idx_ptr + t * stride_it, 0, n_idx, scale, D, dv_start,
        BLOCK_H, BLOCK_K, BLOCK_DK, BLOCK_DV, DOT_PREC,
    )
    if HAS_EXTRA:
        m_i, l_i, acc = _attend_rows(
            m_i, l_i, acc, q_t, stride_qh, offs_h, h_mask, ekv_ptr, stride_ekv, ekv_rows,
            eidx_ptr + t * stride_eit, 0, n_eidx, scale, D, dv_start,
            BLOCK_H, BLOCK_K, BLOCK_DK, BLOCK_DV, DOT_PREC,
        )
    out = acc / l_i[:, None]
    offs_v = dv_start + tl.arange(0, BLOCK_DV)
    tl.store(out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_v[None, :],
             out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & (offs_v < D)[None, :])


@triton.jit
def sparse_attention_split_kernel(
    q_ptr, stride_qt, stride_qh,
    kv_ptr, stride_kv, kv_rows,
    idx_ptr, stride_it, n_idx,
    ekv_ptr, stride_ekv, ekv_rows,
    eidx_ptr, stride_eit, n_eidx,
    m_ptr, l_ptr, part_ptr,
    H, D, scale, CHUNK, S,
    HAS_EXTRA: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Split ``j`` of query ``t``: the softmax state (max, sum, unnormalised value) over columns
    [j * CHUNK, (j + 1) * CHUNK) of the query's window list followed by its extra list, no sink; the
    states of the S splits are merged by :func:`sparse_attention_combine_kernel`."""
    t = tl.program_id(0).to(tl.int64)
    blocks_v = tl.cdiv(D, BLOCK_DV)
    offs_h = (tl.program_id(1) // blocks_v) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    dv_start = (tl.program_id(1) % blocks_v) * BLOCK_DV
    j = tl.program_id(2)
    lo = j * CHUNK
    hi = lo + CHUNK
    m_i = tl.full([BLOCK_H], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    q_t = q_ptr + t * stride_qt
    m_i, l_i, acc = _attend_rows(
        m_i, l_i, acc, q_t, stride_qh, offs_h, h_mask, kv_ptr, stride_kv, kv_rows,
        idx_ptr + t * stride_it, tl.minimum(lo, n_idx), tl.minimum(hi, n_idx), scale, D, dv_start,
        BLOCK_H, BLOCK_K, BLOCK_DK, BLOCK_DV, DOT_PREC,
    )
    if HAS_EXTRA:
        m_i, l_i, acc = _attend_rows(
            m_i, l_i, acc, q_t, stride_qh, offs_h, h_mask, ekv_ptr, stride_ekv, ekv_rows,
            eidx_ptr + t * stride_eit, tl.minimum(tl.maximum(lo - n_idx, 0), n_eidx),
            tl.minimum(tl.maximum(hi - n_idx, 0), n_eidx), scale, D, dv_start,
            BLOCK_H, BLOCK_K, BLOCK_DK, BLOCK_DV, DOT_PREC,
        )
    row = (t * S + j) * H + offs_h  # [T, S, H] states, [T, S, H, D] values
    tl.store(m_ptr + row, m_i, mask=h_mask)
    tl.store(l_ptr + row, l_i, mask=h_mask)
    offs_v = dv_start + tl.arange(0, BLOCK_DV)
    tl.store(part_ptr + row[:, None] * D + offs_v[None, :], acc, mask=h_mask[:, None] & (offs_v < D)[None, :])


@triton.jit
def sparse_attention_combine_kernel(
    m_ptr, l_ptr, part_ptr, sink_ptr, out_ptr, stride_ot, stride_oh,
    H, D, S,
    BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Merge query ``t``'s S split states with the heads' sinks, which enter the denominator only."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    offs_v = tl.program_id(2) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    v_mask = offs_v < D
    sink = tl.load(sink_ptr + offs_h, mask=h_mask, other=0.0).to(tl.float32)
    m = tl.maximum(sink, -1e30)
    for j in range(S):
        m = tl.maximum(m, tl.load(m_ptr + (t * S + j) * H + offs_h, mask=h_mask, other=-1e30))
    den = tl.exp(sink - m)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    for j in range(S):
        row = (t * S + j) * H + offs_h
        w = tl.exp(tl.load(m_ptr + row, mask=h_mask, other=-1e30) - m)
        den += tl.load(l_ptr + row, mask=h_mask, other=0.0) * w
        part = tl.load(part_ptr + row[:, None] * D + offs_v[None, :], mask=h_mask[:, None] & v_mask[None, :],
                       other=0.0)
        acc += part * w[:, None]
    out = acc / den[:, None]
    tl.store(out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_v[None, :],
             out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & v_mask[None, :])


# --- lightning indexer scores ---------------------------------------------------------------------


@triton.jit
def indexer_scores_kernel(
    q_ptr, stride_qt, stride_qh,
    w_ptr, stride_wt,
    keys_ptr, stride_key, key_rows,
    cand_ptr, stride_ct, C,
    out_ptr, stride_ot,
    IH, d, scale,
    BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = offs_c < C
    cand = tl.load(cand_ptr + t * stride_ct + offs_c, mask=c_mask, other=-1).to(tl.int64)
    valid = (cand >= 0) & (cand < key_rows)
    rows = tl.where(valid, cand, 0)
    compute_ty = q_ptr.dtype.element_ty
    score = tl.zeros([BLOCK_C], dtype=tl.float32)
    for h0 in range(0, IH, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h_mask = offs_h < IH
        dots = tl.zeros([BLOCK_H, BLOCK_C], dtype=tl.float32)
        for d0 in range(0, d, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            d_mask = offs_d < d
            qc = tl.load(q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                         mask=h_mask[:, None] & d_mask[None, :], other=0.0)
            kc = tl.load(keys_ptr + rows[:, None] * stride_key + offs_d[None, :],
                         mask=valid[:, None] & d_mask[None, :], other=0.0)
            dots += tl.dot(qc, tl.trans(kc.to(compute_ty)), input_precision=DOT_PREC)
        w = tl.load(w_ptr + t * stride_wt + offs_h, mask=h_mask, other=0.0).to(tl.float32)
        score += tl.sum(tl.maximum(dots, 0.0) * w[:, None], 0)
    score = tl.where(valid, score * scale, float("-inf"))
    tl.store(out_ptr + t * stride_ot + offs_c, score, mask=c_mask)


@triton.jit
def select_topk_kernel(
    scores_ptr, stride_st, cand_ptr, stride_ct, key_rows, C,
    out_ptr, stride_ot, K, TOPK,
    BLOCK: tl.constexpr,
):
    """Row t's ``TOPK`` picks: the candidates of its K best of C scores in the order of a stable
    descending sort (ties towards the earlier column, NaN first), an invalid candidate as -1, -1 past K.
    One bitonic sort of the row in registers over (score, column) packed into one int64 key."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    s = tl.load(scores_ptr + t * stride_st + offs, mask=offs < C, other=float("-inf"))
    s = tl.where(s == 0.0, 0.0, s)  # -0.0 ties with 0.0, as in the sort
    bits = s.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # the float order as a signed integer order
    key = tl.where(s != s, 0x7FFFFFFF, key)
    packed = key.to(tl.int64) * 4294967296 + (2147483647 - offs).to(tl.int64)
    packed = tl.sort(packed, descending=True)
    column = 2147483647 - (packed & 4294967295)
    take = offs < K
    cand = tl.load(cand_ptr + t * stride_ct + column, mask=take, other=-1).to(tl.int64)
    cand = tl.where((cand >= 0) & (cand < key_rows), cand, -1)
    tl.store(out_ptr + t * stride_ot + offs, cand, mask=take)
    for p0 in range(K, TOPK, BLOCK):
        pad = p0 + tl.arange(0, BLOCK)
        tl.store(out_ptr + t * stride_ot + pad, tl.full([BLOCK], -1, dtype=tl.int64), mask=pad < TOPK)


# --- compressor windows ---------------------------------------------------------------------------


@triton.jit
def compress_windows_kernel(
    kv_ptr, stride_kw, stride_kl,
    gate_ptr, stride_gw, stride_gl,
    out_ptr, stride_ow,
    L, D,
    BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
):
    w = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    m = tl.full([BLOCK_D], float("-inf"), dtype=tl.float32)
    for l0 in range(0, L, BLOCK_L):
        offs_l = l0 + tl.arange(0, BLOCK_L)
        mask = (offs_l < L)[:, None] & d_mask[None, :]
        g = tl.load(gate_ptr + w * stride_gw + offs_l[:, None] * stride_gl + offs_d[None, :],
                    mask=mask, other=float("-inf")).to(tl.float32)
        m = tl.maximum(m, tl.max(g, 0))
    total = tl.zeros([BLOCK_D], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for l0 in range(0, L, BLOCK_L):
        offs_l = l0 + tl.arange(0, BLOCK_L)
        mask = (offs_l < L)[:, None] & d_mask[None, :]
        g = tl.load(gate_ptr + w * stride_gw + offs_l[:, None] * stride_gl + offs_d[None, :],
                    mask=mask, other=float("-inf")).to(tl.float32)
        x = tl.load(kv_ptr + w * stride_kw + offs_l[:, None] * stride_kl + offs_d[None, :],
                    mask=mask, other=0.0).to(tl.float32)
        e = tl.exp(g - m[None, :])
        total += tl.sum(e, 0)
        acc += tl.sum(e * x, 0)
    tl.store(out_ptr + w * stride_ow + offs_d, (acc / total).to(out_ptr.dtype.element_ty), mask=d_mask)


# --- RMSNorm and RoPE -------------------------------------------------------------------------------


@triton.jit
def rms_norm_kernel(
    x_ptr, stride_x, w_ptr, out_ptr, stride_o, D, eps,
    HAS_WEIGHT: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    sq = tl.zeros([BLOCK_D], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs = d0 + tl.arange(0, BLOCK_D)
        x = tl.load(x_ptr + row * stride_x + offs, mask=offs < D, other=0.0).to(tl.float32)
        sq += x * x
    inv = 1.0 / tl.sqrt(tl.sum(sq, 0) / D + eps)
    for d0 in range(0, D, BLOCK_D):
        offs = d0 + tl.arange(0, BLOCK_D)
        mask = offs < D
        y = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32) * inv
        if HAS_WEIGHT:
            y = y * tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rotary_kernel(
    x_ptr, stride_xt, stride_xh,
    cos_ptr, sin_ptr, stride_ct, stride_st,
    out_ptr, stride_ot, stride_oh,
    H, D, R, sign,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    start = D - R  # first rotated channel; pairs (start + 2i, start + 2i + 1) turn by angle i
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        d_mask = offs_d < D
        mask = h_mask[:, None] & d_mask[None, :]
        x = tl.load(x_ptr + t * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :],
                    mask=mask, other=0.0).to(tl.float32)
        rel = offs_d - start
        in_rope = (rel >= 0) & d_mask
        even = (rel % 2) == 0
        partner = tl.where(even, offs_d + 1, offs_d - 1)
        pair = tl.where(in_rope, rel // 2, 0)
        xp = tl.load(x_ptr + t * stride_xt + offs_h[:, None] * stride_xh + partner[None, :],
                     mask=h_mask[:, None] & in_rope[None, :], other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + t * stride_ct + pair, mask=in_rope, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + t * stride_st + pair, mask=in_rope, other=0.0).to(tl.float32) * sign
        # even channel: x*cos - x_odd*sin; odd channel: x*cos + x_even*sin
        turned = x * c[None, :] + tl.where(even, -1.0, 1.0)[None, :] * xp * s[None, :]
        y = tl.where(in_rope[None, :], turned, x)
        tl.store(out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
                 y.to(out_ptr.dtype.element_ty), mask=mask)


# --- grouped MoE GEMMs over tokens sorted by expert -------------------------------------------------


@triton.jit
def moe_gate_up_kernel(
    x_ptr, stride_xt,
    w_ptr, stride_we, stride_wn,
    sorted_ptr, block_expert_ptr,
    h_ptr, stride_hm,
    num_pairs, TOP_K, D, I, limit,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """h[row] = swiglu(w13[e] . x[token of row]) for one M-block of rows that all belong to expert e."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert >= 0:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ptr + offs_m)
        row_ok = pair < num_pairs
        token = tl.where(row_ok, pair // TOP_K, 0).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < I
        compute_ty = x_ptr.dtype.element_ty
        w_e = w_ptr + expert * stride_we
        gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < D
            a = tl.load(x_ptr + token[:, None] * stride_xt + offs_k[None, :],
                        mask=row_ok[:, None] & k_mask[None, :], other=0.0)
            wmask = k_mask[:, None] & n_mask[None, :]
            wg = tl.load(w_e + offs_n[None, :] * stride_wn + offs_k[:, None], mask=wmask, other=0.0)
            wu = tl.load(w_e + (offs_n + I)[None, :] * stride_wn + offs_k[:, None], mask=wmask, other=0.0)
            gate += tl.dot(a, wg.to(compute_ty), input_precision=DOT_PREC)
            up += tl.dot(a, wu.to(compute_ty), input_precision=DOT_PREC)
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        h = gate * tl.sigmoid(gate) * up
        tl.store(h_ptr + offs_m[:, None] * stride_hm + offs_n[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & n_mask[None, :])


@triton.jit
def moe_down_kernel(
    h_ptr, stride_hm,
    w_ptr, stride_we, stride_wn,
    sorted_ptr, block_expert_ptr, topk_w_ptr,
    out_ptr, stride_op,
    num_pairs, D, I,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """out[pair] = topk_weight[pair] * (w2[e] . h[row]) for one M-block of rows of expert e."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert >= 0:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ptr + offs_m)
        row_ok = pair < num_pairs
        safe_pair = tl.where(row_ok, pair, 0).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < D
        compute_ty = h_ptr.dtype.element_ty
        w_e = w_ptr + expert * stride_we
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < I
            a = tl.load(h_ptr + offs_m[:, None] * stride_hm + offs_k[None, :],
                        mask=row_ok[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_e + offs_n[None, :] * stride_wn + offs_k[:, None],
                        mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc += tl.dot(a, w.to(compute_ty), input_precision=DOT_PREC)
        weight = tl.load(topk_w_ptr + safe_pair, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc * weight[:, None]
        tl.store(out_ptr + safe_pair[:, None] * stride_op + offs_n[None, :], acc,
                 mask=row_ok[:, None] & n_mask[None, :])

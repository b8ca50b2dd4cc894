"""Triton kernels of the block-FP8 ops (imported lazily, like :mod:`.triton_kernels`).

Activations are quantised by :func:`quantize_fp8_kernel` before the GEMMs read them, one 128-channel
group per row: ``s = max(amax, 1e-4) / 448`` and ``q = x / s`` (both IEEE divisions, as torch computes
them; a plain ``/`` compiles to an approximate division) rounded to E4M3 by :func:`round_e4m3`, so the
quantised values and scales equal the reference's bit for bit. The GEMMs then load E4M3 operands and
float32 scales from memory, like any block-FP8 GEMM: each K step's dot product is scaled by
``s_x * s_w`` and added to a float32 accumulator. No dot operand is built in registers from a
reduction of the same loop (the fused form, quantising inside the GEMM, failed on an H200).
``FP8_DOT`` multiplies E4M3 operands on the tensor cores; without it (Triton's interpreter, whose E4M3
dot and float-to-E4M3 rounding are wrong in 3.6) the same exact values are multiplied in float32.
"""

from __future__ import annotations

import triton
import triton.language as tl

GROUP = tl.constexpr(128)  # channels per activation scale = weight tile edge


@triton.jit
def round_e4m3(x):
    """float32 -> the nearest E4M3 value (ties to even) as float32, for |x| <= 448."""
    bits = x.to(tl.int32, bitcast=True)
    # normal range: drop 20 of float32's 23 mantissa bits, rounding to nearest even (a carry may bump the
    # exponent, as it should)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    # below 2^-6 E4M3 is subnormal, in steps of 2^-9: adding 1.5 * 2^14 leaves exactly that step; on the
    # magnitude, with x's sign bit put back so that a negative value rounding to zero stays -0 as torch's
    # cast keeps it (a float negation compiles to 0 - x, which gives +0)
    magnitude = (tl.abs(x) + 24576.0) - 24576.0
    subnormal = (magnitude.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def quantize_rows(x, valid):
    """One 128-channel group per row of ``x`` [M, 128] (float32): (E4M3 values as float32, scales [M])."""
    amax = tl.max(tl.where(valid, tl.abs(x), 0.0), 1)
    scale = tl.math.div_rn(tl.maximum(amax, 1e-4), tl.full(amax.shape, 448.0, tl.float32))
    q = tl.math.div_rn(x, scale[:, None])
    return round_e4m3(tl.minimum(tl.maximum(q, -448.0), 448.0)), scale


@triton.jit
def _dot(a, b, FP8_DOT: tl.constexpr):
    """a [M, K] . b [K, N], both E4M3 loaded from memory, in float32."""
    if FP8_DOT:
        return tl.dot(a, b, out_dtype=tl.float32)
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def chosen_rows(offs_m, m_mask, src_ptr, dst_ptr, R, HAS_IDX: tl.constexpr):
    """(source row, destination row, mask) of rows ``offs_m``: with ``HAS_IDX`` src[i] and dst[i], a
    destination of R or more skipped; else row i both."""
    if HAS_IDX:
        src = tl.load(src_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
        dst = tl.load(dst_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
        m_mask = m_mask & (dst < R)
    else:
        src = offs_m.to(tl.int64)
        dst = src
    return tl.where(m_mask, src, 0), tl.where(m_mask, dst, 0), m_mask


@triton.jit
def scale_offsets(rows, g, SLAB_M, stride_se, stride_sm, stride_sk):
    """Where the scale of group g of destination row ``rows`` lives: row r is row r % SLAB_M of slab
    r // SLAB_M (one slab when SLAB_M exceeds every row), so slabs of MN-major scales can be written."""
    return (rows // SLAB_M) * stride_se + (rows % SLAB_M) * stride_sm + g * stride_sk


@triton.jit
def quantize_fp8_kernel(
    x_ptr, stride_xm,
    q_ptr, stride_qm, s_ptr, stride_se, stride_sm, stride_sk,
    src_ptr, dst_ptr, M, R, K, SLAB_M,
    HAS_IDX: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """q[m, g*128 : (g+1)*128] (E4M3) and its scale (float32) for one block of rows and one group g;
    with ``HAS_IDX`` the i-th of M rows is row src[i] of x, written to row dst[i] of q and of the scales
    (skipped when dst[i] is R or more)."""
    pid_m, g = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = g * GROUP + tl.arange(0, GROUP)
    src, dst, m_mask = chosen_rows(offs_m, offs_m < M, src_ptr, dst_ptr, R, HAS_IDX)
    valid = m_mask[:, None] & (offs_k < K)[None, :]
    x = tl.load(x_ptr + src[:, None] * stride_xm + offs_k[None, :], mask=valid, other=0.0).to(tl.float32)
    xq, xs = quantize_rows(x, valid)
    tl.store(q_ptr + dst[:, None] * stride_qm + offs_k[None, :], xq.to(q_ptr.dtype.element_ty), mask=valid)
    tl.store(s_ptr + scale_offsets(dst, g, SLAB_M, stride_se, stride_sm, stride_sk), xs, mask=m_mask)


@triton.jit
def swiglu_quantize_kernel(
    gu_ptr, stride_gm,
    q_ptr, stride_qm, s_ptr, stride_se, stride_sm, stride_sk,
    idx_ptr, M, R, I, SLAB_M, limit,
    HAS_IDX: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """h = swiglu(gate_up) in float32 (gate = columns [0, I), up = [I, 2I)), quantised as
    :func:`quantize_fp8_kernel` quantises: one block of rows and one 128-channel group g of h. With
    ``HAS_IDX`` the i-th of M rows is row idx[i] of gate_up, q and the scales alike (skipped when it is R
    or more)."""
    pid_m, g = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = g * GROUP + tl.arange(0, GROUP)
    rows, _, m_mask = chosen_rows(offs_m, offs_m < M, idx_ptr, idx_ptr, R, HAS_IDX)
    valid = m_mask[:, None] & (offs_n < I)[None, :]
    at = gu_ptr + rows[:, None] * stride_gm + offs_n[None, :]
    gate = tl.minimum(tl.load(at, mask=valid, other=0.0).to(tl.float32), limit)
    up = tl.load(at + I, mask=valid, other=0.0).to(tl.float32)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    h = gate * tl.sigmoid(gate) * up
    hq, hs = quantize_rows(tl.where(valid, h, 0.0), valid)
    tl.store(q_ptr + rows[:, None] * stride_qm + offs_n[None, :], hq.to(q_ptr.dtype.element_ty), mask=valid)
    tl.store(s_ptr + scale_offsets(rows, g, SLAB_M, stride_se, stride_sm, stride_sk), hs, mask=m_mask)


@triton.jit
def moe_combine_kernel(
    rows_ptr, stride_r, row_of_ptr, w_ptr, out_ptr, stride_o,
    D, R,
    K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """out[t] = sum over slots j of w[t*K + j] * rows[row_of[t*K + j]], in float32 in slot order, for one
    token t and BLOCK_D columns; a slot whose row is R (none) adds 0."""
    t, pid_d = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(K):
        r = tl.load(row_of_ptr + t * K + j).to(tl.int64)
        w = tl.load(w_ptr + t * K + j).to(tl.float32)
        ok = r < R
        vals = tl.load(rows_ptr + tl.where(ok, r, 0) * stride_r + offs, mask=d_mask & ok, other=0.0)
        acc += vals.to(tl.float32) * tl.where(ok, w, 0.0)
    tl.store(out_ptr + t * stride_o + offs, acc.to(out_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def repeats_earlier_slot(ids_ptr, q, q_mask, ids, K: tl.constexpr):
    """Whether each (token, slot) pair ``q`` (id ``ids``) repeats the id of an earlier slot of its token."""
    first_slot = (q // K) * K
    repeat = q < 0
    for j in tl.static_range(K):
        other = first_slot + j
        earlier = q_mask & (other < q)
        repeat = repeat | (earlier & (tl.load(ids_ptr + other, mask=earlier, other=-1) == ids))
    return repeat


@triton.jit
def pair_keys(ids_ptr, q, q_mask, G, K: tl.constexpr):
    """The expert of each pair ``q``: its id, or G where the id is outside [0, G) or repeats an earlier
    slot of the same token."""
    ids = tl.load(ids_ptr + q, mask=q_mask, other=-1)
    repeat = repeats_earlier_slot(ids_ptr, q, q_mask, ids, K)
    return tl.where(q_mask & (ids >= 0) & (ids < G) & ~repeat, ids, G)


@triton.jit
def masked_layout_kernel(
    ids_ptr, tw_ptr, dest_ptr, token_ptr, w_ptr, counts_ptr,
    P, G, MAX_M, PAIR_BLOCKS,
    K: tl.constexpr, BLOCK: tl.constexpr,
):
    """The masked MoE's layout (``external.masked_layout``) in one launch. The first PAIR_BLOCKS programs
    take BLOCK pairs each: slab row (expert * MAX_M + rank among the expert's pairs in pair order, or the
    trash row G * MAX_M), token, and weight (a slot's own plus those of the later slots repeating its id,
    in slot order; 0 for a repeat). The others count the pairs of BLOCK experts each."""
    pid = tl.program_id(0)
    if pid < PAIR_BLOCKS:
        p = pid * BLOCK + tl.arange(0, BLOCK)
        p_mask = p < P
        ids = tl.load(ids_ptr + p, mask=p_mask, other=-1)
        repeat = repeats_earlier_slot(ids_ptr, p, p_mask, ids, K)
        key = tl.where(p_mask & (ids >= 0) & (ids < G) & ~repeat, ids, G)
        rank = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(0, P, BLOCK):
            q = start + tl.arange(0, BLOCK)
            kq = pair_keys(ids_ptr, q, q < P, G, K)
            same = (kq[None, :] == key[:, None]) & (q[None, :] < p[:, None])
            rank += tl.sum(same.to(tl.int32), 1)
        first_slot = (p // K) * K
        w = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(K):
            other = first_slot + j
            later = p_mask & (other >= p)
            o_id = tl.load(ids_ptr + other, mask=later, other=-1)
            o_w = tl.load(tw_ptr + other, mask=later, other=0.0).to(tl.float32)
            w += tl.where(later & (o_id == ids), o_w, 0.0)
        dest = tl.where(key < G, key.to(tl.int64) * MAX_M + rank, G * MAX_M)
        tl.store(dest_ptr + p, dest, mask=p_mask)
        tl.store(token_ptr + p, (p // K).to(tl.int64), mask=p_mask)
        tl.store(w_ptr + p, tl.where(repeat, 0.0, w), mask=p_mask)
    else:
        e = (pid - PAIR_BLOCKS) * BLOCK + tl.arange(0, BLOCK)
        count = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(0, P, BLOCK):
            q = start + tl.arange(0, BLOCK)
            kq = pair_keys(ids_ptr, q, q < P, G, K)
            count += tl.sum((kq[None, :] == e[:, None]).to(tl.int32), 1)
        tl.store(counts_ptr + e, count, mask=e < G)


@triton.jit
def linear_fp8_kernel(
    xq_ptr, stride_xm, xs_ptr, stride_xsm,
    w_ptr, stride_wn,
    ws_ptr, stride_wsn,
    out_ptr, stride_os, stride_om,
    M, N, K, groups_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FP8_DOT: tl.constexpr,
):
    """out[split] = the K groups of ``split`` of xq . w.T, each scaled by its x and w scales, float32
    (split-K for small decode batches)."""
    pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    rows = tl.where(m_mask, offs_m, 0).to(tl.int64)
    cols = tl.where(n_mask, offs_n, 0).to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    g_start = split * groups_per_split
    for g in range(g_start, g_start + groups_per_split):
        offs_k = g * GROUP + tl.arange(0, GROUP)
        k_mask = offs_k < K
        # whether group g is within K, as blocks (Triton's interpreter rejects a block mask & a Python bool)
        g_rows, g_cols = offs_m * 0 + g * GROUP < K, offs_n * 0 + g * GROUP < K
        a = tl.load(xq_ptr + rows[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        xs = tl.load(xs_ptr + rows * stride_xsm + g, mask=m_mask & g_rows, other=0.0)
        w = tl.load(w_ptr + cols[None, :] * stride_wn + offs_k[:, None], mask=k_mask[:, None] & n_mask[None, :],
                    other=0.0)
        ws = tl.load(ws_ptr + (cols // GROUP) * stride_wsn + g, mask=n_mask & g_cols, other=0.0)
        acc += _dot(a, w, FP8_DOT) * xs[:, None] * ws[None, :]
    tl.store(out_ptr + split * stride_os + rows[:, None] * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def moe_fp8_gate_up_kernel(
    xq_ptr, stride_xt, xs_ptr, stride_xst,
    w_ptr, stride_we, stride_wn,
    ws_ptr, stride_wse, stride_wsn,
    sorted_ptr, block_expert_ptr,
    hq_ptr, stride_hm, hs_ptr, stride_hsm,
    num_pairs, TOP_K, D, I, limit,
    BLOCK_M: tl.constexpr, FP8_DOT: tl.constexpr,
):
    """For one M-block of rows of expert e and one 128-channel group of h: h = swiglu(w13[e] . x) in float32
    from the quantised tokens (``xq``, ``xs``), quantised per row into ``hq`` (E4M3) and ``hs`` (its scale,
    column = this group)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert >= 0:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ptr + offs_m)
        row_ok = pair < num_pairs
        token = tl.where(row_ok, pair // TOP_K, 0).to(tl.int64)
        offs_n = pid_n * GROUP + tl.arange(0, GROUP)
        n_mask = offs_n < I
        gate_rows = tl.where(n_mask, offs_n, 0).to(tl.int64)
        up_rows = gate_rows + I
        w_e = w_ptr + expert * stride_we
        ws_e = ws_ptr + expert * stride_wse
        gate = tl.zeros([BLOCK_M, GROUP], dtype=tl.float32)
        up = tl.zeros([BLOCK_M, GROUP], dtype=tl.float32)
        for g in range(0, tl.cdiv(D, GROUP)):
            offs_k = g * GROUP + tl.arange(0, GROUP)
            k_mask = offs_k < D
            a = tl.load(xq_ptr + token[:, None] * stride_xt + offs_k[None, :], mask=row_ok[:, None] & k_mask[None, :],
                        other=0.0)
            xs = tl.load(xs_ptr + token * stride_xst + g, mask=row_ok, other=0.0)
            wmask = k_mask[:, None] & n_mask[None, :]
            wg = tl.load(w_e + gate_rows[None, :] * stride_wn + offs_k[:, None], mask=wmask, other=0.0)
            wu = tl.load(w_e + up_rows[None, :] * stride_wn + offs_k[:, None], mask=wmask, other=0.0)
            sg = tl.load(ws_e + (gate_rows // GROUP) * stride_wsn + g, mask=n_mask, other=0.0)
            su = tl.load(ws_e + (up_rows // GROUP) * stride_wsn + g, mask=n_mask, other=0.0)
            gate += _dot(a, wg, FP8_DOT) * xs[:, None] * sg[None, :]
            up += _dot(a, wu, FP8_DOT) * xs[:, None] * su[None, :]
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        h = gate * tl.sigmoid(gate) * up
        valid = row_ok[:, None] & n_mask[None, :]
        hq, hs = quantize_rows(tl.where(valid, h, 0.0), valid)
        tl.store(hq_ptr + offs_m[:, None] * stride_hm + offs_n[None, :], hq.to(hq_ptr.dtype.element_ty), mask=valid)
        tl.store(hs_ptr + offs_m * stride_hsm + pid_n, hs, mask=row_ok)


@triton.jit
def moe_fp8_down_kernel(
    hq_ptr, stride_hm, hs_ptr, stride_hsm,
    w_ptr, stride_we, stride_wn,
    ws_ptr, stride_wse, stride_wsn,
    sorted_ptr, block_expert_ptr, topk_w_ptr,
    out_ptr, stride_op,
    num_pairs, D, I,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FP8_DOT: tl.constexpr,
):
    """out[pair] = topk_weight[pair] * (w2[e] . h[row]) for one M-block of rows of expert e, float32."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert >= 0:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ptr + offs_m)
        row_ok = pair < num_pairs
        safe_pair = tl.where(row_ok, pair, 0).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < D
        cols = tl.where(n_mask, offs_n, 0).to(tl.int64)
        w_e = w_ptr + expert * stride_we
        ws_e = ws_ptr + expert * stride_wse
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for g in range(0, tl.cdiv(I, GROUP)):
            offs_k = g * GROUP + tl.arange(0, GROUP)
            k_mask = offs_k < I
            a = tl.load(hq_ptr + offs_m[:, None] * stride_hm + offs_k[None, :],
                        mask=row_ok[:, None] & k_mask[None, :], other=0.0)
            hs = tl.load(hs_ptr + offs_m * stride_hsm + g, mask=row_ok, other=0.0)
            w = tl.load(w_e + cols[None, :] * stride_wn + offs_k[:, None], mask=k_mask[:, None] & n_mask[None, :],
                        other=0.0)
            ws = tl.load(ws_e + (cols // GROUP) * stride_wsn + g, mask=n_mask, other=0.0)
            acc += _dot(a, w, FP8_DOT) * hs[:, None] * ws[None, :]
        weight = tl.load(topk_w_ptr + safe_pair, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + safe_pair[:, None] * stride_op + offs_n[None, :], acc * weight[:, None],
                 mask=row_ok[:, None] & n_mask[None, :])

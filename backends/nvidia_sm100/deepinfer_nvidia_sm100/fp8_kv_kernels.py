"""Triton kernel of ``sparse_attention_fp8`` (imported lazily, like :mod:`.triton_kernels`): the Triton
``sparse_attention`` (shared-KV MQA over rows gathered by index, the per-head sink starting the online
softmax, a window list then an extra list) reading DeepSeek's FP8 KV entries (:mod:`deepinfer_core.quant.kv_fp8`,
FlashMLA's V4 layout) as they lie in the cache, with no dequantised copy.

An entry of ``D`` values is ``NOPE = D - R`` E4M3 codes, the ``R`` RoPE values in the rope dtype (``ROPE_FMT``
0: float32, 1: bfloat16, 2: float16), one ue8m0 scale byte per 64 codes (``2**(byte - 127)``, the last group
may be partial) at ``SCALE_AT = NOPE + R * itemsize``, then a pad. The gathered uint8 rows are decoded in
registers: an E4M3 code by Triton's float8e4nv bitcast (the hardware conversion; Triton 3.6's interpreter
decodes every finite code right, only the NaN codes 0x7F/0xFF as +-480, which ``kv_fp8_pack`` never
writes), the scale by its bits (:func:`~.fp4_moe_kernels.e8m0_values`), a RoPE value from its bytes, or,
where the launcher proved the entries aligned (``ALIGNED``), by one load through a pointer of its dtype.

Scores: ``q . k`` over the E4M3 part one 64-code group at a time, ``dot(q_g, codes_g) * scale_g`` (a
power of two commutes with every rounding of the dot, so this is the dot of the decoded values, bar
under- or overflow), then the RoPE part in one ``BLOCK_R`` chunk. Values: each ``[BLOCK_K, BLOCK_DV]``
tile decoded whole (codes times their gathered scales, RoPE values), in the query's dtype as the catalogue
says (exact in bfloat16 and float32), then the same ``p . v`` as ``sparse_attention``. Invalid slots (-1,
or past the pool) are never read; masked loads do not touch memory, so the 0xFF bytes of unused rows never
reach an output.
"""

from __future__ import annotations

import triton
import triton.language as tl

from deepinfer_nvidia_sm100.fp4_moe_kernels import e8m0_values

SCALE_GROUP = tl.constexpr(64)  # E4M3 codes per ue8m0 scale


@triton.jit
def _rope_values(row_ptr, offs_r, mask, NOPE: tl.constexpr, ROPE_FMT: tl.constexpr, ALIGNED: tl.constexpr):
    """float32 RoPE values ``offs_r`` [1, BLOCK_R] of the entries at ``row_ptr`` [BLOCK_K, 1] (uint8).
    (Every constexpr branch returns: no statement follows a return.)"""
    if ALIGNED:
        if ROPE_FMT == 0:
            ptr = (row_ptr + NOPE).to(tl.pointer_type(tl.float32))
        elif ROPE_FMT == 1:
            ptr = (row_ptr + NOPE).to(tl.pointer_type(tl.bfloat16))
        else:
            ptr = (row_ptr + NOPE).to(tl.pointer_type(tl.float16))
        return tl.load(ptr + offs_r, mask=mask, other=0.0).to(tl.float32)
    elif ROPE_FMT == 0:
        at = row_ptr + NOPE + offs_r * 4
        bits = tl.load(at, mask=mask, other=0).to(tl.uint32)
        bits |= tl.load(at + 1, mask=mask, other=0).to(tl.uint32) << 8
        bits |= tl.load(at + 2, mask=mask, other=0).to(tl.uint32) << 16
        bits |= tl.load(at + 3, mask=mask, other=0).to(tl.uint32) << 24
        return bits.to(tl.float32, bitcast=True)
    else:
        at = row_ptr + NOPE + offs_r * 2
        bits = tl.load(at, mask=mask, other=0).to(tl.uint32)
        bits |= tl.load(at + 1, mask=mask, other=0).to(tl.uint32) << 8
        if ROPE_FMT == 1:
            return (bits << 16).to(tl.float32, bitcast=True)
        else:
            return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e4m3(codes):
    """uint8 E4M3 codes -> float32."""
    return codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _attend_fp8_rows(
    m_i, l_i, acc,
    q_ptr, stride_qh, offs_h, h_mask,
    pool_ptr, stride_pool, pool_rows,
    idx_ptr, k_lo, k_hi, scale, dv_start,
    D: tl.constexpr, NOPE: tl.constexpr, SCALE_AT: tl.constexpr, ROPE_FMT: tl.constexpr, ALIGNED: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """:func:`~.triton_kernels._attend_rows` over FP8 entries (index columns [k_lo, k_hi))."""
    compute_ty = q_ptr.dtype.element_ty
    offs_g = tl.arange(0, SCALE_GROUP)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < D - NOPE
    offs_v = dv_start + tl.arange(0, BLOCK_DV)
    v_nope = offs_v < NOPE
    v_rope = (offs_v >= NOPE) & (offs_v < D)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(idx_ptr + offs_k, mask=offs_k < k_hi, other=-1).to(tl.int64)
        valid = (idx >= 0) & (idx < pool_rows)
        row_off = tl.where(valid, idx, 0) * stride_pool
        if ALIGNED:
            row_off = tl.multiple_of(row_off, 8)
        row_ptr = pool_ptr + row_off[:, None]  # [BLOCK_K, 1]
        s = tl.zeros([BLOCK_H, BLOCK_K], dtype=tl.float32)
        # a loop, not tl.static_range: unrolled, the compiler hoists every q chunk out of the key loop into
        # shared memory (64 kB at 64 heads x 448 in bfloat16; past the limit in float32)
        for g0 in range(0, NOPE, SCALE_GROUP):
            offs_d = g0 + offs_g
            d_mask = offs_d < NOPE
            qc = tl.load(q_ptr + offs_h[:, None] * stride_qh + offs_d[None, :],
                         mask=h_mask[:, None] & d_mask[None, :], other=0.0)
            codes = tl.load(row_ptr + offs_d[None, :], mask=valid[:, None] & d_mask[None, :], other=0)
            group_scale = e8m0_values(
                tl.load(pool_ptr + row_off + SCALE_AT + g0 // SCALE_GROUP, mask=valid, other=127).to(tl.int32))
            s += tl.dot(qc, tl.trans(_e4m3(codes).to(compute_ty)), input_precision=DOT_PREC) * group_scale[None, :]
        q_rope = tl.load(q_ptr + offs_h[:, None] * stride_qh + NOPE + offs_r[None, :],
                         mask=h_mask[:, None] & r_mask[None, :], other=0.0)
        k_rope = _rope_values(row_ptr, offs_r[None, :], valid[:, None] & r_mask[None, :], NOPE, ROPE_FMT, ALIGNED)
        s += tl.dot(q_rope, tl.trans(k_rope.to(compute_ty)), input_precision=DOT_PREC)
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        nope_mask = valid[:, None] & v_nope[None, :]
        codes = tl.load(row_ptr + offs_v[None, :], mask=nope_mask, other=0)
        scale_bytes = tl.load(row_ptr + SCALE_AT + offs_v[None, :] // SCALE_GROUP, mask=nope_mask, other=127)
        v = _e4m3(codes) * e8m0_values(scale_bytes.to(tl.int32))
        if dv_start + BLOCK_DV > NOPE:  # the tile reaches the RoPE values
            rope = _rope_values(row_ptr, (offs_v - NOPE)[None, :], valid[:, None] & v_rope[None, :], NOPE, ROPE_FMT,
                                ALIGNED)
            v = tl.where(v_rope[None, :], rope, v)
        acc = acc * alpha[:, None] + tl.dot(p.to(compute_ty), v.to(compute_ty), input_precision=DOT_PREC)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def sparse_attention_fp8_kernel(
    q_ptr, stride_qt, stride_qh,
    kv_ptr, stride_kv, kv_rows,
    idx_ptr, stride_it, n_idx,
    ekv_ptr, stride_ekv, ekv_rows,
    eidx_ptr, stride_eit, n_eidx,
    sink_ptr, out_ptr, stride_ot, stride_oh,
    H, scale,
    D: tl.constexpr, NOPE: tl.constexpr, SCALE_AT: tl.constexpr, ROPE_FMT: tl.constexpr, ALIGNED: tl.constexpr,
    HAS_EXTRA: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """:func:`~.triton_kernels.sparse_attention_kernel` over FP8 entries: one program per token, block of
    heads and block of the value's columns."""
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
    m_i, l_i, acc = _attend_fp8_rows(
        m_i, l_i, acc, q_t, stride_qh, offs_h, h_mask, kv_ptr, stride_kv, kv_rows,
        idx_ptr + t * stride_it, 0, n_idx, scale, dv_start,
        D, NOPE, SCALE_AT, ROPE_FMT, ALIGNED, BLOCK_H, BLOCK_K, BLOCK_R, BLOCK_DV, DOT_PREC,
    )
    if HAS_EXTRA:
        m_i, l_i, acc = _attend_fp8_rows(
            m_i, l_i, acc, q_t, stride_qh, offs_h, h_mask, ekv_ptr, stride_ekv, ekv_rows,
            eidx_ptr + t * stride_eit, 0, n_eidx, scale, dv_start,
            D, NOPE, SCALE_AT, ROPE_FMT, ALIGNED, BLOCK_H, BLOCK_K, BLOCK_R, BLOCK_DV, DOT_PREC,
        )
    out = acc / l_i[:, None]
    offs_v = dv_start + tl.arange(0, BLOCK_DV)
    tl.store(out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_v[None, :],
             out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & (offs_v < D)[None, :])


@triton.jit
def sparse_attention_fp8_split_kernel(
    q_ptr, stride_qt, stride_qh,
    kv_ptr, stride_kv, kv_rows,
    idx_ptr, stride_it, n_idx,
    ekv_ptr, stride_ekv, ekv_rows,
    eidx_ptr, stride_eit, n_eidx,
    m_ptr, l_ptr, part_ptr,
    H, scale, CHUNK, S,
    D: tl.constexpr, NOPE: tl.constexpr, SCALE_AT: tl.constexpr, ROPE_FMT: tl.constexpr, ALIGNED: tl.constexpr,
    HAS_EXTRA: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """:func:`~.triton_kernels.sparse_attention_split_kernel` over FP8 entries; merged by
    :func:`~.triton_kernels.sparse_attention_combine_kernel`."""
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
    m_i, l_i, acc = _attend_fp8_rows(
        m_i, l_i, acc, q_t, stride_qh, offs_h, h_mask, kv_ptr, stride_kv, kv_rows,
        idx_ptr + t * stride_it, tl.minimum(lo, n_idx), tl.minimum(hi, n_idx), scale, dv_start,
        D, NOPE, SCALE_AT, ROPE_FMT, ALIGNED, BLOCK_H, BLOCK_K, BLOCK_R, BLOCK_DV, DOT_PREC,
    )
    if HAS_EXTRA:
        m_i, l_i, acc = _attend_fp8_rows(
            m_i, l_i, acc, q_t, stride_qh, offs_h, h_mask, ekv_ptr, stride_ekv, ekv_rows,
            eidx_ptr + t * stride_eit, tl.minimum(tl.maximum(lo - n_idx, 0), n_eidx),
            tl.minimum(tl.maximum(hi - n_idx, 0), n_eidx), scale, dv_start,
            D, NOPE, SCALE_AT, ROPE_FMT, ALIGNED, BLOCK_H, BLOCK_K, BLOCK_R, BLOCK_DV, DOT_PREC,
        )
    row = (t * S + j) * H + offs_h
    tl.store(m_ptr + row, m_i, mask=h_mask)
    tl.store(l_ptr + row, l_i, mask=h_mask)
    offs_v = dv_start + tl.arange(0, BLOCK_DV)
    tl.store(part_ptr + row[:, None] * D + offs_v[None, :], acc, mask=h_mask[:, None] & (offs_v < D)[None, :])

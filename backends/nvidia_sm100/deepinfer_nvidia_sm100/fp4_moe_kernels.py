"""Triton kernels of ``moe_experts_fp4`` (imported lazily, like :mod:`.triton_kernels`): the grouped MoE
over (token, slot) pairs sorted by expert (:func:`~.triton_ops.expert_layout`, the bf16 MoE's layout:
each expert's run padded to ``BLOCK_M`` rows, one expert per M-block), reading the routed experts as
DeepSeek publishes them.

Weights: FP4 e2m1, two per byte along the input dim (input ``2j`` in the low nibble of byte ``j``, ``2j+1``
in the high one), one power-of-two scale per 32 inputs of a row, as ``float8_e8m0fnu`` bytes
(``2**(byte - 127)``) or float32. A K step of ``BLOCK_K`` inputs loads ``BLOCK_K / 2`` bytes of each weight
row and their scales, and decodes them in registers (:func:`e2m1_pair_values`: sign, exponent and mantissa
bits moved into a float16 bit pattern, no table) into two tiles: the even inputs (low nibbles) and the
odd inputs (high nibbles), each times its scale. The activations are loaded the same way, even and odd
columns apart, so the step is two dots ``a_even . w_even + a_odd . w_odd`` and nothing is interleaved.
e2m1 values times a power of two are exact in bfloat16 (2 significant bits), so the dot operands are the
reference's dequantised weights exactly; every dot accumulates in float32.

``QUANT_ACT`` (DeepSeek's numerics): the tokens enter already quantised (:func:`act_quant_ue8m0_kernel`:
E4M3 per ``ACT_BLOCK`` channels (V4: 128, V4.1: 32) with power-of-two scales, stored dequantised, where
E4M3 values times a power of two are exact in bfloat16), gate/up are rounded to the model dtype
(``ROUND``), the routing weight multiplies the SwiGLU output, which is rounded to the model dtype and
quantised the same way in the epilogue (one activation group per program: ``BLOCK_N`` = the group), and
the down projection's output is rounded to the model dtype. No dot operand is built from a reduction of
the same loop (see :mod:`.fp8_kernels`).

``PACKED=False``: the same kernels over experts held in a float dtype (DeepSeek's numerics on dequantised
or unquantised experts): the even and odd inputs of each K step are loaded apart from the weight rows
as they are, and the scale pointers are not read.
"""

from __future__ import annotations

import triton
import triton.language as tl

from deepinfer_nvidia_sm100.fp8_kernels import round_e4m3


@triton.jit
def e2m1_pair_values(byte):
    """Packed bytes (int32, 0..255) -> the values of their low and high e2m1 nibbles, in float32. A nibble's
    sign goes to bit 15 of a float16 pattern and its 3 magnitude bits (2 of exponent, 1 of mantissa) to bits
    11-9, the exponent's low bits and the mantissa's top bit: that float16 is the e2m1 value times 2^-14
    (code 1, a float16 subnormal, included), and both conversions after are exact. Four integer ops a
    nibble, no table and no select."""
    lo = ((byte & 7) << 9) | ((byte & 8) << 12)
    hi = ((byte & 0x70) << 5) | ((byte & 0x80) << 8)
    lo = lo.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = hi.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo * 16384.0, hi * 16384.0


@triton.jit
def e8m0_values(byte):
    """ue8m0 scale bytes (int32, 0..255) -> 2^(byte - 127) in float32 (byte 0: 2^-127, 255: NaN)."""
    bits = tl.where(byte == 0, 0x400000, tl.where(byte == 255, 0x7FC00000, byte << 23))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def round_to(x, ROUND: tl.constexpr):
    """float32 -> rounded to the model dtype (ROUND 1: bfloat16, 2: float16, else float32), as float32, to
    nearest even. bfloat16 by its bits (drop 16 of float32's 23 mantissa bits), as Triton 3.6's interpreter
    truncates a float32-to-bfloat16 cast: the same roundings under the interpreter as compiled."""
    if ROUND == 1:
        bits = x.to(tl.int32, bitcast=True)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    elif ROUND == 2:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def quant_e4m3_pow2(x, valid):
    """DeepSeek's act_quant with ue8m0 scales, simulated, for one channel group per row of ``x`` [M, group]
    (float32): s = 2^ceil(log2(max(amax, 1e-4) / 448)) (the IEEE quotient, then its exponent bits), x / s
    rounded to E4M3 (ties to even, saturating at 448), times s. Returns the dequantised values."""
    amax = tl.max(tl.where(valid, tl.abs(x), 0.0), 1)
    v = tl.math.div_rn(tl.maximum(amax, 1e-4), tl.full(amax.shape, 448.0, tl.float32))
    bits = v.to(tl.int32, bitcast=True)
    field = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)  # exponent field of s (ceil)
    scale = (field << 23).to(tl.float32, bitcast=True)
    inverse = ((254 - field) << 23).to(tl.float32, bitcast=True)  # 1 / s, exact
    q = round_e4m3(tl.minimum(tl.maximum(x * inverse[:, None], -448.0), 448.0))
    return q * scale[:, None]


@triton.jit
def fp4_tile(w_ptr, s_ptr, rows, stride_wn, stride_sn, k0, offs_j, K, n_mask, SCALE_E8M0: tl.constexpr):
    """Inputs ``k0 + 2j`` (low nibbles) and ``k0 + 2j + 1`` (high nibbles) of the weight rows ``rows`` [BN],
    j in ``offs_j`` [BKH]: two tiles [BKH, BN] of dequantised values in float32 (zero past K, which is even:
    a row holds K / 2 bytes). The byte offsets are written as ``k0 / 2 + j`` (``k0`` is a multiple of the
    block) so that the compiler sees BKH contiguous bytes per row and coalesces the load along them; the
    scales repeat over 16 bytes."""
    byte = k0 // 2 + offs_j
    mask = (byte < K // 2)[:, None] & n_mask[None, :]
    packed = tl.load(w_ptr + rows[None, :] * stride_wn + byte[:, None], mask=mask, other=0).to(tl.int32)
    s = tl.load(s_ptr + rows[None, :] * stride_sn + (k0 // 32 + offs_j // 16)[:, None], mask=mask, other=0)
    if SCALE_E8M0:
        scale = e8m0_values(s.to(tl.int32))
    else:
        scale = s.to(tl.float32)
    lo, hi = e2m1_pair_values(packed)
    return lo * scale, hi * scale


@triton.jit
def weight_tile(w_ptr, s_ptr, rows, stride_wn, stride_sn, k0, offs_j, K, n_mask,
                PACKED: tl.constexpr, SCALE_E8M0: tl.constexpr):
    """:func:`fp4_tile`, or (``PACKED=False``) the inputs ``k0 + 2j`` and ``k0 + 2j + 1`` of float weight rows
    as they are: two tiles [BKH, BN] (zero past K)."""
    if PACKED:
        lo, hi = fp4_tile(w_ptr, s_ptr, rows, stride_wn, stride_sn, k0, offs_j, K, n_mask, SCALE_E8M0)
    else:
        k_even = k0 + 2 * offs_j
        ptrs = w_ptr + rows[None, :] * stride_wn + k_even[:, None]
        lo = tl.load(ptrs, mask=(k_even < K)[:, None] & n_mask[None, :], other=0.0).to(tl.float32)
        hi = tl.load(ptrs + 1, mask=(k_even + 1 < K)[:, None] & n_mask[None, :], other=0.0).to(tl.float32)
    return lo, hi


@triton.jit
def act_quant_ue8m0_kernel(
    x_ptr, stride_xm, q_ptr, stride_qm, M, K,
    BLOCK_M: tl.constexpr, ACT_BLOCK: tl.constexpr,
):
    """q[m, g*ACT_BLOCK : (g+1)*ACT_BLOCK] = act_quant(x) dequantised (:func:`quant_e4m3_pow2`), one block of
    rows and one group g per program."""
    pid_m, g = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = g * ACT_BLOCK + tl.arange(0, ACT_BLOCK)
    m_mask = offs_m < M
    valid = m_mask[:, None] & (offs_k < K)[None, :]
    rows = tl.where(m_mask, offs_m, 0).to(tl.int64)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :], mask=valid, other=0.0).to(tl.float32)
    q = quant_e4m3_pow2(x, valid)
    tl.store(q_ptr + rows[:, None] * stride_qm + offs_k[None, :], q.to(q_ptr.dtype.element_ty), mask=valid)


@triton.jit
def moe_fp4_gate_up_kernel(
    x_ptr, stride_xt,
    w_ptr, stride_we, stride_wn,
    s_ptr, stride_se, stride_sn,
    sorted_ptr, block_expert_ptr, topk_w_ptr,
    h_ptr, stride_hm,
    num_pairs, TOP_K, D, I, limit,
    SCALE_E8M0: tl.constexpr, QUANT_ACT: tl.constexpr, ROUND: tl.constexpr, PACKED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """h[row] = swiglu(w13[e] . x[token of row]) for one M-block of rows of expert e and BLOCK_N channels of
    h (QUANT_ACT: rounded as DeepSeek's Expert, weighted by the routing weight and re-quantised)."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert >= 0:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ptr + offs_m)
        row_ok = pair < num_pairs
        token = tl.where(row_ok, pair // TOP_K, 0).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < I
        gate_rows = tl.where(n_mask, offs_n, 0).to(tl.int64)
        up_rows = gate_rows + I
        compute_ty = x_ptr.dtype.element_ty
        w_e = w_ptr + expert * stride_we
        s_e = s_ptr + expert * stride_se
        offs_j = tl.arange(0, BLOCK_K // 2)
        gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            k_even = k0 + 2 * offs_j
            a_ptrs = x_ptr + token[:, None] * stride_xt + k_even[None, :]
            a_lo = tl.load(a_ptrs, mask=row_ok[:, None] & (k_even < D)[None, :], other=0.0)
            a_hi = tl.load(a_ptrs + 1, mask=row_ok[:, None] & (k_even + 1 < D)[None, :], other=0.0)
            g_lo, g_hi = weight_tile(w_e, s_e, gate_rows, stride_wn, stride_sn, k0, offs_j, D, n_mask,
                                     PACKED, SCALE_E8M0)
            gate += tl.dot(a_lo, g_lo.to(compute_ty), input_precision=DOT_PREC)
            gate += tl.dot(a_hi, g_hi.to(compute_ty), input_precision=DOT_PREC)
            u_lo, u_hi = weight_tile(w_e, s_e, up_rows, stride_wn, stride_sn, k0, offs_j, D, n_mask,
                                     PACKED, SCALE_E8M0)
            up += tl.dot(a_lo, u_lo.to(compute_ty), input_precision=DOT_PREC)
            up += tl.dot(a_hi, u_hi.to(compute_ty), input_precision=DOT_PREC)
        if QUANT_ACT:
            gate = round_to(gate, ROUND)
            up = round_to(up, ROUND)
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        h = gate * tl.sigmoid(gate) * up
        valid = row_ok[:, None] & n_mask[None, :]
        if QUANT_ACT:
            safe_pair = tl.where(row_ok, pair, 0).to(tl.int64)
            weight = tl.load(topk_w_ptr + safe_pair, mask=row_ok, other=0.0).to(tl.float32)
            h = round_to(h * weight[:, None], ROUND)
            h = quant_e4m3_pow2(tl.where(valid, h, 0.0), valid)
        else:  # h is stored in the model dtype: rounded to nearest even there
            h = round_to(h, ROUND)
        tl.store(h_ptr + offs_m[:, None] * stride_hm + offs_n[None, :], h.to(h_ptr.dtype.element_ty), mask=valid)


@triton.jit
def moe_fp4_down_kernel(
    h_ptr, stride_hm,
    w_ptr, stride_we, stride_wn,
    s_ptr, stride_se, stride_sn,
    sorted_ptr, block_expert_ptr, topk_w_ptr,
    out_ptr, stride_op,
    num_pairs, D, I,
    SCALE_E8M0: tl.constexpr, QUANT_ACT: tl.constexpr, ROUND: tl.constexpr, PACKED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """out[pair] = w2[e] . h[row] for one M-block of rows of expert e, float32: times the routing weight
    (W4A16), or rounded to the model dtype (QUANT_ACT, whose h carries the weight)."""
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
        compute_ty = h_ptr.dtype.element_ty
        w_e = w_ptr + expert * stride_we
        s_e = s_ptr + expert * stride_se
        offs_j = tl.arange(0, BLOCK_K // 2)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            k_even = k0 + 2 * offs_j
            a_ptrs = h_ptr + offs_m[:, None] * stride_hm + k_even[None, :]
            a_lo = tl.load(a_ptrs, mask=row_ok[:, None] & (k_even < I)[None, :], other=0.0)
            a_hi = tl.load(a_ptrs + 1, mask=row_ok[:, None] & (k_even + 1 < I)[None, :], other=0.0)
            w_lo, w_hi = weight_tile(w_e, s_e, cols, stride_wn, stride_sn, k0, offs_j, I, n_mask,
                                     PACKED, SCALE_E8M0)
            acc += tl.dot(a_lo, w_lo.to(compute_ty), input_precision=DOT_PREC)
            acc += tl.dot(a_hi, w_hi.to(compute_ty), input_precision=DOT_PREC)
        if QUANT_ACT:
            acc = round_to(acc, ROUND)
        else:
            weight = tl.load(topk_w_ptr + safe_pair, mask=row_ok, other=0.0).to(tl.float32)
            acc = acc * weight[:, None]
        tl.store(out_ptr + safe_pair[:, None] * stride_op + offs_n[None, :], acc,
                 mask=row_ok[:, None] & n_mask[None, :])

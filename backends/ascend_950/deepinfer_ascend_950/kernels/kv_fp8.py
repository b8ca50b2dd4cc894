"""DeepSeek's FP8 KV entry for Ascend 950 (vector cores): quantise rows into entries, decode them back.

An entry (``deepinfer_core.quant.kv_fp8``): ``nope = head_dim - rope_dim`` E4M3 codes, the ``rope_dim``
RoPE values in ``rope_dtype``, one ue8m0 scale byte per 64 codes, zeros to a multiple of 8 bytes.

- :func:`kv_fp8_quant`: per row and group of 64, ``s = 2**ceil(log2(max(amax, 1e-4) / 448))`` from the
  float32 bits of ``amax / 448`` (as :mod:`.act_quant_sim`), the E4M3 cast of ``clamp(x / s, +-448)``, and
  the entry's tail: the scale bytes (``s``'s biased exponent) and the zero pad. The caller places the
  RoPE values' bytes between codes and tail.
- :func:`kv_fp8_dequant`: whole entries in, values out in ``dtype``: each E4M3 code decoded from its bits
  times ``2**(byte - 127)`` (the scale byte shifted into a float32's exponent), the RoPE values rebuilt
  from their little-endian bytes; exact, as the native decoding.
"""

import tilelang.ascend.language as T

from deepinfer_ascend_950.kernels.act_quant_sim import _pow2_ceil

FP32 = T.float32
U32 = T.uint32
E4M3 = "float8_e4m3"
GROUP = 64
QMAX, EPS = 448.0, 1e-4
ALIGN = 8
ROPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def group_width(nope: int) -> int:
    """Codes per scale group the kernels take: 64, or all of ``nope`` when it is shorter."""
    width = min(GROUP, nope)
    if nope <= 0 or nope % width or width % 16:
        raise ValueError(f"nope={nope} must be a multiple of {GROUP} or a multiple of 16 below it")
    return width


def entry_layout(head_dim: int, rope_dim: int, rope_dtype: str) -> tuple[int, int, int]:
    """``(rope_end, groups, entry_bytes)`` of an entry."""
    nope = head_dim - rope_dim
    groups = nope // group_width(nope)
    rope_end = nope + rope_dim * ROPE_BYTES[rope_dtype]
    return rope_end, groups, -(-(rope_end + groups) // ALIGN) * ALIGN


def kv_fp8_quant(head_dim: int, rope_dim: int, dtype: str = "bfloat16", block_m: int = 32, threads: int = 64):
    """``kv [N, head_dim] -> writes codes E4M3 [N, nope], tail uint8 [N, entry - rope_end]``, ``N`` dynamic."""
    nope = head_dim - rope_dim
    width = group_width(nope)
    rope_end, groups, entry = entry_layout(head_dim, rope_dim, dtype)
    tail_w = entry - rope_end
    rows = T.dynamic("rows")

    @T.prim_func
    def kv_fp8_quant_kernel(
        kv: T.Tensor[(rows, head_dim), dtype],
        codes: T.Tensor[(rows, nope), E4M3],
        tail: T.Tensor[(rows, tail_w), T.uint8],
    ):
        with T.Kernel(T.ceildiv(rows, block_m)) as bx:
            m0 = bx * block_m
            x_ub = T.alloc_shared((block_m, nope), dtype)
            codes_ub = T.alloc_shared((block_m, nope), E4M3)
            tail_ub = T.alloc_shared((block_m, tail_w), T.uint8)

            T.copy(kv[m0 : m0 + block_m, 0:nope], x_ub)
            with T.SimtVF(threads=threads):
                xf = T.alloc_fragment((block_m, width), FP32)
                amax = T.alloc_fragment((block_m,), FP32)
                scale = T.alloc_fragment((block_m,), FP32)
                for i in T.Parallel(block_m):
                    for j in range(groups, tail_w):  # the pad, byte by byte (no uint8 vectors in the VF)
                        tail_ub[i, j] = T.Cast(T.uint8, 0)
                for g in T.serial(groups):
                    for i, j in T.Parallel(block_m, width):
                        xf[i, j] = T.Cast(FP32, x_ub[i, g * width + j])
                    T.reduce_absmax(xf, amax, dim=1)
                    for i in T.Parallel(block_m):
                        scale[i] = _pow2_ceil(T.max(amax[i], EPS) / QMAX)
                        tail_ub[i, g] = T.Cast(T.uint8, T.bitwise_and(
                            T.shift_right(T.reinterpret(scale[i], U32), 23), 255))
                    for i, j in T.Parallel(block_m, width):
                        codes_ub[i, g * width + j] = T.Cast(E4M3, T.min(T.max(xf[i, j] / scale[i], -QMAX), QMAX))
            T.copy(codes_ub, codes[m0 : m0 + block_m, 0:nope])
            T.copy(tail_ub, tail[m0 : m0 + block_m, 0:tail_w])

    return kv_fp8_quant_kernel


def _byte(ub, i, j):
    return T.Cast(U32, ub[i, j])


def _e4m3(code):
    """The value of E4M3 ``code`` (its byte) as float32: ``(8 + m) * 2**(e - 10)``, subnormals
    ``m * 2**-9``, ``S.1111.111`` NaN, bit 7 the sign."""
    e = T.bitwise_and(T.shift_right(code, 3), 15)
    m = T.bitwise_and(code, 7)
    mag = T.Cast(FP32, m + T.if_then_else(e > 0, 8, 0)) * T.Cast(FP32, T.shift_left(1, T.max(e, 1))) * 2.0**-10
    mag = T.if_then_else(T.bitwise_and(code, 127) == 127, T.reinterpret(T.Cast(U32, 0x7FC00000), FP32), mag)
    return mag * T.if_then_else(code >= 128, -1.0, 1.0)  # -0.0 for 0x80


def _f16_bits(h):
    """A float16's bits ``h`` as float32: normals, infinities and NaNs by moving the fields, subnormals
    ``m * 2**-24``."""
    sign = T.shift_left(T.shift_right(h, 15), 31)
    e = T.bitwise_and(T.shift_right(h, 10), 31)
    m = T.bitwise_and(h, 1023)
    exp32 = T.if_then_else(e == 31, 255, e + 112)
    normal = T.reinterpret(T.bitwise_or(sign, T.bitwise_or(T.shift_left(exp32, 23), T.shift_left(m, 13))), FP32)
    sub = T.Cast(FP32, m) * 2.0**-24
    return T.if_then_else(e == 0, T.if_then_else(sign != 0, -sub, sub), normal)


def kv_fp8_dequant(head_dim: int, rope_dim: int, rope_dtype: str = "bfloat16", dtype: str = "bfloat16",
                   block_m: int = 32, threads: int = 64):
    """``entries uint8 [N, entry] -> writes out [N, head_dim]`` in ``dtype``, ``N`` dynamic."""
    nope = head_dim - rope_dim
    width = group_width(nope)
    rope_end, _, entry = entry_layout(head_dim, rope_dim, rope_dtype)
    rows = T.dynamic("rows")

    def rope_value(ub, i, r):
        if rope_dtype == "float32":
            b = [_byte(ub, i, nope + 4 * r + k) for k in range(4)]
            bits = T.bitwise_or(T.bitwise_or(b[0], T.shift_left(b[1], 8)),
                                T.bitwise_or(T.shift_left(b[2], 16), T.shift_left(b[3], 24)))
            return T.reinterpret(bits, FP32)
        h = T.bitwise_or(_byte(ub, i, nope + 2 * r), T.shift_left(_byte(ub, i, nope + 2 * r + 1), 8))
        return T.reinterpret(T.shift_left(h, 16), FP32) if rope_dtype == "bfloat16" else _f16_bits(h)

    @T.prim_func
    def kv_fp8_dequant_kernel(
        entries: T.Tensor[(rows, entry), T.uint8],
        out: T.Tensor[(rows, head_dim), dtype],
    ):
        with T.Kernel(T.ceildiv(rows, block_m)) as bx:
            m0 = bx * block_m
            ent_ub = T.alloc_shared((block_m, entry), T.uint8)
            out_ub = T.alloc_shared((block_m, head_dim), dtype)

            T.copy(entries[m0 : m0 + block_m, 0:entry], ent_ub)
            with T.SimtVF(threads=threads):
                for i, j in T.Parallel(block_m, nope):
                    scale = T.reinterpret(T.shift_left(_byte(ent_ub, i, rope_end + j // width), 23), FP32)
                    out_ub[i, j] = T.Cast(dtype, _e4m3(_byte(ent_ub, i, j)) * scale)
                for i, r in T.Parallel(block_m, rope_dim):
                    out_ub[i, nope + r] = T.Cast(dtype, rope_value(ent_ub, i, r))
            T.copy(out_ub, out[m0 : m0 + block_m, 0:head_dim])

    return kv_fp8_dequant_kernel

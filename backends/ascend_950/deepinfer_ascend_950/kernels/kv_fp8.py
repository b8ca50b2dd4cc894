"""DeepSeek's FP8 KV entry for Ascend 950 (vector cores): quantise rows into entries.

An entry (``deepinfer_core.model.kv_fp8``): ``nope = head_dim - rope_dim`` E4M3 codes, the ``rope_dim``
RoPE values in ``rope_dtype``, one ue8m0 scale byte per 64 codes, zeros to a multiple of 8 bytes.

- :func:`kv_fp8_quant`: per row and group of 64, ``s = 2**ceil(log2(max(amax, 1e-4) / 448))`` from the
  float32 bits of ``amax / 448`` (as :mod:`.act_quant_sim`), the E4M3 cast of ``clamp(x / s, +-448)``, and
  the entry's tail: the scale bytes (``s``'s biased exponent) and the zero pad. The caller places the
  RoPE values' bytes between codes and tail.
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


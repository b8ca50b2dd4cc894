"""Grouped GEMM over FP4 e2m1 expert weights for Ascend 950 (Cube + Vector).

``out[r] = x[r] . dequant(w[e])^T`` for every row ``r`` of a tile whose expert is ``e``: the caller
lays the rows out tile-major (``block_m`` rows per tile, each tile one expert's, padding rows zero)
and passes ``tile_expert [tiles]`` (``-1``: an unused tile, skipped). One kernel launch serves every
expert, with no count read back to the host.

Per ``block_m x block_n`` output tile and K block:

- Vector (each AIV half of the ``block_n`` weight rows, ``T.dual_copy``): the packed bytes (even
  element in the low nibble) and the row's e8m0 scales come from GM; each e2m1 code becomes its value
  (``0, 0.5, 1, 1.5, 2, 3, 4, 6``, bit 3 the sign) times ``2**(scale - 127)`` (the scale byte shifted
  into a float32's exponent), stored in the operand dtype: exact in bfloat16, whose 8 exponent bits
  hold every e8m0 scale, so a bf16 GEMM multiplies DeepSeek's exact weight values;
- Cube: the activations from GM and the dequantised tile from the Vector side in L1,
  ``C += x_tile . w_tile^T`` in float32 L0C over all of K.

The tile leaves L0C through ``T.dual_copy`` (each AIV half the rows) in ``out_dtype``. DeepSeek's W4A8
(E4M3 activations with power-of-two scales) is this GEMM on the dequantised activations, which are
exact in bfloat16 too: the products are DeepSeek's, only the float32 summation order differs.
"""

import tilelang.ascend.language as T

FP32 = T.float32
FP4_BLOCK = 32


def _e2m1(code):
    """The value of e2m1 ``code`` (0..15) as float32: magnitudes ``0, 0.5, 1, 1.5`` then
    ``(2 + m) * 2**(e - 2)`` (``e`` the two exponent bits, ``m`` the mantissa bit), bit 3 the sign."""
    mag = T.bitwise_and(code, 7)
    pow2 = T.Cast(FP32, T.shift_left(1, T.shift_right(mag, 1)))  # 2, 4, 8 for e = 1, 2, 3
    value = T.if_then_else(mag < 2, T.Cast(FP32, mag) * 0.5, T.Cast(FP32, 2 + T.bitwise_and(mag, 1)) * pow2 * 0.25)
    return T.if_then_else(code >= 8, -value, value)


def fp4_expert_gemm(n: int, k: int, dtype: str = "bfloat16", out_dtype: str = "bfloat16", block_m: int = 64,
                    block_n: int = 128, block_k: int = 128, num_cores: int = 32, threads: int = 64):
    """``(x [R, K], tile_expert int32 [R / block_m], w uint8 [E, N, K/2], w_scale uint8 (e8m0 bits)
    [E, N, K/32]) -> writes out [R, N]``; ``R`` (a multiple of ``block_m``) and ``E`` dynamic."""
    block_n, block_k = min(block_n, n), min(block_k, k)
    if k % block_k or block_k % FP4_BLOCK or block_n % 32 or block_m % 32:
        raise ValueError(f"k={k} must be a multiple of block_k={block_k} (a multiple of {FP4_BLOCK}); "
                         f"block_n={block_n} and block_m={block_m} multiples of 32")
    half_n, half_m = block_n // 2, block_m // 2
    k_blocks, n_blocks, groups = k // block_k, (n + block_n - 1) // block_n, k // FP4_BLOCK
    rows, experts = T.dynamic("rows"), T.dynamic("experts")
    tiles = T.ceildiv(rows, block_m)

    @T.prim_func
    def fp4_expert_gemm_kernel(
        x: T.Tensor[(rows, k), dtype],
        tile_expert: T.Tensor[(tiles,), T.int32],
        w: T.Tensor[(experts, n, k // 2), T.uint8],
        w_scale: T.Tensor[(experts, n, groups), T.uint8],
        out: T.Tensor[(rows, n), out_dtype],
    ):
        with T.MixedKernel(num_cores) as (core, sid):
            a_l1 = T.alloc_l1((block_m, block_k), dtype)
            b_l1 = T.alloc_l1((block_n, block_k), dtype)
            c_l0c = T.alloc_l0c((block_m, block_n), FP32)
            packed_ub = T.alloc_shared((half_n, block_k // 2), T.uint8)
            scale_ub = T.alloc_shared((half_n, groups), T.uint8)
            b_ub = T.alloc_shared((half_n, block_k), dtype)
            c_ub = T.alloc_shared((half_m, block_n), FP32)
            out_ub = T.alloc_shared((half_m, block_n), out_dtype)

            for tile in T.Persistent([tiles * n_blocks], num_cores, core):
                mt = tile // n_blocks
                n0 = (tile % n_blocks) * block_n
                e = tile_expert[mt]
                if e >= 0:
                    T.dual_copy(w_scale[e, n0 : n0 + block_n, 0:groups], scale_ub)
                    for kb in T.serial(k_blocks):
                        T.copy(x[mt * block_m : (mt + 1) * block_m, kb * block_k : (kb + 1) * block_k], a_l1)
                        T.dual_copy(w[e, n0 : n0 + block_n, kb * (block_k // 2) : (kb + 1) * (block_k // 2)],
                                    packed_ub)
                        with T.SimtVF(threads=threads):
                            for i, j in T.Parallel(half_n, block_k // 2):
                                byte = packed_ub[i, j]
                                scale = T.reinterpret(T.shift_left(
                                    T.Cast(T.uint32, scale_ub[i, (kb * block_k + 2 * j) // FP4_BLOCK]), 23), FP32)
                                b_ub[i, 2 * j] = T.Cast(dtype, _e2m1(T.bitwise_and(byte, 15)) * scale)
                                b_ub[i, 2 * j + 1] = T.Cast(dtype, _e2m1(T.shift_right(byte, 4)) * scale)
                        T.dual_copy(b_ub, b_l1)
                        T.gemm(a_l1, b_l1, c_l0c, transpose_B=True, clear_accum=kb == 0)
                    T.dual_copy(c_l0c, c_ub)
                    with T.SimtVF(threads=threads):
                        for i, j in T.Parallel(half_m, block_n):
                            out_ub[i, j] = T.Cast(out_dtype, c_ub[i, j])
                    T.dual_copy(out_ub, out[mt * block_m : (mt + 1) * block_m, n0 : n0 + block_n])

    return fp4_expert_gemm_kernel

"""Grouped block-FP8 expert GEMM for Ascend 950: :func:`.fp8_gemm.fp8_gemm` over expert tiles.

The caller lays the rows out tile-major (``block_m`` rows per tile, each tile one expert's, see
``grouping``) and passes ``tile_expert [tiles]`` (``-1``: unused, skipped); each tile reads its expert's
E4M3 weight and its ``[N/128, K/128]`` scales. One launch serves every expert, with nothing read back to
the host. Per K group the Cube multiplies the E4M3 tiles into float32 L0C, the AIVs (half the rows
each) add ``C * s_x[m, g] * s_w[e, n_block, g]`` to a float32 accumulator, as in ``fp8_gemm``.
"""

import tilelang.ascend.language as T

from deepinfer_ascend_950.kernels.fp8_gemm import BLOCK, E4M3, FP32


def fp8_expert_gemm(n: int, k: int, out_dtype: str = "float32", block_m: int = 64, num_cores: int = 32,
                    threads: int = 64):
    """``(q E4M3 [R, K], scales f32 [K/128, R], tile_expert int32 [R / block_m], w E4M3 [E, N, K],
    w_scales f32 [E, ceil(N/128), K/128]) -> writes out [R, N]``; ``R`` and ``E`` dynamic."""
    if k % BLOCK or block_m % 32:
        raise ValueError(f"k={k} must be a multiple of {BLOCK} and block_m={block_m} of 32")
    groups, n_blocks = k // BLOCK, (n + BLOCK - 1) // BLOCK
    half = block_m // 2
    rows, experts = T.dynamic("rows"), T.dynamic("experts")
    tiles = T.ceildiv(rows, block_m)

    @T.prim_func
    def fp8_expert_gemm_kernel(
        q: T.Tensor[(rows, k), E4M3],
        scales: T.Tensor[(groups, rows), FP32],
        tile_expert: T.Tensor[(tiles,), T.int32],
        w: T.Tensor[(experts, n, k), E4M3],
        w_scales: T.Tensor[(experts, n_blocks, groups), FP32],
        out: T.Tensor[(rows, n), out_dtype],
    ):
        with T.MixedKernel(num_cores) as (core, sid):
            a_l1 = T.alloc_l1((block_m, BLOCK), E4M3)
            b_l1 = T.alloc_l1((BLOCK, BLOCK), E4M3)
            c_l0c = T.alloc_l0c((block_m, BLOCK), FP32)
            c_ub = T.alloc_shared((half, BLOCK), FP32)
            acc_ub = T.alloc_shared((half, BLOCK), FP32)
            sx_ub = T.alloc_shared((1, half), FP32)
            sw_ub = T.alloc_shared((1, groups), FP32)
            out_ub = T.alloc_shared((half, BLOCK), out_dtype)

            for tile in T.Persistent([tiles * n_blocks], num_cores, core):
                mt = tile // n_blocks
                nb = tile % n_blocks
                m0 = mt * block_m
                e = tile_expert[mt]
                if e >= 0:
                    T.copy(w_scales[e, nb : nb + 1, 0:groups], sw_ub)
                    with T.SimtVF(threads=threads):
                        for i, j in T.Parallel(half, BLOCK):
                            acc_ub[i, j] = 0.0
                    for g in T.serial(groups):
                        T.copy(q[m0 : m0 + block_m, g * BLOCK : (g + 1) * BLOCK], a_l1)
                        T.copy(w[e, nb * BLOCK : (nb + 1) * BLOCK, g * BLOCK : (g + 1) * BLOCK], b_l1)
                        T.dual_copy(scales[g : g + 1, m0 : m0 + block_m], sx_ub)
                        T.gemm(a_l1, b_l1, c_l0c, transpose_B=True, clear_accum=True)
                        T.dual_copy(c_l0c, c_ub)
                        with T.SimtVF(threads=threads):
                            for i, j in T.Parallel(half, BLOCK):
                                acc_ub[i, j] = acc_ub[i, j] + c_ub[i, j] * (sx_ub[0, i] * sw_ub[0, g])
                    with T.SimtVF(threads=threads):
                        for i, j in T.Parallel(half, BLOCK):
                            out_ub[i, j] = T.Cast(out_dtype, acc_ub[i, j])
                    T.dual_copy(out_ub, out[m0 : m0 + block_m, nb * BLOCK : (nb + 1) * BLOCK])

    return fp8_expert_gemm_kernel

"""DeepSeek's block-FP8 linear for Ascend 950: activation quantisation and the scaled E4M3 GEMM.

- :func:`act_quant_fp8` (vector cores): per row and 128-channel group, ``s = max(amax |x|, 1e-4) / 448``
  and ``q = e4m3(clamp(x / s, +-448))``; the scales are written group-major (``[G, M]``) so that each
  core stores whole 32-byte rows.
- :func:`fp8_gemm` (Cube + Vector): one ``block_m x 128`` output tile per persistent iteration; per K
  group the Cube multiplies the E4M3 tiles into float32 L0C, ``T.dual_copy`` gives each AIV half of the
  rows, which adds ``C * s_x[m, g] * s_w[n_block, g]`` to its float32 accumulator; the tile is stored in
  the output dtype. ``K`` must be a multiple of 128 (the caller pads with zeros).
"""

import tilelang.ascend.language as T

FP32 = T.float32
E4M3 = "float8_e4m3"
BLOCK = 128
FP8_MAX = 448.0
AMAX_EPS = 1e-4


def act_quant_fp8(dim: int, dtype: str = "bfloat16", block_m: int = 8, threads: int = 64):
    """``x [M, K] -> writes q E4M3 [M, K], scales f32 [K / 128, M]``, ``M`` dynamic."""
    if dim % BLOCK or block_m % 8:
        raise ValueError(f"dim={dim} must be a multiple of {BLOCK} and block_m={block_m} of 8")
    groups = dim // BLOCK
    rows = T.dynamic("rows")

    @T.prim_func
    def act_quant_fp8_kernel(
        x: T.Tensor[(rows, dim), dtype],
        q: T.Tensor[(rows, dim), E4M3],
        scales: T.Tensor[(groups, rows), FP32],
    ):
        with T.Kernel(T.ceildiv(rows, block_m) * groups) as bx:
            m0 = (bx // groups) * block_m
            g = bx % groups
            x_ub = T.alloc_shared((block_m, BLOCK), dtype)
            q_ub = T.alloc_shared((block_m, BLOCK), E4M3)
            s_ub = T.alloc_shared((1, block_m), FP32)

            T.copy(x[m0 : m0 + block_m, g * BLOCK : (g + 1) * BLOCK], x_ub)
            with T.SimtVF(threads=threads):
                xf = T.alloc_fragment((block_m, BLOCK), FP32)
                amax = T.alloc_fragment((block_m,), FP32)
                for i, j in T.Parallel(block_m, BLOCK):
                    xf[i, j] = T.Cast(FP32, x_ub[i, j])
                T.reduce_absmax(xf, amax, dim=1)
                for i in T.Parallel(block_m):
                    s_ub[0, i] = T.max(amax[i], AMAX_EPS) / FP8_MAX
                for i, j in T.Parallel(block_m, BLOCK):
                    q_ub[i, j] = T.Cast(E4M3, T.min(T.max(xf[i, j] / s_ub[0, i], -FP8_MAX), FP8_MAX))
            T.copy(q_ub, q[m0 : m0 + block_m, g * BLOCK : (g + 1) * BLOCK])
            T.copy(s_ub, scales[g : g + 1, m0 : m0 + block_m])

    return act_quant_fp8_kernel


def fp8_gemm(n: int, k: int, out_dtype: str = "bfloat16", block_m: int = 64, num_cores: int = 32,
             threads: int = 64):
    """``(q E4M3 [M, K], scales f32 [K/128, M], w E4M3 [N, K], w_scales f32 [ceil(N/128), K/128])
    -> writes out [M, N]``, ``M`` dynamic."""
    if k % BLOCK or block_m % 32:
        raise ValueError(f"k={k} must be a multiple of {BLOCK} and block_m={block_m} of 32")
    groups, n_blocks = k // BLOCK, (n + BLOCK - 1) // BLOCK
    half = block_m // 2
    rows = T.dynamic("rows")
    tiles = T.ceildiv(rows, block_m) * n_blocks

    @T.prim_func
    def fp8_gemm_kernel(
        q: T.Tensor[(rows, k), E4M3],
        scales: T.Tensor[(groups, rows), FP32],
        w: T.Tensor[(n, k), E4M3],
        w_scales: T.Tensor[(n_blocks, groups), FP32],
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

            for tile in T.Persistent([tiles], num_cores, core):
                m0 = (tile // n_blocks) * block_m
                nb = tile % n_blocks
                T.copy(w_scales[nb : nb + 1, 0:groups], sw_ub)
                with T.SimtVF(threads=threads):
                    for i, j in T.Parallel(half, BLOCK):
                        acc_ub[i, j] = 0.0
                for g in T.serial(groups):
                    T.copy(q[m0 : m0 + block_m, g * BLOCK : (g + 1) * BLOCK], a_l1)
                    T.copy(w[nb * BLOCK : (nb + 1) * BLOCK, g * BLOCK : (g + 1) * BLOCK], b_l1)
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

    return fp8_gemm_kernel

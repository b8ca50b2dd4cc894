"""mHC stream mixing for Ascend 950 on the vector cores: ``hc_post`` and the collapse of ``hc_head``.

Both run one core block per (token, ``block_d`` channels), in float32, results in the streams' dtype:

- :func:`hc_post`: ``new[k, d] = post[k] * block_out[d] + sum_j comb[j, k] * streams[j, d]`` (the ``j``
  sum in a serial loop, ``n`` terms in order);
- :func:`hc_head_collapse`: ``pre[i] = sigmoid(mixes[i] * scale + base[i]) + eps``, then
  ``out[d] = sum_i pre[i] * streams[i, d]``; the mixes GEMM ``fn . rmsnorm(flatten(streams))`` runs in
  torch before it.

``post``/``mixes`` rows of ``n`` float32 values are copied into 8-value UB rows (32-byte aligned).
"""

import tilelang.ascend.language as T

FP32 = T.float32
ROW = 8  # float32 values per 32 bytes


def _tiles(dim: int, block_d: int) -> int:
    if dim % block_d or block_d % 16:
        raise ValueError(f"dim={dim} must be a multiple of block_d={block_d} (itself of 16)")
    return dim // block_d


def hc_post(hc: int, dim: int, dtype: str = "bfloat16", block_d: int = 256, threads: int = 64):
    """``(block_out [T, D], streams [T, n, D], post f32 [T, n], comb f32 [T, n, n]) -> writes
    out [T, n, D]``, ``T`` dynamic."""
    block_d = min(block_d, dim)
    tiles = _tiles(dim, block_d)
    if not 1 <= hc <= ROW:
        raise ValueError(f"hc={hc} must be in 1..{ROW}")
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def hc_post_kernel(
        block_out: T.Tensor[(num_tokens, dim), dtype],
        streams: T.Tensor[(num_tokens, hc, dim), dtype],
        post: T.Tensor[(num_tokens, hc), FP32],
        comb: T.Tensor[(num_tokens, hc, hc), FP32],
        out: T.Tensor[(num_tokens, hc, dim), dtype],
    ):
        with T.Kernel(num_tokens * tiles) as bx:
            t = bx // tiles
            d0 = (bx % tiles) * block_d
            x_ub = T.alloc_shared((block_d,), dtype)
            s_ub = T.alloc_shared((hc, block_d), dtype)
            post_ub = T.alloc_shared((ROW,), FP32)
            comb_ub = T.alloc_shared((hc, hc), FP32)
            out_ub = T.alloc_shared((hc, block_d), dtype)

            T.copy(block_out[t, d0 : d0 + block_d], x_ub)
            T.copy(streams[t, 0:hc, d0 : d0 + block_d], s_ub)
            T.copy(post[t, 0:hc], post_ub[0:hc])
            T.copy(comb[t, 0:hc, 0:hc], comb_ub)
            with T.SimtVF(threads=threads):
                acc = T.alloc_fragment((hc, block_d), FP32)
                for k, d in T.Parallel(hc, block_d):
                    acc[k, d] = post_ub[k] * T.Cast(FP32, x_ub[d])
                for j in T.serial(hc):
                    for k, d in T.Parallel(hc, block_d):
                        acc[k, d] = acc[k, d] + comb_ub[j, k] * T.Cast(FP32, s_ub[j, d])
                for k, d in T.Parallel(hc, block_d):
                    out_ub[k, d] = T.Cast(dtype, acc[k, d])
            T.copy(out_ub, out[t, 0:hc, d0 : d0 + block_d])

    return hc_post_kernel


def hc_head_collapse(hc: int, dim: int, eps: float, dtype: str = "bfloat16", block_d: int = 256,
                     threads: int = 64):
    """``(mixes f32 [T, n], scale f32 [1], base f32 [n], streams [T, n, D]) -> writes out [T, D]``,
    ``T`` dynamic."""
    block_d = min(block_d, dim)
    tiles = _tiles(dim, block_d)
    if not 1 <= hc <= ROW:
        raise ValueError(f"hc={hc} must be in 1..{ROW}")
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def hc_head_collapse_kernel(
        mixes: T.Tensor[(num_tokens, hc), FP32],
        scale: T.Tensor[(1,), FP32],
        base: T.Tensor[(hc,), FP32],
        streams: T.Tensor[(num_tokens, hc, dim), dtype],
        out: T.Tensor[(num_tokens, dim), dtype],
    ):
        with T.Kernel(num_tokens * tiles) as bx:
            t = bx // tiles
            d0 = (bx % tiles) * block_d
            mix_ub = T.alloc_shared((ROW,), FP32)
            base_ub = T.alloc_shared((ROW,), FP32)
            scale_ub = T.alloc_shared((ROW,), FP32)
            pre_ub = T.alloc_shared((ROW,), FP32)
            s_ub = T.alloc_shared((hc, block_d), dtype)
            out_ub = T.alloc_shared((block_d,), dtype)

            T.copy(mixes[t, 0:hc], mix_ub[0:hc])
            T.copy(base, base_ub[0:hc])
            T.copy(scale, scale_ub[0:1])
            T.copy(streams[t, 0:hc, d0 : d0 + block_d], s_ub)
            with T.SimtVF(threads=threads):
                acc = T.alloc_fragment((block_d,), FP32)
                for i in T.Parallel(hc):
                    pre_ub[i] = T.sigmoid(mix_ub[i] * scale_ub[0] + base_ub[i]) + eps
                for d in T.Parallel(block_d):
                    acc[d] = 0.0
                for i in T.serial(hc):
                    for d in T.Parallel(block_d):
                        acc[d] = acc[d] + pre_ub[i] * T.Cast(FP32, s_ub[i, d])
                for d in T.Parallel(block_d):
                    out_ub[d] = T.Cast(dtype, acc[d])
            T.copy(out_ub, out[t, d0 : d0 + block_d])

    return hc_head_collapse_kernel

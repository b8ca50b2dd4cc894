"""mHC pre-mix split and Sinkhorn normalisation (the vector part of ``hc_pre``) for Ascend 950.

Given the mixes ``m = fn . rmsnorm(flatten(streams))`` of ``token_block`` tokens per core, the kernel
computes on the vector cores (one SIMT region, ``threads`` lanes):

- ``pre = sigmoid(m[:n] * s0 + b[:n]) + eps`` and ``post = 2 sigmoid(m[n:2n] * s1 + b[n:2n])``;
- ``comb = softmax_rows(m[2n:] * s2 + b[2n:]) + eps``, normalised by column sums, then
  ``sinkhorn_iters - 1`` times by row sums and by column sums (``x / (sum + eps)`` each time),

exactly the order of the catalogue's ``hc_pre`` (and of DeepSeek's ``hc_split_sinkhorn``). The GEMM that
produces the mixes and the weighted collapse of the streams stay outside (torch on the NPU).
The last token block may be partial: TileLang clamps its GM copies, so padded rows are computed in the
Unified Buffer but never stored.
"""

import tilelang.ascend.language as T

FP32 = T.float32


def hc_split_sinkhorn(hc: int, sinkhorn_iters: int, eps: float, token_block: int = 8, threads: int = 64):
    """``(mixes [T, (2+hc)hc], scale [3], base [(2+hc)hc]) -> writes pre [T, hc], post [T, hc],
    comb [T, hc, hc]`` (all float32), ``T`` dynamic."""
    if hc < 1 or sinkhorn_iters < 1 or token_block < 1:
        raise ValueError(f"hc={hc}, sinkhorn_iters={sinkhorn_iters} and token_block={token_block} must be >= 1")
    mix = (2 + hc) * hc
    tb = token_block
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def hc_split_sinkhorn_kernel(
        mixes: T.Tensor[(num_tokens, mix), FP32],
        scale: T.Tensor[(3,), FP32],
        base: T.Tensor[(mix,), FP32],
        pre: T.Tensor[(num_tokens, hc), FP32],
        post: T.Tensor[(num_tokens, hc), FP32],
        comb: T.Tensor[(num_tokens, hc, hc), FP32],
    ):
        with T.Kernel(T.ceildiv(num_tokens, tb)) as bx:
            mix_ub = T.alloc_shared((tb, mix), FP32)
            base_ub = T.alloc_shared((mix,), FP32)
            scale_ub = T.alloc_shared((8,), FP32)  # 3 used; 32-byte aligned
            pre_ub = T.alloc_shared((tb, hc), FP32)
            post_ub = T.alloc_shared((tb, hc), FP32)
            comb_ub = T.alloc_shared((tb, hc, hc), FP32)
            row_max = T.alloc_shared((tb, hc), FP32)
            row_sum = T.alloc_shared((tb, hc), FP32)
            col_sum = T.alloc_shared((tb, hc), FP32)

            T.copy(mixes[bx * tb, 0], mix_ub)
            T.copy(base, base_ub)
            T.copy(scale, scale_ub[0:3])
            with T.SimtVF(threads=threads):
                c = T.alloc_fragment((tb, hc, hc), FP32)
                for t, j in T.Parallel(tb, hc):
                    pre_ub[t, j] = T.sigmoid(mix_ub[t, j] * scale_ub[0] + base_ub[j]) + eps
                    post_ub[t, j] = 2 * T.sigmoid(mix_ub[t, hc + j] * scale_ub[1] + base_ub[hc + j])
                for t, j, k in T.Parallel(tb, hc, hc):
                    c[t, j, k] = mix_ub[t, 2 * hc + j * hc + k] * scale_ub[2] + base_ub[2 * hc + j * hc + k]
                # softmax over each row, + eps
                T.reduce_max(c, row_max, dim=2)
                for t, j, k in T.Parallel(tb, hc, hc):
                    c[t, j, k] = T.exp(c[t, j, k] - row_max[t, j])
                T.reduce_sum(c, row_sum, dim=2)
                for t, j, k in T.Parallel(tb, hc, hc):
                    c[t, j, k] = c[t, j, k] / row_sum[t, j] + eps
                # column normalisation, then (row, column) x (iters - 1)
                T.reduce_sum(c, col_sum, dim=1)
                for t, j, k in T.Parallel(tb, hc, hc):
                    c[t, j, k] = c[t, j, k] / (col_sum[t, k] + eps)
                for _ in T.serial(sinkhorn_iters - 1):
                    T.reduce_sum(c, row_sum, dim=2)
                    for t, j, k in T.Parallel(tb, hc, hc):
                        c[t, j, k] = c[t, j, k] / (row_sum[t, j] + eps)
                    T.reduce_sum(c, col_sum, dim=1)
                    for t, j, k in T.Parallel(tb, hc, hc):
                        c[t, j, k] = c[t, j, k] / (col_sum[t, k] + eps)
                T.copy(c, comb_ub)
            T.copy(pre_ub, pre[bx * tb, 0])
            T.copy(post_ub, post[bx * tb, 0])
            T.copy(comb_ub, comb[bx * tb, 0, 0])

    return hc_split_sinkhorn_kernel

"""Lightning-indexer scores (the kernel part of ``indexer_topk``) for Ascend 950 (Cube + Vector).

One query token per persistent iteration of a core. The caller gathers the token's candidate keys into
``rows [T, C, d]`` (``-1`` candidates as zero rows, ``C`` padded to whole blocks with ``-1``) and passes
the per-head weights already multiplied by the op's scale. Per block of ``block_c`` candidates:

- Cube: ``S = Q . rows^T`` (``Q [H, d]`` in L1, float32 in L0C);
- Vector: ``T.dual_copy`` splits ``S`` by candidates (N-split), so each AIV holds all heads of half the
  block: ``score[c] = sum_h relu(S[h, c]) * w[h]``, ``-inf`` where the candidate is ``-1``, stored to
  ``scores [T, C]`` (float32). The top-k selection over the scores runs in torch on the NPU.
"""

import tilelang.ascend.language as T

FP32 = T.float32


def indexer_scores(heads: int, dim: int, block_c: int = 64, num_cores: int = 32, dtype: str = "bfloat16",
                   threads: int = 64):
    """``(q [T, H, d], rows [T, C, d], indices int32 [T, C], weights f32 [T, H]) -> writes
    scores f32 [T, C]``, ``T`` and ``C`` dynamic (``C`` a multiple of ``block_c``)."""
    if heads % 16 or dim % 16 or block_c % 64:
        raise ValueError(f"heads ({heads}) and dim ({dim}) must be multiples of 16 and block_c ({block_c}) of 64")
    half = block_c // 2  # candidates per vector core
    num_tokens = T.dynamic("num_tokens")
    width = T.dynamic("width")
    num_blocks = T.ceildiv(width, block_c)

    @T.prim_func
    def indexer_scores_kernel(
        q: T.Tensor[(num_tokens, heads, dim), dtype],
        rows: T.Tensor[(num_tokens, width, dim), dtype],
        indices: T.Tensor[(num_tokens, width), T.int32],
        weights: T.Tensor[(num_tokens, heads), FP32],
        scores: T.Tensor[(num_tokens, width), FP32],
    ):
        with T.MixedKernel(num_cores) as (core, sid):
            q_l1 = T.alloc_l1((heads, dim), dtype)
            k_l1 = T.alloc_l1((block_c, dim), dtype)
            s_l0c = T.alloc_l0c((heads, block_c), FP32)
            s_ub = T.alloc_shared((heads, half), FP32)
            w_ub = T.alloc_shared((heads,), FP32)
            idx_ub = T.alloc_shared((1, half), T.int32)
            out_ub = T.alloc_shared((1, half), FP32)

            for t in T.Persistent([num_tokens], num_cores, core):
                T.copy(q[t, 0, 0], q_l1)
                T.copy(weights[t, 0], w_ub)
                for b in T.serial(num_blocks):
                    T.copy(rows[t, b * block_c : (b + 1) * block_c, 0:dim], k_l1)
                    T.dual_copy(indices[t : t + 1, b * block_c : (b + 1) * block_c], idx_ub)
                    T.gemm(q_l1, k_l1, s_l0c, transpose_B=True, clear_accum=True)
                    T.dual_copy(s_l0c, s_ub)
                    with T.SimtVF(threads=threads):
                        total = T.alloc_fragment((half,), FP32)
                        for h, c in T.Parallel(heads, half):
                            s_ub[h, c] = T.max(s_ub[h, c], 0.0) * w_ub[h]
                        T.reduce_sum(s_ub, total, dim=0)
                        for c in T.Parallel(half):
                            out_ub[0, c] = T.if_then_else(idx_ub[0, c] >= 0, total[c], -T.infinity(FP32))
                    T.dual_copy(out_ub, scores[t : t + 1, b * block_c : (b + 1) * block_c])

    return indexer_scores_kernel

"""Shared-KV sparse attention with per-head sinks for Ascend 950 (Cube + Vector, auto-scheduled).

One query token per persistent iteration of a core. The caller gathers the token's selected rows
(window and compressed/indexed, ``-1`` slots as zero rows) into ``rows [T, K, D]`` and passes the
indices for the validity mask; ``K`` (dynamic: one kernel serves every length) must be a multiple of
``block_k``, the caller pads with ``-1``. Per block of ``block_k``
rows:

- Cube: ``S = Q . rows^T`` (``Q [H, D]`` in L1, float32 in L0C) and, after the softmax,
  ``O_blk = P . rows`` (the rows loaded a second time transposed, as the Cube's L1 GEMM takes NT only);
- Vector (each of the two AIVs owns ``H / 2`` heads, ``T.dual_copy`` splits L0C between them): mask
  ``index < 0`` to ``-inf``, scale, online softmax ``m' = max(m, rowmax)``, ``alpha = exp(m - m')``,
  ``P = exp(S - m')`` (stored bf16 for the Cube), ``l = l alpha + sum P``, ``acc = acc alpha + O_blk``.

The sink enters as the softmax's initial state: ``m = sink[h]``, ``l = 1`` (``exp(sink - m)``), so it
only adds to the denominator and a token with no valid row returns zeros, as the catalogue says.
Output ``acc / l`` in the input dtype.
"""

import tilelang.ascend.language as T

FP32 = T.float32


def sparse_attention_sinks(
    heads: int,
    head_dim: int,
    scale: float,
    block_k: int = 64,
    num_cores: int = 32,
    dtype: str = "bfloat16",
    threads: int = 64,
):
    """``(q [T, H, D], rows [T, K, D], indices int32 [T, K], sinks f32 [H]) -> writes out [T, H, D]``,
    ``T`` and ``K`` dynamic."""
    if heads % 16 or head_dim % 16:
        raise ValueError(f"heads ({heads}) and head_dim ({head_dim}) must be multiples of 16 (Cube fractals); "
                         "pad the heads")
    half = heads // 2  # heads per vector core (two AIVs per Cube core)
    num_tokens = T.dynamic("num_tokens")
    topk = T.dynamic("topk")  # rows per token: any multiple of block_k, one compiled kernel for all
    num_blocks = T.ceildiv(topk, block_k)

    @T.prim_func
    def sparse_attention_sinks_kernel(
        q: T.Tensor[(num_tokens, heads, head_dim), dtype],
        rows: T.Tensor[(num_tokens, topk, head_dim), dtype],
        indices: T.Tensor[(num_tokens, topk), T.int32],
        sinks: T.Tensor[(heads,), FP32],
        out: T.Tensor[(num_tokens, heads, head_dim), dtype],
    ):
        with T.MixedKernel(num_cores) as (core, sid):
            q_l1 = T.alloc_l1((heads, head_dim), dtype)
            k_l1 = T.alloc_l1((block_k, head_dim), dtype)
            vt_l1 = T.alloc_l1((head_dim, block_k), dtype)
            p_l1 = T.alloc_l1((heads, block_k), dtype)
            s_l0c = T.alloc_l0c((heads, block_k), FP32)
            o_l0c = T.alloc_l0c((heads, head_dim), FP32)
            s_ub = T.alloc_shared((half, block_k), FP32)
            p_ub = T.alloc_shared((half, block_k), dtype)
            o_blk_ub = T.alloc_shared((half, head_dim), FP32)
            acc_ub = T.alloc_shared((half, head_dim), FP32)
            out_ub = T.alloc_shared((half, head_dim), dtype)
            idx_ub = T.alloc_shared((block_k,), T.int32)
            sink_ub = T.alloc_shared((heads,), FP32)
            m_ub = T.alloc_shared((half,), FP32)
            l_ub = T.alloc_shared((half,), FP32)
            alpha_ub = T.alloc_shared((half,), FP32)

            for t in T.Persistent([num_tokens], num_cores, core):
                T.copy(q[t, 0, 0], q_l1)
                T.copy(sinks, sink_ub)
                with T.SimtVF(threads=threads):
                    for h, d in T.Parallel(half, head_dim):
                        acc_ub[h, d] = 0
                    for h in T.Parallel(half):
                        m_ub[h] = sink_ub[sid * half + h]
                        l_ub[h] = 1.0
                for b in T.serial(num_blocks):
                    T.copy(rows[t, b * block_k : (b + 1) * block_k, 0:head_dim], k_l1)
                    T.copy(rows[t, b * block_k : (b + 1) * block_k, 0:head_dim], vt_l1, transpose=True)
                    T.copy(indices[t, b * block_k], idx_ub)
                    T.gemm(q_l1, k_l1, s_l0c, transpose_B=True, clear_accum=True)
                    T.dual_copy(s_l0c, s_ub)
                    with T.SimtVF(threads=threads):
                        block_max = T.alloc_fragment((half,), FP32)
                        block_sum = T.alloc_fragment((half,), FP32)
                        for h, k in T.Parallel(half, block_k):
                            s_ub[h, k] = T.if_then_else(idx_ub[k] >= 0, s_ub[h, k] * scale, -T.infinity(FP32))
                        T.reduce_max(s_ub, block_max, dim=1, clear=True)
                        for h in T.Parallel(half):
                            block_max[h] = T.max(block_max[h], m_ub[h])
                            alpha_ub[h] = T.exp(m_ub[h] - block_max[h])
                            m_ub[h] = block_max[h]
                        for h, k in T.Parallel(half, block_k):
                            s_ub[h, k] = T.exp(s_ub[h, k] - m_ub[h])
                        T.reduce_sum(s_ub, block_sum, dim=1)
                        for h in T.Parallel(half):
                            l_ub[h] = l_ub[h] * alpha_ub[h] + block_sum[h]
                        for h, k in T.Parallel(half, block_k):
                            p_ub[h, k] = s_ub[h, k]
                    T.dual_copy(p_ub, p_l1)
                    T.gemm(p_l1, vt_l1, o_l0c, transpose_B=True, clear_accum=True)
                    T.dual_copy(o_l0c, o_blk_ub)
                    with T.SimtVF(threads=threads):
                        for h, d in T.Parallel(half, head_dim):
                            acc_ub[h, d] = acc_ub[h, d] * alpha_ub[h] + o_blk_ub[h, d]
                with T.SimtVF(threads=threads):
                    for h, d in T.Parallel(half, head_dim):
                        out_ub[h, d] = acc_ub[h, d] / l_ub[h]
                T.dual_copy(out_ub, out[t, 0:heads, 0:head_dim])

    return sparse_attention_sinks_kernel

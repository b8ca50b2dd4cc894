"""DeepSeek-V4's ``sqrtsoftplus`` router scores for Ascend 950 (vector cores).

``scores = sqrt(softplus(logits))`` per token and expert, rounded as torch rounds it on ``dtype``
inputs: ``softplus`` (``x`` above 20, else ``log1p(exp(x))``) in float32 rounded to ``dtype``, its
square root in float32 rounded again. ``log1p(y)`` is ``log(u) * y / (u - 1)`` with ``u = 1 + y``
(``y`` where ``u`` rounds to 1), accurate to a few ulps without a ``log1p`` instruction; ``u`` goes
through a fragment so that the compiler's simplifier cannot fold ``u - 1`` back into ``y``. The top-k and
the weights stay in torch (the native body's steps, so ties and normalisation are the same).
"""

import tilelang.ascend.language as T

FP32 = T.float32
SOFTPLUS_THRESHOLD = 20.0


def sqrt_softplus(experts: int, dtype: str = "bfloat16", block_t: int = 8, threads: int = 64):
    """``logits [T, experts] -> writes scores [T, experts]`` in ``dtype``, ``T`` dynamic."""
    if experts % 16 or block_t % 8:
        raise ValueError(f"experts={experts} must be a multiple of 16 and block_t={block_t} of 8")
    tokens = T.dynamic("tokens")

    @T.prim_func
    def sqrt_softplus_kernel(logits: T.Tensor[(tokens, experts), dtype], scores: T.Tensor[(tokens, experts), dtype]):
        with T.Kernel(T.ceildiv(tokens, block_t)) as bx:
            x_ub = T.alloc_shared((block_t, experts), dtype)
            s_ub = T.alloc_shared((block_t, experts), dtype)
            T.copy(logits[bx * block_t, 0], x_ub)
            with T.SimtVF(threads=threads):
                u = T.alloc_fragment((block_t, experts), FP32)
                for i, e in T.Parallel(block_t, experts):
                    u[i, e] = 1.0 + T.exp(T.Cast(FP32, x_ub[i, e]))
                for i, e in T.Parallel(block_t, experts):
                    x = T.Cast(FP32, x_ub[i, e])
                    y = T.exp(x)
                    log1p = T.if_then_else(u[i, e] == 1.0, y, T.log(u[i, e]) * (y / (u[i, e] - 1.0)))
                    sp = T.Cast(FP32, T.Cast(dtype, T.if_then_else(x > SOFTPLUS_THRESHOLD, x, log1p)))
                    s_ub[i, e] = T.Cast(dtype, T.sqrt(sp))
            T.copy(s_ub, scores[bx * block_t, 0])

    return sqrt_softplus_kernel

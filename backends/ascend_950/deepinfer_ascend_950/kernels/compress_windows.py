"""CSA/HCA window compression (``compress_windows``) for Ascend 950, on the vector cores.

One core block per (window, ``block_d`` channels): the window's ``L`` rows of kv and gate for those
channels go GM -> UB, then in one SIMT region, in float32: the softmax over ``L`` of the gate for each
channel (``max``, ``exp(z - max)``, the sum), the weighted sum of kv, divided by the sum. An empty slot has
gate ``-inf`` and weight 0; a window whose slots are all empty yields NaN, as the op's softmax does.
``L`` is the window length (``2 * rate`` for CSA's overlapping windows, ``rate`` for HCA).
"""

import tilelang.ascend.language as T

FP32 = T.float32


def compress_windows(window: int, dim: int, kv_dtype: str = "bfloat16", gate_dtype: str = "float32",
                     block_d: int = 64, threads: int = 64):
    """``(kv [W, L, D], gate [W, L, D]) -> writes out [W, D]`` (kv's dtype), ``W`` dynamic."""
    block_d = min(block_d, dim)
    if window < 1 or dim % block_d or block_d % 8:
        raise ValueError(f"window={window} must be >= 1 and dim={dim} a multiple of block_d={block_d} (itself of 8)")
    tiles = dim // block_d
    num_windows = T.dynamic("num_windows")

    @T.prim_func
    def compress_windows_kernel(
        kv: T.Tensor[(num_windows, window, dim), kv_dtype],
        gate: T.Tensor[(num_windows, window, dim), gate_dtype],
        out: T.Tensor[(num_windows, dim), kv_dtype],
    ):
        with T.Kernel(num_windows * tiles) as bx:
            w = bx // tiles
            d0 = (bx % tiles) * block_d
            kv_ub = T.alloc_shared((window, block_d), kv_dtype)
            gate_ub = T.alloc_shared((window, block_d), gate_dtype)
            out_ub = T.alloc_shared((block_d,), kv_dtype)

            T.copy(kv[w, 0:window, d0 : d0 + block_d], kv_ub)
            T.copy(gate[w, 0:window, d0 : d0 + block_d], gate_ub)
            with T.SimtVF(threads=threads):
                z = T.alloc_fragment((window, block_d), FP32)
                z_max = T.alloc_fragment((block_d,), FP32)
                z_sum = T.alloc_fragment((block_d,), FP32)
                acc = T.alloc_fragment((block_d,), FP32)
                for l, d in T.Parallel(window, block_d):
                    z[l, d] = T.Cast(FP32, gate_ub[l, d])
                T.reduce_max(z, z_max, dim=0)
                for l, d in T.Parallel(window, block_d):
                    z[l, d] = T.exp(z[l, d] - z_max[d])
                T.reduce_sum(z, z_sum, dim=0)
                for l, d in T.Parallel(window, block_d):
                    z[l, d] = z[l, d] * T.Cast(FP32, kv_ub[l, d])
                T.reduce_sum(z, acc, dim=0)
                for d in T.Parallel(block_d):
                    out_ub[d] = T.Cast(kv_dtype, acc[d] / z_sum[d])
            T.copy(out_ub, out[w, d0 : d0 + block_d])

    return compress_windows_kernel

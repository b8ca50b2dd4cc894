"""DeepSeek's simulated activation quantisation for Ascend 950 (vector cores): quantise, dequantise.

Per row and group of ``block`` values: ``s = 2**ceil(log2(max(amax, eps) / qmax))``, taken from the
float32 exponent and mantissa bits of ``amax / qmax`` (exact, as DeepSeek's ``fast_round_scale``), then
``out = round(x / s) * s`` in the input dtype, ``round`` being the E4M3 cast of ``clamp(x / s, +-448)``
(fmt ``"e4m3"``) or the nearest e2m1 value, ties to even, saturating at 6 (fmt ``"e2m1"``). ``dim``
must be a multiple of ``block`` (the caller pads with zeros).
"""

import tilelang.ascend.language as T

FP32 = T.float32
E4M3 = "float8_e4m3"
#: fmt -> (qmax, amax floor)
FORMATS = {"e4m3": (448.0, 1e-4), "e2m1": (6.0, 6 * 2.0**-126)}
#: e2m1: (midpoint, whether a value on it rounds up to the even code above), steps 0.5, 0.5, ..., 2
_E2M1_STEPS = ((0.25, False, 0.5), (0.75, True, 0.5), (1.25, False, 0.5), (1.75, True, 0.5), (2.5, False, 1.0),
               (3.5, True, 1.0), (5.0, False, 2.0))


def _pow2_ceil(v):
    """``2**ceil(log2(v))`` for a positive normal float32 ``v``, from its bits."""
    bits = T.reinterpret(v, T.uint32)
    exponent = T.Cast(T.int32, T.bitwise_and(T.shift_right(bits, 23), 255))
    up = T.if_then_else(T.bitwise_and(bits, 0x7FFFFF) != 0, 1, 0)
    return T.reinterpret(T.shift_left(T.Cast(T.uint32, exponent + up), 23), FP32)


def _nearest_e2m1(v):
    a = T.abs(v)
    mag = 0.0
    for mid, tie_up, step in _E2M1_STEPS:
        mag = mag + T.if_then_else(a >= mid if tie_up else a > mid, step, 0.0)
    return T.if_then_else(v < 0, -mag, mag)


def act_quant_sim(dim: int, block: int, fmt: str, dtype: str = "bfloat16", block_m: int = 32, threads: int = 64):
    """``x [M, dim] -> writes out [M, dim]`` in ``dtype``, ``M`` dynamic."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown fmt {fmt!r}; expected one of {sorted(FORMATS)}")
    if dim % block or block % 16 or block_m % 8:
        raise ValueError(f"dim={dim} must be a multiple of block={block} (a multiple of 16), block_m={block_m} of 8")
    qmax, eps = FORMATS[fmt]
    groups = dim // block
    rows = T.dynamic("rows")

    @T.prim_func
    def act_quant_sim_kernel(x: T.Tensor[(rows, dim), dtype], out: T.Tensor[(rows, dim), dtype]):
        with T.Kernel(T.ceildiv(rows, block_m) * groups) as bx:
            m0 = (bx // groups) * block_m
            g = bx % groups
            x_ub = T.alloc_shared((block_m, block), dtype)
            out_ub = T.alloc_shared((block_m, block), dtype)

            T.copy(x[m0 : m0 + block_m, g * block : (g + 1) * block], x_ub)
            with T.SimtVF(threads=threads):
                xf = T.alloc_fragment((block_m, block), FP32)
                amax = T.alloc_fragment((block_m,), FP32)
                scale = T.alloc_fragment((block_m,), FP32)
                for i, j in T.Parallel(block_m, block):
                    xf[i, j] = T.Cast(FP32, x_ub[i, j])
                T.reduce_absmax(xf, amax, dim=1)
                for i in T.Parallel(block_m):
                    scale[i] = _pow2_ceil(T.max(amax[i], eps) / qmax)
                for i, j in T.Parallel(block_m, block):
                    v = xf[i, j] / scale[i]
                    if fmt == "e4m3":
                        q = T.Cast(FP32, T.Cast(E4M3, T.min(T.max(v, -qmax), qmax)))
                    else:
                        q = _nearest_e2m1(v)
                    out_ub[i, j] = T.Cast(dtype, q * scale[i])
            T.copy(out_ub, out[m0 : m0 + block_m, g * block : (g + 1) * block])

    return act_quant_sim_kernel

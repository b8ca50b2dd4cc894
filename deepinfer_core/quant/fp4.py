"""FP4 e2m1 weights with power-of-two (ue8m0) scales, and power-of-two activation quantisation.

The published DeepSeek-V4 routed experts: every row of a weight [N, K] is cut into groups of 32 inputs,
each group has one ``float8_e8m0fnu`` scale (a bare exponent: 2**(byte - 127)) and 32 e2m1 values
(sign, 2 exponent bits, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6), packed two a byte along K, the
even element in the low nibble. In a file the packed bytes are int8 [N, K/2] (or
``float4_e2m1fn_x2`` [N, K/2]); in memory the engine keeps them as uint8 [..., N, K/2].

Quantising: ``scale = 2**ceil(log2(amax / 6))`` per group (so every value fits), each value rounded to
the nearest e2m1 value (ties to the even code). Activations entering DeepSeek's FP8 and FP4 linears are
quantised the same way to E4M3 per 128 values (``scale = 2**ceil(log2(amax / 448))``, amax floored at
1e-4), which :func:`fake_quant_act_ue8m0` simulates (quantise, then dequantise).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

FP4_BLOCK = 32
FP4_MAX = 6.0
E8M0_DTYPE = torch.float8_e8m0fnu
#: the 16 e2m1 codes: 0-7 positive, 8-15 the same magnitudes negative
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: amax floors: an all-zero group still gets a finite scale (DeepSeek's kernels)
FP4_AMAX_EPS = 6 * 2.0**-126
ACT_AMAX_EPS = 1e-4
E4M3_MAX = 448.0


def e8m0_from_float(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two float scales -> ``float8_e8m0fnu`` (bit-exact; a scale that is not a power of two
    is a ``ValueError``)."""
    s = scale.float()
    exp = torch.floor(torch.log2(s))
    if not torch.equal(torch.exp2(exp), s):
        raise ValueError("e8m0 scales must be powers of two")
    return (exp + 127).clamp(0, 254).to(torch.uint8).view(E8M0_DTYPE)


def is_power_of_two(scale: torch.Tensor) -> bool:
    s = scale.float()
    return bool(torch.isfinite(s).all() and (s > 0).all() and torch.equal(torch.exp2(torch.floor(torch.log2(s))), s))


def _ieee_div(x: torch.Tensor, d: float) -> torch.Tensor:
    """``x / d`` rounded once (CUDA multiplies by the reciprocal of a host scalar instead)."""
    return x / x.new_full((), d)


def pow2_scale(amax: torch.Tensor, qmax: float, eps: float) -> torch.Tensor:
    """``2**ceil(log2(max(amax, eps) / qmax))`` in float32: the smallest power of two that fits amax
    (from the float's exponent bits, exact and identical on every row and device)."""
    mantissa, exponent = torch.frexp(_ieee_div(amax.float().clamp(min=eps), qmax))  # v = m * 2^e, m in [0.5, 1)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)  # an exact power of two is its own scale
    return torch.ldexp(torch.ones_like(mantissa), exponent)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """``x @ H * K**-0.5`` along the last dim (K a power of two), H the Sylvester Hadamard matrix
    (``H[i, j] = (-1)**popcount(i & j)``), as ``fast_hadamard_transform.hadamard_transform``; computed by
    butterflies in float32 (float64 stays float64), the same adds in the same order for every row."""
    k = x.shape[-1]
    if k & (k - 1):
        raise ValueError(f"the Hadamard transform needs a power-of-two width, got {k}")
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = x.to(acc).reshape(-1, k)
    h = 1
    while h < k:
        y = y.view(-1, k // (2 * h), 2, h)
        y = torch.stack([y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]], dim=2)
        h *= 2
    return (y.reshape(x.shape) * k**-0.5).to(x.dtype)


def _build_e2m1_table(device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    codes = torch.arange(16, device=device)
    exponent, mantissa = (codes >> 1) & 3, (codes & 1).to(dtype)
    subnormal = mantissa * 0.5
    normal = torch.exp2((exponent - 1).to(dtype)) * (1 + subnormal)
    magnitude = torch.where(exponent == 0, subnormal, normal)
    return torch.where(codes >= 8, -magnitude, magnitude)


#: CPU tables by dtype, made once: E2M1 values [16], and byte -> (value of its low nibble, value of its high
#: nibble) [256, 2]. Other devices build the [16] table on every call, from the codes' bits with no host
#: data, so that a CUDA graph may capture it.
_CPU_TABLES: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}


def _cpu_tables(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    tables = _CPU_TABLES.get(dtype)
    if tables is None:
        table, byte = _build_e2m1_table("cpu", dtype), torch.arange(256)
        tables = _CPU_TABLES[dtype] = (table, torch.stack([table[byte & 0x0F], table[byte >> 4]], dim=-1))
    return tables


def _e2m1_table(device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    """:data:`E2M1_VALUES` [16] in ``dtype`` on ``device``, from the codes' bits (sign, 2 exponent bits,
    1 mantissa bit)."""
    return _cpu_tables(dtype)[0] if torch.device(device).type == "cpu" else _build_e2m1_table(device, dtype)


def unpack_fp4(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed e2m1 [..., K/2] (uint8, int8 or ``float4_e2m1fn_x2``) -> their values [..., K] in ``dtype``."""
    if packed.dtype != torch.uint8:
        packed = packed.view(torch.uint8)
    if packed.device.type == "cpu":  # one gather of both nibbles' values per byte
        return _cpu_tables(dtype)[1][packed.long()].flatten(-2)
    table = _build_e2m1_table(packed.device, dtype)
    low, high = table[(packed & 0x0F).long()], table[(packed >> 4).long()]
    return torch.stack([low, high], dim=-1).flatten(-2)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (0..15) [..., K] -> packed uint8 [..., K/2], even element in the low nibble."""
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


#: midpoints between neighbouring e2m1 magnitudes, and whether a value exactly on one rounds up (to
#: the even code above) or stays (on the even code below): round to nearest, ties to even
_E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True),
                   (5.0, False))


def _nearest_e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """The e2m1 code (0..15) nearest to each value of ``x``, ties to the even code, saturating at 6."""
    a = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for mid, tie_up in _E2M1_MIDPOINTS:
        code += (a >= mid if tie_up else a > mid).to(torch.uint8)
    return code + 8 * (x < 0).to(torch.uint8)


def quantize_fp4_block(w: torch.Tensor, block: int = FP4_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight [..., N, K] -> (packed uint8 [..., N, K/2], e8m0 scales [..., N, K/block])."""
    k = w.shape[-1]
    if k % block or k % 2:
        raise ValueError(f"FP4 needs the input width ({k}) to be a multiple of {block}")
    groups = w.float().reshape(*w.shape[:-1], k // block, block)
    scale = pow2_scale(groups.abs().amax(dim=-1), FP4_MAX, FP4_AMAX_EPS)
    codes = _nearest_e2m1_codes(groups / scale.unsqueeze(-1)).reshape(w.shape)
    return pack_fp4(codes), e8m0_from_float(scale)


def dequantize_fp4_block(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                         block: int = FP4_BLOCK) -> torch.Tensor:
    """Packed e2m1 [..., N, K/2] with one scale per ``block`` inputs [..., N, K/block] -> [..., N, K]
    in ``dtype`` (computed in float32, or float64 for float64: exact in both)."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    values = unpack_fp4(packed, acc)
    return (values * scale.to(acc).repeat_interleave(block, dim=-1)).to(dtype)


#: a stack whose float32 copy would be larger is dequantised again on every call instead of kept
EXPERT_CACHE_BYTES = 64 << 20


def fp4_expert(packed: torch.Tensor, scale: torch.Tensor) -> Callable[[int, torch.dtype], torch.Tensor]:
    """``(e, dtype) -> dequantize_fp4_block(packed[e], scale[e], dtype)``, each result kept while neither
    tensor changes (their version counters: EPLB moves experts in place) for stacks up to
    :data:`EXPERT_CACHE_BYTES` dequantised: a reference model's every step would unpack the same experts."""
    def fresh(e: int, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_fp4_block(packed[e], scale[e], dtype)

    if packed.numel() * 2 * 4 > EXPERT_CACHE_BYTES or packed.is_inference() or scale.is_inference():
        return fresh
    # kept on the stack itself (dropped with it): ((its version, its scales' version), {(e, dtype): weight})
    version = (packed._version, scale._version)
    held = getattr(packed, "_dequantized_experts", None)
    if held is None or held[0] != version:
        held = (version, {})
        packed._dequantized_experts = held
    kept = held[1]

    def cached(e: int, dtype: torch.dtype) -> torch.Tensor:
        if (e, dtype) not in kept:
            kept[e, dtype] = fresh(e, dtype)
        return kept[e, dtype]

    return cached


def fake_quant_act_ue8m0(x: torch.Tensor, block: int = 128, qmax: float = E4M3_MAX,
                         eps: float = ACT_AMAX_EPS) -> torch.Tensor:
    """DeepSeek's ``act_quant`` with ue8m0 scales, simulated: each group of ``block`` values along the
    last dim (the last group may be partial) is divided by its power-of-two scale, rounded to E4M3
    (saturating) and multiplied back; computed in float32 (float64 stays float64), returned in
    ``x.dtype``."""
    k = x.shape[-1]
    groups_n = -(-k // block)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    groups = _groups_of(x, block, acc)
    scale = pow2_scale(groups.abs().amax(dim=-1, keepdim=True), qmax, eps).to(acc)
    q = (groups / scale).clamp(-qmax, qmax).to(torch.float8_e4m3fn).to(acc)
    return (q * scale).view(*x.shape[:-1], groups_n * block)[..., :k].to(x.dtype)


def _groups_of(x: torch.Tensor, block: int, acc: torch.dtype) -> torch.Tensor:
    """``x`` in ``acc`` as [..., ceil(K / block), block], the last group padded with zeros (a copy only
    where K is not a multiple of ``block``)."""
    k = x.shape[-1]
    groups_n = -(-k // block)
    if k == groups_n * block:
        return x.to(acc).reshape(*x.shape[:-1], groups_n, block)
    padded = torch.zeros((*x.shape[:-1], groups_n * block), dtype=acc, device=x.device)
    padded[..., :k] = x
    return padded.view(*x.shape[:-1], groups_n, block)


def fake_quant_act_fp4(x: torch.Tensor, block: int = FP4_BLOCK) -> torch.Tensor:
    """DeepSeek's ``fp4_act_quant`` simulated: per ``block`` values (the last group may be partial) a
    power-of-two scale (amax / 6, rounded up), each value rounded to the nearest e2m1 value, multiplied
    back; computed in float32 (float64 stays float64), returned in ``x.dtype``."""
    k = x.shape[-1]
    groups_n = -(-k // block)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    groups = _groups_of(x, block, acc)
    scale = pow2_scale(groups.abs().amax(dim=-1, keepdim=True), FP4_MAX, FP4_AMAX_EPS).to(acc)
    codes = _nearest_e2m1_codes(groups / scale)
    values = _e2m1_table(x.device, acc)[codes.long()]
    return (values * scale).view(*x.shape[:-1], groups_n * block)[..., :k].to(x.dtype)


#: the smallest amax an E4M3-scaled FP4 group keeps (DeepSeek-V4.1's compressed KV): its scale stays nonzero
FP4_E4M3_AMAX_EPS = 6.0 * 2.0**-9


def fake_quant_fp4_e4m3_scale(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """DeepSeek-V4.1's compressed-KV quantisation simulated (``fp4_act_quant`` with E4M3 scales): per
    ``block`` values (the last group may be partial) the scale ``e4m3(max(amax, 6 * 2^-9) / 6)`` (round to
    nearest even), each ``x / scale`` rounded to the nearest e2m1 value (ties to even, saturating at 6),
    multiplied back; computed in float32 (float64 stays float64), returned in ``x.dtype``."""
    k = x.shape[-1]
    groups_n = -(-k // block)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    groups = _groups_of(x, block, acc)
    amax = groups.abs().amax(dim=-1, keepdim=True).clamp(min=FP4_E4M3_AMAX_EPS)
    scale = (amax / FP4_MAX).to(torch.float8_e4m3fn).to(acc)
    codes = _nearest_e2m1_codes((groups / scale).clamp(-FP4_MAX, FP4_MAX))
    values = _e2m1_table(x.device, acc)[codes.long()]
    return (values * scale).view(*x.shape[:-1], groups_n * block)[..., :k].to(x.dtype)

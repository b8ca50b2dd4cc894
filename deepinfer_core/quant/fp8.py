"""DeepSeek's block FP8: E4M3 weights with one float32 scale per 128x128 tile, activations quantised per
token per 128 channels. Which parameters a model keeps this way is its manifest's business.

Weights: ``scale = max(amax(tile), AMAX_EPS) / 448``, ``q = e4m3(w / scale)`` (round to nearest even);
tiles at the right and bottom edges may be partial. Activations: the same per 1x128 group of a row, always
from float32 values (float64 inputs are narrowed first), so every backend quantises them identically.
"""

from __future__ import annotations

import torch

FP8_BLOCK = 128
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
#: amax floor: an all-zero group gets a finite scale (DeepGEMM's choice)
AMAX_EPS = 1e-4

def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def scale_shape(rows: int, cols: int, block: int = FP8_BLOCK) -> tuple[int, int]:
    """Shape of the block scales of a ``rows`` x ``cols`` weight."""
    return _cdiv(rows, block), _cdiv(cols, block)


def _expand(scale: torch.Tensor, rows: int, cols: int, block: int) -> torch.Tensor:
    """Per-tile scales [..., R, C] -> per-element [..., rows, cols]."""
    return scale.repeat_interleave(block, -2)[..., :rows, :].repeat_interleave(block, -1)[..., :cols]


def _round_e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _block_scale(amax: torch.Tensor) -> torch.Tensor:
    """``max(amax, AMAX_EPS) / 448``, an IEEE division on every device (CUDA turns division by a host
    scalar into multiplication by its reciprocal, one bit off)."""
    return amax.clamp(min=AMAX_EPS) / amax.new_full((), FP8_MAX)


def quantize_fp8_block(w: torch.Tensor, block: int | tuple[int, int] = FP8_BLOCK, ue8m0: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight [..., N, K] -> (E4M3 [..., N, K], float32 scales [..., ceil(N/br), ceil(K/bc)]) for tiles of
    ``block`` = (br, bc) (an int: square tiles); ``ue8m0``: each scale rounded up to a power of two
    (DeepSeek's published scales)."""
    *lead, n, k = w.shape
    br, bc = (block, block) if isinstance(block, int) else block
    rows, cols = _cdiv(n, br), _cdiv(k, bc)
    padded = torch.zeros((*lead, rows * br, cols * bc), dtype=torch.float32, device=w.device)
    padded[..., :n, :k] = w
    tiles = padded.view(*lead, rows, br, cols, bc)
    scale = _block_scale(tiles.abs().amax(dim=(-3, -1)))
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = _round_e4m3(tiles / scale.unsqueeze(-1).unsqueeze(-3)).view(*lead, rows * br, cols * bc)
    return q[..., :n, :k].contiguous(), scale


def dequantize_fp8_block(weight: torch.Tensor, scale: torch.Tensor, block: int | tuple[int, int] = FP8_BLOCK,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """E4M3 weight [..., N, K] with one scale per ``block`` x ``block`` tile (or per (rows, columns)
    ``block``) -> ``dtype`` (float64: exact)."""
    n, k = weight.shape[-2:]
    rows, cols = (block, block) if isinstance(block, int) else block
    s = scale.to(dtype).repeat_interleave(rows, -2)[..., :n, :].repeat_interleave(cols, -1)[..., :k]
    return weight.to(dtype) * s


def quantize_act_fp8(x: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [..., K] -> (E4M3 [..., K], float32 scales [..., ceil(K/block)]), per row per ``block``
    channels, computed in float32."""
    k = x.shape[-1]
    groups = _cdiv(k, block)
    padded = torch.zeros((*x.shape[:-1], groups * block), dtype=torch.float32, device=x.device)
    padded[..., :k] = x
    grouped = padded.view(*x.shape[:-1], groups, block)
    scale = _block_scale(grouped.abs().amax(dim=-1))
    q = _round_e4m3(grouped / scale.unsqueeze(-1)).view(*x.shape[:-1], groups * block)
    return q[..., :k].contiguous(), scale


def dequantize_act_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                       block: int = FP8_BLOCK) -> torch.Tensor:
    """Inverse of :func:`quantize_act_fp8` (exact in float32 and float64)."""
    return q.to(dtype) * scale.to(dtype).repeat_interleave(block, -1)[..., : q.shape[-1]]


def quantize_params_fp8(params: dict[str, torch.Tensor], names: set[str], ue8m0: bool = False) -> list[str]:
    """Quantise in place every parameter of ``names`` that is not E4M3 yet, adding ``name + "_scale"``
    (power-of-two scales with ``ue8m0``, as DeepSeek publishes them).

    Stacked experts [E, N, K] get scales [E, ceil(N/128), ceil(K/128)]. Returns the names converted.
    """
    done = []
    for name in sorted(names):
        w = params.get(name)
        if w is None or w.dtype == FP8_DTYPE or name + "_scale" in params:  # absent, or quantised already (FP4)
            continue
        if w.dim() == 3:  # one expert at a time keeps the float32 working copy small
            parts = [quantize_fp8_block(w[e], ue8m0=ue8m0) for e in range(w.shape[0])]
            q, scale = torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
        else:
            q, scale = quantize_fp8_block(w, ue8m0=ue8m0)
        params[name], params[name + "_scale"] = q, scale
        done.append(name)
    return done

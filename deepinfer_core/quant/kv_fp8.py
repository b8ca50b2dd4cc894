"""DeepSeek's FP8 KV entry: one window or compressed KV row of ``head_dim`` values in bytes.

Of a row's ``head_dim`` values the first ``nope = head_dim - rope_dim`` are stored as E4M3 with one
power-of-two (ue8m0) scale per 64 values (the last group may be partial), the ``rope_dim`` RoPE values
as they are, in ``rope_dtype``. Bytes of one entry, in order (FlashMLA's sparse FP8 layout)::

    [0, nope)                      E4M3 codes
    [nope, nope + rope_dim * es)   RoPE values (es: the element size of rope_dtype)
    then ceil(nope / 64)           scale exponents (2 ** (byte - 127))
    then zeros to a multiple of 8

DeepSeek-V4-Flash (head_dim 512, rope_dim 64, bf16): 448 + 128 + 7 + 1 = 584 bytes, against 1024 for
bf16 values. Quantising is DeepSeek's ``act_quant(kv[..., :-rope_dim], 64, "ue8m0")``: the scale is the
smallest power of two with ``amax / scale <= 448`` (amax floored at 1e-4), computed in float32 (float64
stays float64), so reading an entry back gives exactly the values DeepSeek's model.py keeps in its bf16
cache after its in-place quantisation.
"""

from __future__ import annotations

import torch

from deepinfer_core.quant.fp4 import ACT_AMAX_EPS, E4M3_MAX, pow2_scale

KV_FP8_BLOCK = 64
_ALIGN = 8
_E8M0_BIAS = 127


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def num_scales(head_dim: int, rope_dim: int) -> int:
    return -(-(head_dim - rope_dim) // KV_FP8_BLOCK)


def kv_fp8_entry_bytes(head_dim: int, rope_dim: int, rope_dtype: torch.dtype) -> int:
    """Bytes of one entry (584 for DeepSeek-V4-Flash)."""
    raw = head_dim - rope_dim + rope_dim * rope_dtype.itemsize + num_scales(head_dim, rope_dim)
    return -(-raw // _ALIGN) * _ALIGN


def pack_kv_fp8(kv: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """Values [..., head_dim] -> entries uint8 [..., B], the RoPE values kept in ``kv.dtype``."""
    head_dim = kv.shape[-1]
    nope, groups = head_dim - rope_dim, num_scales(head_dim, rope_dim)
    acc = _acc(kv.dtype)
    padded = torch.zeros((*kv.shape[:-1], groups * KV_FP8_BLOCK), dtype=acc, device=kv.device)
    padded[..., :nope] = kv[..., :nope]
    grouped = padded.view(*kv.shape[:-1], groups, KV_FP8_BLOCK)
    scale = pow2_scale(grouped.abs().amax(dim=-1), E4M3_MAX, ACT_AMAX_EPS)  # float32 powers of two
    codes = (grouped / scale.to(acc).unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    codes = codes.view(*kv.shape[:-1], groups * KV_FP8_BLOCK)[..., :nope].view(torch.uint8)
    exponent = torch.frexp(scale)[1] - 1 + _E8M0_BIAS  # scale = 2 ** (exponent - 127)
    rope = kv[..., nope:].contiguous().view(torch.uint8)
    parts = [codes, rope, exponent.to(torch.uint8)]
    pad = kv_fp8_entry_bytes(head_dim, rope_dim, kv.dtype) - sum(p.shape[-1] for p in parts)
    parts.append(torch.zeros((*kv.shape[:-1], pad), dtype=torch.uint8, device=kv.device))
    return torch.cat(parts, dim=-1)


def unpack_kv_fp8(entries: torch.Tensor, head_dim: int, rope_dim: int, rope_dtype: torch.dtype,
                  dtype: torch.dtype) -> torch.Tensor:
    """Entries uint8 [..., B] -> values [..., head_dim] in ``dtype`` (exact: E4M3 times a power of two)."""
    nope, groups = head_dim - rope_dim, num_scales(head_dim, rope_dim)
    rope_end = nope + rope_dim * rope_dtype.itemsize
    if entries.shape[-1] != kv_fp8_entry_bytes(head_dim, rope_dim, rope_dtype):
        raise ValueError(f"FP8 KV entries of {entries.shape[-1]} bytes, expected "
                         f"{kv_fp8_entry_bytes(head_dim, rope_dim, rope_dtype)} (head_dim {head_dim}, "
                         f"rope_dim {rope_dim}, RoPE values in {rope_dtype})")
    acc = _acc(dtype)
    codes = entries[..., :nope].contiguous().view(torch.float8_e4m3fn).to(acc)
    exponent = entries[..., rope_end : rope_end + groups].to(torch.int32) - _E8M0_BIAS
    scale = torch.ldexp(torch.ones(exponent.shape, dtype=acc, device=entries.device), exponent)
    values = codes * scale.repeat_interleave(KV_FP8_BLOCK, dim=-1)[..., :nope]
    rope = entries[..., nope:rope_end].contiguous().view(rope_dtype)
    return torch.cat([values.to(dtype), rope.to(dtype)], dim=-1)

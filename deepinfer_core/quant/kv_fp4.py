"""DeepSeek-V4.1's packed KV entries ("FP4 KV": 890 bytes of global KV per token).

Three row formats, each the bytes of one entry, quantised exactly as DeepSeek-V4.1's ``inference/model.py``
quantises the values it caches (so unpacking gives back those values bit for bit):

* ``"window"`` (528 B at head_dim 512): the E4M3 codes of all values, one power-of-two scale per 32
  (``act_quant``, amax floored at 1e-4), then one E8M0 byte per group;
* ``"compressed"`` (288 B): e2m1 codes packed two a byte (the even value in the low nibble), one E4M3
  scale per 16 values (``e4m3(max(amax, 6 * 2^-9) / 6)``), then the scales' E4M3 bytes;
* ``"index"`` (68 B at index_head_dim 128): packed e2m1 codes, one power-of-two scale per 32 (amax
  floored at 6 * 2^-126), then one E8M0 byte per group.

Computed in float32 (float64 inputs in float64: the codes and scales are the same either way).
"""

from __future__ import annotations

import torch

from deepinfer_core.quant.fp4 import (
    ACT_AMAX_EPS,
    E4M3_MAX,
    FP4_AMAX_EPS,
    FP4_E4M3_AMAX_EPS,
    FP4_MAX,
    _nearest_e2m1_codes,
    pack_fp4,
    pow2_scale,
    unpack_fp4,
)

#: row format -> (values per scale group, value bytes per value, scale format)
FORMATS = {"window": (32, 1.0, "e8m0"), "compressed": (16, 0.5, "e4m3"), "index": (32, 0.5, "e8m0")}


def entry_bytes(kind: str, dim: int) -> int:
    """Bytes of one packed ``kind`` entry of ``dim`` values."""
    group, per_value, _ = FORMATS[kind]
    if dim % group:
        raise ValueError(f"a {kind} entry needs a multiple of {group} values, got {dim}")
    return int(dim * per_value) + dim // group


def _groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.dtype]:
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    return x.to(acc).unflatten(-1, (-1, group)), acc


def pack_kv_fp4(x: torch.Tensor, kind: str) -> torch.Tensor:
    """Values [N, D] -> packed uint8 rows [N, entry_bytes(kind, D)]."""
    group, _, _ = FORMATS[kind]
    entry_bytes(kind, x.shape[-1])
    g, acc = _groups(x, group)
    amax = g.abs().amax(-1, keepdim=True)
    if kind == "window":
        scale = pow2_scale(amax, E4M3_MAX, ACT_AMAX_EPS).to(acc)
        codes = (g / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8).flatten(-2)
        scale_bytes = (torch.log2(scale.float()).round().to(torch.int32) + 127).to(torch.uint8).squeeze(-1)
    elif kind == "compressed":
        scale = (amax.clamp(min=FP4_E4M3_AMAX_EPS) / FP4_MAX).to(torch.float8_e4m3fn)
        codes = pack_fp4(_nearest_e2m1_codes((g / scale.to(acc)).clamp(-FP4_MAX, FP4_MAX)).flatten(-2))
        scale_bytes = scale.view(torch.uint8).squeeze(-1)
    else:
        scale = pow2_scale(amax, FP4_MAX, FP4_AMAX_EPS).to(acc)
        codes = pack_fp4(_nearest_e2m1_codes(g / scale).flatten(-2))
        scale_bytes = (torch.log2(scale.float()).round().to(torch.int32) + 127).to(torch.uint8).squeeze(-1)
    return torch.cat([codes, scale_bytes], dim=-1)


def unpack_kv_fp4(rows: torch.Tensor, kind: str, dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed rows [N, entry_bytes(kind, dim)] -> their values [N, dim] in ``dtype``."""
    group, per_value, scale_fmt = FORMATS[kind]
    n_values = int(dim * per_value)
    codes, scale_bytes = rows[..., :n_values], rows[..., n_values:]
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    if scale_fmt == "e8m0":
        scale = torch.exp2(scale_bytes.to(acc) - 127)
    else:
        scale = scale_bytes.view(torch.float8_e4m3fn).to(acc)
    if kind == "window":
        values = codes.view(torch.float8_e4m3fn).to(acc)
    else:
        values = unpack_fp4(codes, acc)
    return (values.unflatten(-1, (-1, group)) * scale.unsqueeze(-1)).flatten(-2).to(dtype)

"""DeepSeek's FP8 KV entry (``deepinfer_core.quant.kv_fp8``) served by :mod:`.kernels.kv_fp8`.

- ``kv_fp8_pack``: the quantisation (E4M3 codes, the scale bytes and the pad) in ``kv_fp8_quant``; torch
  places the RoPE values' bytes between codes and scales.
- ``sparse_attention_fp8``: the selected entries gathered by torch (584 bytes a row for V4-Flash, against
  1024 for bf16 values; ``-1`` slots as zero entries, which decode to zero rows), decoded in q.dtype by
  ``kv_fp8_dequant``, then the ``sparse_attention`` kernel over them (:func:`.tilelang_ops.attend`).

A call the kernels do not take (float64, a ``head_dim - rope_dim`` that is neither a multiple of 64 nor a
multiple of 16 below it) goes to the native body.
"""

from __future__ import annotations

import torch

from deepinfer_ascend_950 import reference, tilelang_ops
from deepinfer_core.ops import native
from deepinfer_core.quant.kv_fp8 import KV_FP8_BLOCK, kv_fp8_entry_bytes


def _takes(nope: int) -> bool:
    """Scale groups the kernels tile: whole groups of 64, or one group of a multiple of 16."""
    return nope > 0 and (nope % KV_FP8_BLOCK == 0 or (nope < KV_FP8_BLOCK and nope % 16 == 0))


def kv_fp8_pack(kv: torch.Tensor, rope_dim: int) -> torch.Tensor:
    d = kv.shape[-1]
    nope = d - rope_dim
    if kv.dtype not in tilelang_ops.VECTOR_DTYPES or not _takes(nope) or kv.numel() == 0:
        return native.kv_fp8_pack(kv, rope_dim)
    flat = kv.reshape(-1, d).contiguous()
    rope_end = nope + rope_dim * kv.element_size()
    codes = torch.empty(flat.shape[0], nope, dtype=torch.float8_e4m3fn, device=kv.device)
    tail = torch.empty(flat.shape[0], kv_fp8_entry_bytes(d, rope_dim, kv.dtype) - rope_end, dtype=torch.uint8,
                       device=kv.device)
    tilelang_ops.compiled("kv_fp8_quant", head_dim=d, rope_dim=int(rope_dim),
                          dtype=tilelang_ops.VECTOR_DTYPES[kv.dtype])(flat, codes, tail)
    entries = torch.cat([codes.view(torch.uint8), flat[:, nope:].contiguous().view(torch.uint8), tail], dim=1)
    return entries.view(*kv.shape[:-1], entries.shape[-1])


def sparse_attention_fp8(q, kv, indices, sinks, scale: float, rope_dim: int, rope_dtype: torch.dtype,
                         extra_kv=None, extra_indices=None):
    d = q.shape[-1]
    entry = kv_fp8_entry_bytes(d, rope_dim, rope_dtype)
    widths = {kv.shape[-1]} | ({extra_kv.shape[-1]} if extra_kv is not None else set())
    if q.dtype not in tilelang_ops.KERNEL_DTYPES or rope_dtype not in tilelang_ops.VECTOR_DTYPES \
            or not _takes(d - rope_dim) or widths != {entry}:  # a wrong width: native's error
        return native.sparse_attention_fp8(q, kv, indices, sinks, scale, rope_dim, rope_dtype, extra_kv, extra_indices)
    decode = tilelang_ops.compiled("kv_fp8_dequant", head_dim=d, rope_dim=int(rope_dim),
                                   rope_dtype=tilelang_ops.VECTOR_DTYPES[rope_dtype],
                                   dtype=tilelang_ops.KERNEL_DTYPES[q.dtype])

    def rows(start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        ex = extra_indices[start:stop] if extra_indices is not None else None
        entries, sel = reference.gather_selected(kv, indices[start:stop], extra_kv, ex)
        values = torch.empty(*entries.shape[:2], d, dtype=q.dtype, device=q.device)
        if values.numel():
            decode(entries.reshape(-1, entry).contiguous(), values.view(-1, d))
        return values, sel

    k_total = indices.shape[-1] + (extra_indices.shape[-1] if extra_indices is not None else 0)
    return tilelang_ops.attend(q, sinks, scale, k_total, rows)


ALL_OPS = {"kv_fp8_pack": kv_fp8_pack, "sparse_attention_fp8": sparse_attention_fp8}

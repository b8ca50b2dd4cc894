"""The inputs of ``test_nvidia_fp8_kv.py``, and the script that runs the Triton ``sparse_attention_fp8`` on
them in a fresh process on the CPU under Triton's interpreter (the switches must be set before triton is
first imported).

``python nvidia_fp8_kv_worker.py OUT``: saves to ``OUT`` (``torch.save``) the kernel's output for every
case of :data:`CASES`, the Triton ``sparse_attention`` on the same rows decoded into dense pools, and what
the backend's op table resolves ``sparse_attention_fp8`` to with ``DEEPINFER_NVIDIA_FP8_KV_TRITON=1``,
with its conformance results.
"""

from __future__ import annotations

import sys

import torch
from nvidia_interpreter import op_table_record

from deepinfer_core.quant.kv_fp8 import kv_fp8_entry_bytes, num_scales, pack_kv_fp8, unpack_kv_fp8

_NAN_BYTE = 0xFF  # what a NaN-filled cache holds in its unused rows (E4M3 NaN, scale NaN)


def _spread_rows(g: torch.Generator, rows: int, d: int, rope_dim: int, lo: int, hi: int) -> torch.Tensor:
    """Float32 KV rows whose 64-value groups each have their own power-of-two size 2^lo .. 2^hi (so the
    entries' scales differ widely, within a row and between rows), the RoPE values O(1)."""
    nope = d - rope_dim
    groups = num_scales(d, rope_dim)
    size = torch.exp2(torch.randint(lo, hi + 1, (rows, groups), generator=g).float())
    kv = torch.randn(rows, d, generator=g)
    kv[:, :nope] *= size.repeat_interleave(64, dim=1)[:, :nope]
    return kv


def _pool(g: torch.Generator, rows: int, used: int, d: int, rope_dim: int, dtype: torch.dtype, spread: tuple[int, int],
          extra_bytes: int = 0) -> torch.Tensor:
    """Entries [rows, B]: the first ``used`` rows packed KV, the others 0xFF bytes (never read). With
    ``extra_bytes`` the entries are columns of a wider tensor (a row stride of B + extra_bytes bytes)."""
    entry = kv_fp8_entry_bytes(d, rope_dim, dtype)
    wide = torch.full((rows, entry + extra_bytes), _NAN_BYTE, dtype=torch.uint8)
    wide[:used, :entry] = pack_kv_fp8(_spread_rows(g, used, d, rope_dim, *spread).to(dtype), rope_dim)
    return wide[:, :entry]


def _indices(g: torch.Generator, tokens: int, width: int, used: int, none: tuple[int, ...]) -> torch.Tensor:
    """Rows of ``width`` slots: used rows in random order, about a third -1, the tokens ``none`` all -1."""
    idx = torch.stack([torch.randperm(used, generator=g)[:width] if width <= used else
                       torch.randint(0, used, (width,), generator=g) for _ in range(tokens)])
    idx[torch.rand(tokens, width, generator=g) < 0.3] = -1
    idx[list(none)] = -1
    return idx


def attention_case(name: str, dtype: torch.dtype) -> tuple:
    """``sparse_attention_fp8``'s arguments for the case ``name`` with queries (and RoPE values) in ``dtype``.

    * ``ragged``: 6 tokens x 5 heads, head_dim 200 with rope_dim 40 (160 E4M3 values: a partial last scale
      group), a window pool of 24 entries (9 slots) and an extra pool of 11 (6 slots); the groups' sizes
      2^-24 .. 2^6; token 0 has no key in either list (its output: the sink's zero), token 1 none in the
      extra list.
    * ``unaligned``: ``ragged`` with entries that are columns of wider tensors (row strides of B + 3 bytes):
      no 8-byte alignment, the RoPE values assembled from their bytes.
    * ``v4``: V4-Flash's widths, 64 heads x 512 (rope 64, 584-byte entries in bfloat16), 3 tokens, a window
      list of 40 slots (two blocks of 32) and an extra list of 48; groups 2^-12 .. 2^4.
    * ``exact``: 8 tokens x 16 heads at 512 / 64, each with one key and the sinks at -inf: the output is the
      key's decoded row itself. The rows' bytes are random: every finite E4M3 code, scales 2^-40 .. 2^40.
    """
    g = torch.Generator().manual_seed(sum(map(ord, name)) + 31 * (dtype == torch.float32))
    if name in ("ragged", "unaligned"):
        tokens, heads, d, rope = 6, 5, 200, 40
        pad = 3 if name == "unaligned" else 0
        kv = _pool(g, 24, 20, d, rope, dtype, (-24, 6), pad)
        ekv = _pool(g, 11, 11, d, rope, dtype, (-24, 6), pad)
        idx = _indices(g, tokens, 9, 20, (0,))
        eidx = _indices(g, tokens, 6, 11, (0, 1))
        # logits O(1): the largest groups are 2^6 x randn over 64 values
        scale = d**-0.5 * 2.0**-5
    elif name == "v4":
        tokens, heads, d, rope = 3, 64, 512, 64
        kv = _pool(g, 48, 40, d, rope, dtype, (-12, 4))
        ekv = _pool(g, 80, 64, d, rope, dtype, (-12, 4))
        idx = _indices(g, tokens, 40, 40, (0,))
        eidx = _indices(g, tokens, 48, 64, (0,))
        scale = d**-0.5 * 2.0**-3
    elif name == "exact":
        tokens, heads, d, rope = 8, 16, 512, 64
        kv = exact_pool(g, tokens + 2, d, rope, dtype)
        idx = torch.full((tokens, 5), -1, dtype=torch.long)
        idx[torch.arange(tokens), torch.arange(tokens) % 5] = torch.arange(tokens) + 2
        q = torch.randn(tokens, heads, d, generator=g) * 1e-3
        sinks = torch.full((heads,), float("-inf"))
        return q.to(dtype), kv, idx, sinks, d**-0.5, rope, dtype, None, None
    else:
        raise KeyError(name)
    q = torch.randn(tokens, heads, d, generator=g)
    sinks = torch.randn(heads, generator=g)
    return q.to(dtype), kv, idx, sinks, scale, rope, dtype, ekv, eidx


def exact_pool(g: torch.Generator, rows: int, d: int, rope_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Entries of random bytes: every finite E4M3 code (0x7F and 0xFF, NaN, replaced by 0), scale bytes
    127 - 40 .. 127 + 40, RoPE values normal in ``dtype`` (random bits with the exponent kept moderate)."""
    nope, groups = d - rope_dim, num_scales(d, rope_dim)
    codes = torch.randint(0, 256, (rows, nope), generator=g, dtype=torch.int32)
    codes[:, :256] = torch.arange(256, dtype=torch.int32)  # all of them, in every row
    codes[(codes & 0x7F) == 0x7F] = 0
    rope = torch.randn(rows, rope_dim, generator=g) * torch.exp2(torch.randint(-20, 20, (rows, rope_dim), generator=g))
    exps = torch.randint(127 - 40, 127 + 41, (rows, groups), generator=g)
    parts = [codes.to(torch.uint8), rope.to(dtype).view(torch.uint8), exps.to(torch.uint8)]
    entry = kv_fp8_entry_bytes(d, rope_dim, dtype)
    parts.append(torch.zeros(rows, entry - sum(p.shape[-1] for p in parts), dtype=torch.uint8))
    return torch.cat(parts, dim=-1)


#: (case, dtype) the kernel runs
CASES = [(name, dtype) for name in ("ragged", "unaligned", "v4", "exact") for dtype in (torch.float32, torch.bfloat16)]
CASES += [("ragged", torch.float16)]


def case_id(name: str, dtype: torch.dtype) -> str:
    return f"{name}-{str(dtype).removeprefix('torch.')}"


def dense_args(args: tuple) -> tuple:
    """``sparse_attention``'s arguments on pools of the entries decoded to the queries' dtype."""
    q, kv, idx, sinks, scale, rope, rope_dtype, ekv, eidx = args
    d = q.shape[-1]
    ekv = None if ekv is None else unpack_kv_fp8(ekv, d, rope, rope_dtype, q.dtype)
    return q, unpack_kv_fp8(kv, d, rope, rope_dtype, q.dtype), idx, sinks, scale, ekv, eidx


def main(out_path: str) -> None:
    from deepinfer_nvidia_sm100 import triton_ops

    torch.set_num_threads(1)
    out: dict = {"fp8": {}, "fp8_split": {}, "dense": {}, "tables": {}}
    for name, dtype in CASES:
        args = attention_case(name, dtype)
        out["fp8"][case_id(name, dtype)] = triton_ops.sparse_attention_fp8(*args)
        out["fp8_split"][case_id(name, dtype)] = triton_ops.sparse_attention_fp8(*args, splits=3)
        out["dense"][case_id(name, dtype)] = triton_ops.sparse_attention(*dense_args(args))
    for dtype in (torch.float32, torch.bfloat16):
        out["tables"][str(dtype)] = op_table_record("sparse_attention_fp8", dtype)
    torch.save(out, out_path)


if __name__ == "__main__":
    main(sys.argv[1])

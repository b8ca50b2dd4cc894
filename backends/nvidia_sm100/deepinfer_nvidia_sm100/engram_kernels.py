"""Triton kernel of ``engram_lookup``: Engram rows gathered from a table that may live in host memory.

One program per (token, column) row: it reads the id, the row's D E4M3 bytes and its D/32 E8M0 scale bytes
through whatever address the table has -- device memory, or pinned / registered host memory the GPU reads
over unified addressing (a host table's pointer is a valid device pointer there) -- and writes the row
dequantised in float32. An id outside the table (or the shard of one: ``row_start``) writes zeros.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def engram_lookup_kernel(ids_ptr, weight_ptr, scale_ptr, out_ptr, row_start, num_rows,
                         D: tl.constexpr, GROUPS: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    local = tl.load(ids_ptr + pid).to(tl.int64) - row_start
    inside = (local >= 0) & (local < num_rows)
    row = tl.where(inside, local, 0)
    offs = tl.arange(0, BLOCK_D)
    keep = (offs < D) & inside
    codes = tl.load(weight_ptr + row * D + offs, mask=keep, other=0)
    values = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    exps = tl.load(scale_ptr + row * GROUPS + offs // (D // GROUPS), mask=keep, other=127).to(tl.int32)
    # E8M0: 2^(e - 127) built from its bits (exact; e = 0 is the subnormal 2^-127, e = 255 NaN)
    scale = (exps << 23).to(tl.float32, bitcast=True)
    scale = tl.where(exps == 0, 5.877471754111438e-39, scale)
    scale = tl.where(exps == 255, float("nan"), scale)
    out = tl.where(keep, values * scale, 0.0)
    tl.store(out_ptr + pid.to(tl.int64) * D + offs, out, mask=offs < D)

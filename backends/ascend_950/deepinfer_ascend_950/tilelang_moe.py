"""Routed experts over grouped TileLang-Ascend GEMMs: one kernel launch per projection for all experts.

The pairs are laid out as expert tiles on the device (:mod:`.grouping`); nothing is read back to the
host, so these wrappers are graph-capturable (not ``syncs_host``).

- ``moe_experts_fp4``: both projections as :func:`.kernels.fp4_experts.fp4_expert_gemm` (e2m1 weights
  dequantised on the Vector cores, exact in the Cube's 16-bit operand dtype). ``quant_act=False``:
  operands in ``x.dtype`` (bf16/fp16). ``quant_act=True`` (DeepSeek's W4A8): ``x`` and ``h``
  fake-quantised to E4M3 with power-of-two scales (the ``act_quant_sim`` kernel), operands in
  bfloat16, which holds those values exactly; the steps and roundings are the native body's.
- ``moe_experts_fp8``: ``x`` quantised once by :func:`.kernels.fp8_gemm.act_quant_fp8` and its rows
  gathered into the tiles, both projections as :func:`.kernels.fp8_experts.fp8_expert_gemm` into
  float32, SwiGLU in float32, ``h`` quantised by ``act_quant_fp8`` again, the sum in float32.
"""

from __future__ import annotations

import torch

from deepinfer_ascend_950 import grouping, tilelang_ops
from deepinfer_core.ops import native

BLOCK_M = 64
FP4_DTYPES = (torch.uint8, torch.int8) + ((torch.float4_e2m1fn_x2,) if hasattr(torch, "float4_e2m1fn_x2") else ())


def _e8m0_bits(scale: torch.Tensor) -> torch.Tensor | None:
    """e8m0 scales as their bytes (uint8); float scales must be powers of two (else ``None``)."""
    if scale.dtype == torch.float8_e8m0fnu:
        return scale.view(torch.uint8)
    from deepinfer_core.quant.fp4 import e8m0_from_float, is_power_of_two

    if not scale.dtype.is_floating_point or not is_power_of_two(scale):
        return None
    return e8m0_from_float(scale).view(torch.uint8)


def _fp4_mm(x: torch.Tensor, p: grouping.TilePlan, w: torch.Tensor, w_scale: torch.Tensor,
            out_dtype: torch.dtype) -> torch.Tensor:
    n, k = w.shape[1], 2 * w.shape[2]
    out = torch.empty(p.rows, n, dtype=out_dtype, device=x.device)
    kernel = tilelang_ops.compiled("fp4_expert_gemm", n=n, k=k, dtype=tilelang_ops.KERNEL_DTYPES[x.dtype],
                                   out_dtype=tilelang_ops.VECTOR_DTYPES[out_dtype], block_m=BLOCK_M,
                                   num_cores=tilelang_ops.cube_cores(x.device.index or 0))
    kernel(x.contiguous(), p.tile_expert, w.view(torch.uint8).contiguous(), w_scale.contiguous(), out)
    return out


def _fp4_takes(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, quant_act: bool) -> bool:
    dims_ok = all(w.dim() == 3 and (2 * w.shape[2]) % 32 == 0 and w.shape[1] % 32 == 0 for w in (w13, w2))
    operand_ok = x.dtype in tilelang_ops.VECTOR_DTYPES if quant_act else x.dtype in tilelang_ops.KERNEL_DTYPES
    return dims_ok and operand_ok and w13.dtype in FP4_DTYPES and w2.dtype in FP4_DTYPES and w13.shape[0] > 0


def moe_experts_fp4(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, swiglu_limit: float,
                    quant_act: bool):
    s13, s2 = _e8m0_bits(w13_scale), _e8m0_bits(w2_scale)
    if s13 is None or s2 is None or not _fp4_takes(x, w13, w2, quant_act) or x.shape[0] == 0:
        return native.moe_experts_fp4(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, swiglu_limit,
                                      quant_act)
    f32 = torch.float32
    p = grouping.plan(topk_ids, w13.shape[0], BLOCK_M)
    weights = grouping.row_weights(topk_weights, p)
    if not quant_act:
        gate_up = _fp4_mm(grouping.gather_rows(x, p), p, w13, s13, x.dtype)
        h = native.swiglu(gate_up, swiglu_limit)
        y = _fp4_mm(h, p, w2, s2, x.dtype) * weights.to(x.dtype)[:, None]
        return grouping.combine(y, p, x.dtype)
    bf16 = torch.bfloat16
    xq = grouping.gather_rows(tilelang_ops.act_quant_sim(x, 128, "e4m3", False).to(bf16), p)
    gate_up = _fp4_mm(xq, p, w13, s13, x.dtype)
    h = native.swiglu(gate_up.to(f32), swiglu_limit) * weights.to(f32)[:, None]
    hq = tilelang_ops.act_quant_sim(h.to(x.dtype), 128, "e4m3", False).to(bf16)
    return grouping.combine(_fp4_mm(hq, p, w2, s2, x.dtype), p, x.dtype)


def _fp8_mm(q: torch.Tensor, scales: torch.Tensor, p: grouping.TilePlan, w: torch.Tensor,
            w_scale: torch.Tensor) -> torch.Tensor:
    k = q.shape[1]
    out = torch.empty(p.rows, w.shape[1], dtype=torch.float32, device=q.device)
    kernel = tilelang_ops.compiled("fp8_expert_gemm", n=w.shape[1], k=k, out_dtype="float32", block_m=BLOCK_M,
                                   num_cores=tilelang_ops.cube_cores(q.device.index or 0))
    kernel(q, scales.contiguous(), p.tile_expert, tilelang_ops._pad_k(w),
           w_scale.to(torch.float32).contiguous(), out)
    return out


def moe_experts_fp8(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, swiglu_limit: float):
    fp8 = tilelang_ops.FP8
    if x.dtype not in tilelang_ops.VECTOR_DTYPES or w13.dtype != fp8 or w2.dtype != fp8 or x.shape[0] == 0 \
            or w13.shape[0] == 0:
        return native.moe_experts_fp8(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, swiglu_limit)
    p = grouping.plan(topk_ids, w13.shape[0], BLOCK_M)
    xq, xs = tilelang_ops._act_quant(tilelang_ops._pad_k(x))
    rows = p.row_token  # padding rows: the appended zero row, whose scale column is zero too
    q = torch.cat([xq, xq.new_zeros(1, xq.shape[1])])[rows].contiguous()
    scales = torch.cat([xs, xs.new_zeros(xs.shape[0], 1)], dim=1)[:, rows]
    gate_up = _fp8_mm(q, scales, p, w13, w13_scale)
    hq, hs = tilelang_ops._act_quant(tilelang_ops._pad_k(native.swiglu(gate_up, swiglu_limit)))
    y = _fp8_mm(hq, hs, p, w2, w2_scale)
    return grouping.combine(y * grouping.row_weights(topk_weights, p).to(torch.float32)[:, None], p, x.dtype)


ALL_OPS = {"moe_experts_fp4": moe_experts_fp4, "moe_experts_fp8": moe_experts_fp8}

"""Batch-invariant implementations of the ops the catalogue does not mark batch-invariant.

Registered with ``batch_invariant=True`` and chosen only in batch-invariant mode. What makes a row's
result independent of its batch, op by op:

* ``linear``, ``grouped_linear``, the mixing GEMMs of ``hc_pre`` / ``hc_head`` / ``hc_mixes``: one Triton GEMM whose
  tiles (:func:`gemm_tiles`) depend on the dtype and the weight's N alone, never on M, with the whole
  K loop in one program (no split-K) in ascending order. cuBLAS, which the default mode uses, picks
  its kernel (and split-K) by M.
* ``moe_experts``: the default Triton grouped GEMMs with their M-block fixed at :data:`MOE_BLOCK_M`
  (the default picks 16 or 64 by the number of pairs), and a token's k slot outputs summed in slot
  order by one program (the default's torch ``sum`` picks its reduction layout by the tensor's shape).
* ``swiglu``, ``moe_route``: one program per row; the top-k picks one expert at a time (ties towards
  the lower id), where torch's sort picks its algorithm by the shape.
* ``sparse_attention``: the default kernel is one program per query with tiles set by the head count
  and width; its online softmax walks the index lists in fixed chunks of 32, and a chunk of -1 only
  multiplies by exp(0) = 1 and adds exact zeros, so padding a list further changes nothing. The one
  batch-dependent choice left, skipping the extra pool when no query of the batch has an extra index,
  is turned off (``keep_extra``).
* ``indexer_topk`` (which the catalogue marks invariant) and ``indexer_scores``: the scores kernel with its
  candidate tile fixed at :data:`INDEXER_BLOCK_C` instead of chosen by the batch's widest candidate list.
* ``hc_mixes`` (DeepSeek-V4.1's single-pass mHC): the mixing projection as the GEMM above, then
  ``hc_pre``'s kernel, one program a token (RMS factor over the token's row in blocks set by its width,
  pre/post/comb and the Sinkhorn loop in registers), storing ``pre`` instead of collapsing. torch's
  elementwise functions would not do on the CPU: their vectorised bulk and scalar remainder disagree in
  the last bit (``sigmoid``), and which of a token's values fall in the remainder depends on the batch.
* ``moe_experts_fp4``, ``moe_experts_act_quant``, ``moe_experts_quant_act``, ``moe_experts_fp4_quant_act``:
  the default FP4 MoE kernels (packed or float experts; activations quantised per row) with their M-block
  fixed at :data:`MOE_BLOCK_M`, and the slots summed as ``moe_experts`` sums them; no host read-back.
* ``linear_fp8``, ``linear_fp8_ue8m0``, ``moe_experts_fp8``: the core's native bodies (per-row activation
  quantisation, weights dequantised exactly, experts in ascending id order) with the GEMM and SwiGLU
  above; correct but slow (float32 GEMMs on dequantised weights). ``moe_experts_fp8`` reads expert counts
  back to the host, so its steps are not graph-captured.
* ``sparse_attention_fp8``: the native body (the read rows decoded exactly, per row) with the
  attention above.

``rms_norm``, ``rotary_emb``, ``compress_windows``, ``hc_post`` and ``hc_collapse`` keep the default kernels,
which are invariant by construction (see :data:`INVARIANT_BY_CONSTRUCTION`); ``candidate_blocks`` and
``fp4_kv_sim`` the core's native bodies (see :data:`NATIVE_BY_CONSTRUCTION`).
"""

from __future__ import annotations

import functools
from functools import partial

import torch

from deepinfer_core.ops import native
from deepinfer_nvidia_sm100 import hc_ops, triton_ops
from deepinfer_nvidia_sm100.triton_ops import _cdiv, _k, _pow2, _prec, _rows

#: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps) of the invariant GEMMs, by operand dtype
GEMM_TILES = {torch.float32: (32, 64, 32, 4), torch.bfloat16: (64, 64, 64, 4), torch.float16: (64, 64, 64, 4)}
#: float32 GEMMs with at most this many output columns (the mHC mixing GEMMs: N = (2+n)n, K = n * hidden)
SKINNY_N = 32
#: their tiles: the K loop is serial in every program, so small tiles spread it over more programs
SKINNY_TILES = (16, 16, 32, 4)
#: rows per block of the grouped MoE GEMMs
MOE_BLOCK_M = 64
#: candidates per program of the indexer scores
INDEXER_BLOCK_C = 64

#: default Triton kernels that are batch-invariant as they are: one program per row (token, window),
#: reductions only along that row with blocks set by the feature width, no cross-row work
INVARIANT_BY_CONSTRUCTION = frozenset({"rms_norm", "rotary_emb", "compress_windows", "hc_post", "hc_collapse"})
#: native bodies that are batch-invariant as they are, on any device: within a row only maxima, comparisons,
#: a stable sort and correctly rounded elementwise arithmetic (per block of that row's columns), no sum
NATIVE_BY_CONSTRUCTION = frozenset({"candidate_blocks", "fp4_kv_sim"})


@functools.lru_cache(maxsize=1)
def _kernels():
    _k()  # the interpreter patches, when interpreting
    from deepinfer_nvidia_sm100 import invariant_kernels

    return invariant_kernels


def gemm_tiles(dtype: torch.dtype, n: int) -> tuple[int, int, int, int]:
    """The tiles of a GEMM with ``n`` output columns: fixed per weight, whatever the number of rows."""
    return SKINNY_TILES if dtype == torch.float32 and n <= SKINNY_N else GEMM_TILES[dtype]


def _gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, groups: int) -> torch.Tensor:
    """x: [M, G, K] (last dim contiguous), weight: [G, N, K] -> [M, G, N] in x.dtype."""
    m, _, k = x.shape
    n = weight.shape[1]
    out = torch.empty((m, groups, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    block_m, block_n, block_k, warps = gemm_tiles(x.dtype, n)
    weight = _rows(weight)
    _kernels().matmul_kernel[(_cdiv(m, block_m), _cdiv(n, block_n), groups)](
        x, x.stride(0), x.stride(1), weight, weight.stride(0), weight.stride(1),
        bias.contiguous() if bias is not None else weight, out, out.stride(0), out.stride(1), m, n, k,
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_PREC=_prec(x.dtype),
        num_warps=warps,
    )
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    flat = _rows(x.reshape(-1, x.shape[-1]))
    out = _gemm(flat.unsqueeze(1), weight.unsqueeze(0), bias, 1)
    return out.view(*x.shape[:-1], weight.shape[0])


def grouped_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    tokens, groups, k = x.shape
    return _gemm(_rows(x), weight.view(groups, -1, k), None, groups)


def _mixing_mm(a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return linear(a, weight)


def swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    inter = gate_up.shape[-1] // 2
    x = _rows(gate_up.reshape(-1, 2 * inter))
    out = torch.empty((x.shape[0], inter), dtype=gate_up.dtype, device=gate_up.device)
    if out.numel():
        block = min(_pow2(inter), 1024)
        _kernels().swiglu_kernel[(x.shape[0], _cdiv(inter, block))](
            x, x.stride(0), out, out.stride(0), inter, float(limit), BLOCK=block, num_warps=4,
        )
    return out.view(*gate_up.shape[:-1], inter)


def moe_route(
    logits: torch.Tensor,
    scoring_func: str,
    top_k: int,
    correction_bias: torch.Tensor | None,
    fixed_ids: torch.Tensor | None,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    kern = _kernels()
    funcs = {"sqrtsoftplus": kern.SQRTSOFTPLUS, "sigmoid": kern.SIGMOID, "softmax": kern.SOFTMAX}
    if scoring_func not in funcs:
        raise ValueError(f"unknown scoring_func {scoring_func!r}; expected one of {sorted(funcs)}")
    tokens, experts = logits.shape
    weights = torch.empty((tokens, top_k), dtype=logits.dtype, device=logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.long, device=logits.device)
    if tokens == 0 or top_k == 0:
        return weights, ids
    logits = _rows(logits)
    fixed = _rows(fixed_ids.long()) if fixed_ids is not None else ids
    bias = correction_bias.contiguous() if correction_bias is not None else logits
    kern.moe_route_kernel[(tokens,)](
        logits, logits.stride(0), bias, fixed, fixed.stride(0), weights, ids, experts, top_k,
        float(routed_scaling_factor), FUNC=funcs[scoring_func], HAS_BIAS=correction_bias is not None,
        FIXED=fixed_ids is not None, BLOCK_E=max(_pow2(experts), 2), BLOCK_K=max(_pow2(top_k), 2), num_warps=4,
    )
    return weights, ids


def moe_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    swiglu_limit: float,
) -> torch.Tensor:
    if x.shape[0] == 0:
        return torch.zeros_like(x)
    lay = triton_ops.moe_layout(x, w13, topk_ids, topk_weights, block_m=MOE_BLOCK_M)
    return _sum_slots(triton_ops.moe_slots(x, w13, w2, lay, swiglu_limit), lay, x)


def _sum_slots(slots: torch.Tensor, lay: triton_ops.MoeLayout, x: torch.Tensor) -> torch.Tensor:
    """[pairs, d] float32 slot outputs -> [tokens, d] in x.dtype, a token's k summed in slot order by one
    program."""
    out = torch.empty_like(x)
    block_d = min(_pow2(lay.d), 1024)
    _kernels().sum_slots_kernel[(lay.tokens, _cdiv(lay.d, block_d))](slots, out, lay.k, lay.d, BLOCK_D=block_d,
                                                                      num_warps=4)
    return out


def _grouped(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, swiglu_limit, quant_act, block, packed):
    """The FP4 MoE kernels (:func:`.triton_ops.grouped_moe_slots`) with their M-block fixed, then the slots
    summed as :func:`moe_experts` sums them."""
    if x.shape[0] == 0:
        return torch.zeros_like(x)
    slots, lay = triton_ops.grouped_moe_slots(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights,
                                              swiglu_limit, quant_act, block, packed, block_m=MOE_BLOCK_M)
    return _sum_slots(slots, lay, x)


def moe_experts_fp4(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, swiglu_limit, quant_act):
    return _grouped(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, swiglu_limit, quant_act, 128, True)


def moe_experts_fp4_quant_act(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, swiglu_limit, block):
    return _grouped(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, swiglu_limit, True, block, True)


def moe_experts_quant_act(x, w13, w2, topk_ids, topk_weights, swiglu_limit, block):
    return _grouped(x, w13, None, w2, None, topk_ids, topk_weights, swiglu_limit, True, block, False)


def moe_experts_act_quant(x, w13, w2, topk_ids, topk_weights, swiglu_limit):
    return _grouped(x, w13, None, w2, None, topk_ids, topk_weights, swiglu_limit, True, 128, False)


def sparse_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    extra_kv: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    return triton_ops.sparse_attention(q, kv, indices, sinks, scale, extra_kv, extra_indices, keep_extra=True,
                                       splits=1)


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    candidates: torch.Tensor,
    topk: int,
    scale: float,
) -> torch.Tensor:
    return triton_ops.indexer_topk(q, weights, keys, candidates, topk, scale, block_c=INDEXER_BLOCK_C)


def indexer_scores(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, candidates: torch.Tensor, scale: float
) -> torch.Tensor:
    return triton_ops.indexer_scores(q, weights, keys, candidates, scale, block_c=INDEXER_BLOCK_C)


hc_pre = partial(hc_ops.hc_pre, mm=_mixing_mm)
hc_head = partial(hc_ops.hc_head, mm=_mixing_mm)
hc_mixes = partial(hc_ops.hc_mixes, mm=_mixing_mm)
linear_fp8 = partial(native.linear_fp8, linear=linear)
moe_experts_fp8 = partial(native.moe_experts_fp8, linear=linear, swiglu=swiglu)

ALL_OPS = {
    "linear": linear,
    "grouped_linear": grouped_linear,
    "swiglu": swiglu,
    "moe_route": moe_route,
    "moe_experts": moe_experts,
    "sparse_attention": sparse_attention,
    "indexer_topk": indexer_topk,
    "hc_pre": hc_pre,
    "hc_head": hc_head,
    "linear_fp8": linear_fp8,
    "moe_experts_fp8": moe_experts_fp8,
    "moe_experts_fp4": moe_experts_fp4,
}
# FP8 KV entries: the read rows decoded exactly (per row), then the attention above
ALL_OPS["sparse_attention_fp8"] = partial(native.sparse_attention_fp8, attention=sparse_attention)
ALL_OPS["linear_fp8_ue8m0"] = partial(native.linear_fp8_ue8m0, linear=linear)
ALL_OPS["moe_experts_act_quant"] = moe_experts_act_quant
# DeepSeek-V4.1
ALL_OPS["indexer_scores"] = indexer_scores
ALL_OPS["hc_mixes"] = hc_mixes
ALL_OPS["moe_experts_quant_act"] = moe_experts_quant_act
ALL_OPS["moe_experts_fp4_quant_act"] = moe_experts_fp4_quant_act
#: kernels of this module that serve the default mode too: the routing's one program a token replaces
#: torch's sort over the experts and its gathers (21 us for the sort alone at batch 1 on the H200)
DEFAULT_OPS = {"moe_route": moe_route}
#: the native loop over experts, which reads the counts back to the host
SYNCS_HOST = frozenset({"moe_experts_fp8"})

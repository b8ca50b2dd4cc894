"""Adapters to DeepSeek's own kernel libraries: ordinary registered implementations whose predicate
decides once, at build time, that the library is importable and that a self-check on the device agrees
with the core's native body.

* FlashMLA ``flash_mla_sparse_fwd(q[s_q, h_q, d], kv[s_kv, h_kv, d], indices[s_q, h_kv, topk] int32
  (-1 = invalid), sm_scale, d_v) -> (out, max_logits, lse)`` serves ``sparse_attention`` in bfloat16
  with 64 or 128 heads of dimension 512: one call per pool (window, compressed) without the sink, the
  two partial softmaxes and the sink merged here through their log-sum-exps.
* FlashMLA ``flash_mla_with_kvcache(q[b, 1, h, 512], k_cache, None, None, 512, get_mla_metadata()[0],
  is_fp8_kvcache=True, indices[b, 1, topk] int32, attn_sink, extra_k_cache, extra_indices_in_kvcache)``
  serves ``sparse_attention_fp8`` on DeepSeek's FP8 entries up to 256 query tokens: the rows a call reads
  are gathered into one-token pages at a 16-byte-aligned stride, each query token a batch row.
* DeepGEMM ``m_grouped_bf16_gemm_nt_contiguous(a[M, K], b[G, N, K], d[M, N], m_indices[M] int32)``
  (rows sorted by group, each group's run padded to the library's M alignment, padding rows -1)
  serves ``moe_experts`` in bfloat16.
* DeepGEMM ``fp8_gemm_nt((a, sfa), (b, sfb), d)`` (a [M, K] E4M3 with float32 scales [M, ceil(K/128)],
  b [N, K] E4M3 with [ceil(N/128), ceil(K/128)], d [M, N] bfloat16) serves ``linear_fp8`` and
  ``m_grouped_fp8_gemm_nt_contiguous((a, sfa), (b, sfb), d, m_indices)`` (b [G, N, K] with scales
  [G, ceil(N/128), ceil(K/128)]) serves ``moe_experts_fp8`` above :data:`MASKED_MAX_TOKENS` tokens when
  opted in (the backend's Triton FP8 MoE does otherwise),
  ``m_grouped_fp8_gemm_nt_masked((a, sfa), (b, sfb), d, masked_m, expected_m)`` (a [G, M, K], d [G, M, N],
  ``masked_m[g]`` rows of group g computed) up to it, all in bfloat16 with K a multiple of 128.
  Activations are quantised here with the catalogue's recipe; the library's bfloat16 output rounds
  gate/up before the SwiGLU, which the catalogue keeps in float32 (within bfloat16 tolerance).

The predicate (:attr:`Adapter.usable`) checks the device, the model dtype and the model's widths
against what the library takes (without a model config they are unknown and an engine build declines
the adapter), then runs the self-check once per device (cached) on small adversarial
inputs (NaN in unused pool rows, -1 slots, a query with no key); any exception or mismatch declines the
adapter and resolution picks the next implementation (the Triton kernel). Once chosen, an adapter calls
the library directly: no per-call shape test, no fallback.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from deepinfer_core.ops import native
from deepinfer_core.quant.fp8 import FP8_BLOCK, FP8_DTYPE, quantize_act_fp8, quantize_fp8_block
from deepinfer_nvidia_sm100 import capability

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Adapter:
    op: str
    library: str
    fn: Callable  # the registered implementation
    #: (device, dtype, model_config, self_check) -> (usable, reason when not); without ``self_check`` it
    #: judges on probes alone (nothing runs on the device)
    usable: Callable[[Any, Any, Any, bool], tuple[bool, str]]


#: an engine build without a model config: the library takes only some widths, and which the model has is
#: unknown (a probe-only listing shows the adapter as conditional instead)
_UNKNOWN_WIDTHS = "the model's widths are unknown (no model config); the library takes only some widths"


@functools.cache
def _library(module: str) -> ModuleType:
    """The library module, imported on an adapter's first call (its predicate found it importable)."""
    return importlib.import_module(module)


# --- FlashMLA: sparse attention ---------------------------------------------------------------------

FLASH_MLA_HEADS = (64, 128)
FLASH_MLA_HEAD_DIM = 512
FLASH_MLA_TOPK_MULTIPLE = 128


def merge_partial_attention(
    outs: list[torch.Tensor], lses: list[torch.Tensor], sinks: torch.Tensor
) -> torch.Tensor:
    """Combine per-pool attention results ``out_s = softmax-weighted sum`` with log-sum-exps ``lse_s``
    (non-finite = the pool had no key for that query) and a per-head sink that only enters the
    denominator: ``sum_s e^{lse_s} out_s / (sum_s e^{lse_s} + e^{sink})``. Shapes [T, H, D], [T, H], [H]."""
    lse = torch.stack([x.float() for x in lses])  # [S, T, H]
    lse = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, float("-inf")))
    sink = sinks.float().view(1, -1).expand_as(lse[0])
    m = torch.maximum(lse.amax(0), sink).clamp(min=-1e30)
    w = torch.exp(lse - m)
    total = w.sum(0) + torch.exp(sink - m)
    out = sum(w[s].unsqueeze(-1) * outs[s].float() for s in range(len(outs)))
    return out / total.unsqueeze(-1)


def flash_mla_attention_with(
    sparse_fwd: Callable, q, kv, indices, sinks, scale, extra_kv=None, extra_indices=None
) -> torch.Tensor:
    """``sparse_attention`` through a ``flash_mla_sparse_fwd``-like callable (separated for tests)."""
    segments = [(kv, indices)]
    if extra_kv is not None and extra_indices is not None and extra_indices.shape[-1] > 0:
        segments.append((extra_kv, extra_indices))
    d = q.shape[-1]
    outs, lses = [], []
    for pool, idx in segments:
        rows = pool.shape[0]
        idx = torch.where((idx >= 0) & (idx < rows), idx, torch.full_like(idx, -1))
        pad = -idx.shape[-1] % FLASH_MLA_TOPK_MULTIPLE
        if pad:
            idx = torch.nn.functional.pad(idx, (0, pad), value=-1)
        idx = idx.to(torch.int32).unsqueeze(1).contiguous()  # [T, h_kv = 1, topk]
        result = sparse_fwd(q.contiguous(), pool.contiguous().view(rows, 1, d), idx, float(scale), d)
        outs.append(result[0])
        lses.append(result[2])
    return merge_partial_attention(outs, lses, sinks).to(q.dtype)


def flash_mla_sparse_attention(q, kv, indices, sinks, scale, extra_kv=None, extra_indices=None):
    """``sparse_attention`` through ``flash_mla.flash_mla_sparse_fwd`` (bfloat16, 64 or 128 heads x 512)."""
    fwd = _library("flash_mla").flash_mla_sparse_fwd
    return flash_mla_attention_with(fwd, q, kv, indices, sinks, scale, extra_kv, extra_indices)


def _declined(device, dtype, model_config, self_check) -> tuple[bool, str] | None:
    """What every adapter's predicate declines: a device below compute capability 9.0, a model dtype other
    than bfloat16, and, for a build that runs the self-check, unknown model widths."""
    cap = capability.device_capability(capability.as_device(device))
    if cap is None or cap < (9, 0):
        return False, "needs a CUDA device of compute capability 9.0+"
    if dtype is not None and dtype != torch.bfloat16:
        return False, "bfloat16 only"
    if model_config is None and self_check:
        return False, _UNKNOWN_WIDTHS
    return None


def _flash_mla_usable(device, dtype, model_config, self_check) -> tuple[bool, str]:
    if declined := _declined(device, dtype, model_config, self_check):
        return declined
    device = capability.as_device(device)
    if model_config is not None:
        heads, head_dim = model_config.num_attention_heads, model_config.head_dim
        if heads not in FLASH_MLA_HEADS or head_dim != FLASH_MLA_HEAD_DIM:
            return False, f"{heads} heads x {head_dim}: FlashMLA takes {FLASH_MLA_HEADS} heads x 512"
    if not capability.library_feature("flash_mla", "flash_mla_sparse_fwd"):
        return False, "flash_mla with flash_mla_sparse_fwd is not importable"
    if self_check:
        return _self_check("flash_mla", str(device))
    return True, ""


# --- FlashMLA: sparse decode over DeepSeek's FP8 KV entries ------------------------------------------

FLASH_MLA_DECODE_TOPK_MULTIPLE = 64  # the sm90 sparse decode kernel's TOPK_BLOCK_SIZE
FLASH_MLA_ROW_ALIGN = 16  # its 128-bit loads of a KV row
#: calls of more query tokens (prefill chunks) take the Triton kernel: the gathered pages are
#: tokens x picks x 592 bytes (97 MB at 256 tokens of 640 picks)
FLASH_MLA_DECODE_MAX_TOKENS = 256
FLASH_MLA_ROPE = (64, torch.bfloat16)  # the FP8 entry FlashMLA reads: 448 E4M3 values, then 64 bf16 RoPE ones


def flash_mla_pages(pool: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 entries ``pool`` [N, B] at ``indices`` [T, K] (-1: none) as FlashMLA's k_cache of one-token pages
    [T * K + 1, 1, 1, B] at a 16-byte-aligned row stride (the engine's 584-byte rows start on 16 bytes only
    every other row), and the indices into it [T, 1, K'] int32, -1 kept, K' padded to a multiple of 64."""
    tokens, k = indices.shape
    rows, width = pool.shape
    stride = -(-width // FLASH_MLA_ROW_ALIGN) * FLASH_MLA_ROW_ALIGN
    valid = (indices >= 0) & (indices < rows)
    pages = torch.empty((tokens * k + 1, stride), dtype=torch.uint8, device=pool.device)
    pages[: tokens * k, :width] = pool.view(torch.uint8)[torch.where(valid, indices, 0).reshape(-1)]
    own = torch.arange(tokens * k, device=pool.device).view(tokens, k)
    idx = torch.where(valid, own, -1)
    pad = -k % FLASH_MLA_DECODE_TOPK_MULTIPLE
    if pad:
        idx = torch.nn.functional.pad(idx, (0, pad), value=-1)
    return pages[:, :width].view(-1, 1, 1, width), idx.to(torch.int32).view(tokens, 1, -1)


def flash_mla_fp8_attention_with(fm: Any, q, kv, indices, sinks, scale, extra_kv=None, extra_indices=None
                                 ) -> torch.Tensor:
    """``sparse_attention_fp8`` (FlashMLA's FP8 entry) through a module with ``flash_mla_with_kvcache`` and
    ``get_mla_metadata`` (for tests too): each query token a batch row of one query, new scheduler
    metadata every call (its reuse needs equal shapes, which a caller's graph sizes do not promise)."""
    tokens, heads, d = q.shape
    kcache, idx = flash_mla_pages(kv, indices)
    ekcache = eidx = None
    if extra_kv is not None and extra_indices is not None and extra_indices.shape[-1] > 0:
        ekcache, eidx = flash_mla_pages(extra_kv, extra_indices)
    out, _ = fm.flash_mla_with_kvcache(
        q.contiguous().view(tokens, 1, heads, d), kcache, None, None, d, fm.get_mla_metadata()[0], None,
        softmax_scale=float(scale), causal=False, is_fp8_kvcache=True, indices=idx,
        attn_sink=sinks.float().contiguous(), extra_k_cache=ekcache, extra_indices_in_kvcache=eidx)
    return out.view(tokens, heads, d).to(q.dtype)


def flash_mla_sparse_attention_fp8(q, kv, indices, sinks, scale, rope_dim, rope_dtype, extra_kv=None,
                                   extra_indices=None):
    """``sparse_attention_fp8`` through FlashMLA's sparse decode for decode-sized calls of its entry
    (bfloat16 queries of 64 or 128 heads x 512, 64 bf16 RoPE values); the Triton kernel otherwise."""
    tokens, heads, d = q.shape
    if not tokens:
        return torch.zeros_like(q)
    if (tokens > FLASH_MLA_DECODE_MAX_TOKENS or (rope_dim, rope_dtype) != FLASH_MLA_ROPE
            or q.dtype != torch.bfloat16 or heads not in FLASH_MLA_HEADS or d != FLASH_MLA_HEAD_DIM):
        from deepinfer_nvidia_sm100 import triton_ops

        return triton_ops.sparse_attention_fp8(q, kv, indices, sinks, scale, rope_dim, rope_dtype, extra_kv,
                                               extra_indices)
    return flash_mla_fp8_attention_with(_library("flash_mla"), q, kv, indices, sinks, scale, extra_kv, extra_indices)


def _flash_mla_fp8_usable(device, dtype, model_config, self_check) -> tuple[bool, str]:
    """The bf16 adapter's device, dtype and width tests (not its self-check), then this one's."""
    if model_config is None and self_check:
        return False, _UNKNOWN_WIDTHS
    ok, reason = _flash_mla_usable(device, dtype, model_config, False)
    if not ok:
        return ok, reason
    for name in ("flash_mla_with_kvcache", "get_mla_metadata"):
        if not capability.library_feature("flash_mla", name):
            return False, f"flash_mla with {name} is not importable"
    if self_check:
        return _self_check("flash_mla_fp8", str(capability.as_device(device)))
    return True, ""


def _attention_fp8_check_inputs(device: torch.device):
    from deepinfer_core.quant.kv_fp8 import pack_kv_fp8

    q, kv, idx, sinks, scale, ekv, eidx = _attention_check_inputs(torch.device("cpu"))
    rope_dim, rope_dtype = FLASH_MLA_ROPE
    args = (q, pack_kv_fp8(kv, rope_dim), idx, sinks, scale, rope_dim, rope_dtype, pack_kv_fp8(ekv, rope_dim), eidx)
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def _attention_check_inputs(device: torch.device):
    g = torch.Generator(device="cpu").manual_seed(0)
    tokens, heads, d = 3, 64, FLASH_MLA_HEAD_DIM
    q = torch.randn(tokens, heads, d, generator=g)
    kv = torch.randn(200, d, generator=g)
    kv[0] = float("nan")
    ekv = torch.randn(64, d, generator=g)
    ekv[-1] = float("nan")
    idx = torch.randint(1, 200, (tokens, 70), generator=g)
    idx[0, 10:] = -1
    idx[1] = -1
    eidx = torch.randint(0, 63, (tokens, 9), generator=g)
    eidx[1] = -1
    eidx[2, :4] = -1
    sinks = torch.randn(heads, generator=g)
    args = (q.bfloat16(), kv.bfloat16(), idx, sinks, d**-0.5, ekv.bfloat16(), eidx)
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


# --- DeepGEMM: grouped MoE GEMMs --------------------------------------------------------------------


@functools.cache
def _deep_gemm_alignment() -> int:
    """The M alignment of DeepGEMM's contiguous grouped layout (asked once)."""
    module = _library("deep_gemm")
    for name in ("get_mk_alignment_for_contiguous_layout", "get_m_alignment_for_contiguous_layout"):
        fn = getattr(module, name, None)
        if callable(fn):
            return int(fn())
    return 128


def deep_gemm_moe_with(gemm: Callable, align: int, x, w13, w2, topk_ids, topk_weights, swiglu_limit):
    """``moe_experts`` through an ``m_grouped_bf16_gemm_nt_contiguous``-like callable (for tests too)."""
    from deepinfer_nvidia_sm100.triton_ops import expert_layout

    tokens, d = x.shape
    k = topk_ids.shape[-1]
    pairs = tokens * k
    sorted_pairs, block_expert = expert_layout(topk_ids, w13.shape[0], align)
    row_ok = sorted_pairs < pairs
    m_indices = torch.where(row_ok, block_expert.repeat_interleave(align), -1).to(torch.int32)
    a = x[torch.where(row_ok, sorted_pairs // k, 0)].contiguous()
    gate_up = torch.empty((a.shape[0], w13.shape[1]), dtype=x.dtype, device=x.device)
    gemm(a, w13, gate_up, m_indices)
    h = native.swiglu(gate_up.float(), swiglu_limit).to(x.dtype).contiguous()  # SwiGLU in float32
    down = torch.empty((a.shape[0], d), dtype=x.dtype, device=x.device)
    gemm(h, w2, down, m_indices)
    return _combine(down, sorted_pairs, topk_weights, tokens, k, x.dtype)


def _combine(down: torch.Tensor, sorted_pairs: torch.Tensor, topk_weights: torch.Tensor, tokens: int,
             k: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of expert outputs (in ``sorted_pairs`` order; padding rows any value) -> the weighted sum per
    token in float32, a token's k in slot order, in ``dtype``; a pair with no row (an expert of another
    rank) adds 0. On a CUDA device one Triton launch."""
    pairs = tokens * k
    rows = sorted_pairs.shape[0]
    row_of = torch.full((pairs + 1,), rows, dtype=torch.long, device=down.device)
    row_of.scatter_(0, sorted_pairs, torch.arange(rows, device=down.device))  # padding rows all land on `pairs`
    return _sum_rows(down, row_of[:pairs], topk_weights.reshape(-1).float(), tokens, k, dtype)


def _sum_rows(rows: torch.Tensor, row_of: torch.Tensor, weights: torch.Tensor, tokens: int, k: int,
              dtype: torch.dtype) -> torch.Tensor:
    """``fp8_ops.combine_rows``: on a CUDA device one Triton launch, else :func:`combine_rows_torch`."""
    row_of, weights = row_of.contiguous(), weights.contiguous()
    if _triton_quantises(rows.device):
        from deepinfer_nvidia_sm100 import fp8_ops

        return fp8_ops.combine_rows(rows, row_of, weights, tokens, k, dtype)
    return combine_rows_torch(rows, row_of, weights, tokens, k, dtype)


def combine_rows_torch(rows: torch.Tensor, row_of: torch.Tensor, weights: torch.Tensor, tokens: int, k: int,
                       dtype: torch.dtype) -> torch.Tensor:
    """``fp8_ops.combine_rows`` in torch ops."""
    n, d = rows.shape
    has_row = row_of < n
    picked = rows[row_of.clamp(max=n - 1)].float().view(tokens, k, d)
    weights = torch.where(has_row, weights, 0.0).view(tokens, k, 1)
    return torch.where(has_row.view(tokens, k, 1), picked * weights, 0.0).sum(dim=1).to(dtype)


def deep_gemm_moe_experts(x, w13, w2, topk_ids, topk_weights, swiglu_limit):
    """``moe_experts`` through ``deep_gemm.m_grouped_bf16_gemm_nt_contiguous`` (bfloat16)."""
    if x.shape[0] == 0:
        return torch.zeros_like(x)
    gemm = _library("deep_gemm").m_grouped_bf16_gemm_nt_contiguous
    return deep_gemm_moe_with(gemm, _deep_gemm_alignment(), x, w13, w2, topk_ids, topk_weights, swiglu_limit)


def _moe_check_inputs(device: torch.device):
    g = torch.Generator(device="cpu").manual_seed(0)
    tokens, d, inter, experts, k = 9, 256, 256, 4, 3
    x = torch.randn(tokens, d, generator=g)
    w13 = torch.randn(experts, 2 * inter, d, generator=g) * d**-0.5
    w2 = torch.randn(experts, d, inter, generator=g) * inter**-0.5
    ids = torch.randint(0, experts, (tokens, k), generator=g)
    ids[0] = -1
    ids[3, 1] = -1
    weights = torch.rand(tokens, k, generator=g) + 0.2
    args = (x.bfloat16(), w13.bfloat16(), w2.bfloat16(), ids, weights, 10.0)
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


# --- DeepGEMM: block-FP8 GEMMs -----------------------------------------------------------------------


@functools.cache
def _triton_quantises(device: torch.device) -> bool:
    return device.type == "cuda" and capability.triton_usable(device)[0]


def _quantize_act(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The operand DeepGEMM takes for activation rows: E4M3 and float32 scales per 128 columns. On a CUDA
    device the Triton kernel (one launch, bit for bit :func:`quantize_act_fp8`) with the scales already in
    the MN-major layout DeepGEMM would otherwise transpose them into; else that torch function, a dozen
    launches and float32 copies of the rows."""
    if not _triton_quantises(x2.device):
        return quantize_act_fp8(x2)
    from deepinfer_nvidia_sm100 import fp8_ops

    return fp8_ops.quantize_act(x2 if x2.stride(-1) == 1 else x2.contiguous(), mn_major=True)


def _quantize_rows(x: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, rows: int, slabs: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_quantize_act` of rows ``src`` of ``x`` [T, K] put in rows ``dst`` (``rows`` or more: none) of
    ``rows`` rows, or of ``slabs`` slabs of ``rows / slabs`` rows ([slabs, M, K], [slabs, M, K / 128]);
    the rows nothing is put in are left unset on a CUDA device (the masked GEMM computes them into rows
    nothing reads), 0 elsewhere. On a CUDA device one Triton launch, with no copy of the rows between."""
    k = x.shape[1]
    if not _triton_quantises(x.device):
        q, s = _scatter_rows(*quantize_act_fp8(x), src, dst, rows)
        s = s if slabs is None else s.view(slabs, -1, s.shape[1])
    else:
        from deepinfer_nvidia_sm100 import fp8_ops

        q = torch.empty((rows, k), dtype=FP8_DTYPE, device=x.device)
        s = fp8_ops.mn_major_scales(rows // (slabs or 1), -(-k // FP8_BLOCK), x.device, slabs=slabs)
        fp8_ops.quantize_act_rows(x if x.stride(-1) == 1 else x.contiguous(), src, dst, q, s)
    return (q, s) if slabs is None else (q.view(slabs, -1, k), s)


def deep_gemm_linear_fp8_with(gemm: Callable, x, weight, weight_scale) -> torch.Tensor:
    """``linear_fp8`` through an ``fp8_gemm_nt``-like callable (for tests too)."""
    n, k = weight.shape
    xq, xs = _quantize_act(x.reshape(-1, k))
    out = torch.empty((xq.shape[0], n), dtype=torch.bfloat16, device=x.device)
    gemm((xq, xs), (weight, weight_scale.float()), out)
    return out.view(*x.shape[:-1], n).to(x.dtype)


def _swiglu_quantize(gate_up: torch.Tensor, limit: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_quantize_act` of ``native.swiglu`` in float32: on a CUDA device one Triton launch."""
    if not _triton_quantises(gate_up.device):
        return quantize_act_fp8(native.swiglu(gate_up.float(), limit))
    from deepinfer_nvidia_sm100 import fp8_ops

    return fp8_ops.swiglu_quantize(gate_up, limit, mn_major=True)


def deep_gemm_moe_fp8_with(gemm: Callable, align: int, x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights,
                           swiglu_limit) -> torch.Tensor:
    """``moe_experts_fp8`` through an ``m_grouped_fp8_gemm_nt_contiguous``-like callable (for tests too): the
    tokens quantised once and their E4M3 rows gathered into the layout, SwiGLU and its quantisation in one
    pass over the gate/up rows."""
    from deepinfer_nvidia_sm100.triton_ops import expert_layout

    tokens, d = x.shape
    k = topk_ids.shape[-1]
    sorted_pairs, block_expert = expert_layout(topk_ids, w13.shape[0], align)
    row_ok = sorted_pairs < tokens * k
    m_indices = torch.where(row_ok, block_expert.repeat_interleave(align), -1).to(torch.int32)
    a = _quantize_rows(x, torch.where(row_ok, sorted_pairs // k, 0), torch.arange(len(sorted_pairs), device=x.device),
                       len(sorted_pairs))
    gate_up = torch.empty((a[0].shape[0], w13.shape[1]), dtype=torch.bfloat16, device=x.device)
    gemm(a, (w13, w13_scale.float()), gate_up, m_indices)
    h = _swiglu_quantize(gate_up, swiglu_limit)
    down = torch.empty((a[0].shape[0], d), dtype=torch.bfloat16, device=x.device)
    gemm(h, (w2, w2_scale.float()), down, m_indices)
    return _combine(down, sorted_pairs, topk_weights, tokens, k, x.dtype)


#: MoE calls of at most this many tokens (decode steps) take the masked grouped GEMM: a slab per expert (the
#: tokens rounded up to 128 rows) of which only the expert's own rows are computed, laid out on the device
#: (CUDA-graph safe); the
#: contiguous layout pads every expert to the library's M alignment (128 rows), which at 256 experts and
#: a decode batch multiplies the rows computed by up to 256 x 128 / (tokens x k)
MASKED_MAX_TOKENS = 64
#: rows of each expert's slab are a multiple of this: the masked kernels store whole tiles of up to 128 rows
#: through one 2-D view of all slabs, so a slab of fewer rows has its last tile land in the next expert's
MASKED_M_ALIGN = 128


def masked_layout(topk_ids: torch.Tensor, topk_weights: torch.Tensor, groups: int, max_m: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row of every ``token * k + slot`` pair in a flat [groups * max_m + 1] slab: expert * max_m + its rank
    among the expert's pairs, or the last row (trash) for an id outside ``[0, groups)``; pairs per expert
    [groups] int32; the pairs' weights, flat). A slot repeating an id of an earlier slot of its token (a
    hash table may repeat one) goes to the trash, its weight added to that slot's: so no expert has more
    pairs than there are tokens (at most ``max_m``)."""
    tokens, k = topk_ids.shape[0], topk_ids.shape[-1]
    ids = topk_ids.reshape(tokens, k)
    same = ids.unsqueeze(2) == ids.unsqueeze(1)  # [T, slot, earlier slot]
    first = same.int().argmax(dim=-1)  # the first slot of each slot's id
    weights = torch.zeros_like(topk_weights.reshape(tokens, k), dtype=torch.float32)
    weights.scatter_add_(1, first, topk_weights.reshape(tokens, k).float())
    flat = ids.reshape(-1)
    valid = (flat >= 0) & (flat < groups) & (first == torch.arange(k, device=ids.device)).reshape(-1)
    key = torch.where(valid, flat, groups)
    # rank among the expert's pairs in pair order, by a running count per expert: at most
    # MASKED_MAX_TOKENS * k pairs, where a sort's launches cost more than this [pairs, groups + 1] table
    seen = (key.unsqueeze(1) == torch.arange(groups + 1, device=flat.device)).cumsum(0, dtype=torch.int32)
    rank = seen.gather(1, key.unsqueeze(1)).squeeze(1).long() - 1
    dest = torch.where(valid, key * max_m + rank, groups * max_m)
    counts = seen[-1, :groups] if len(key) else torch.zeros(groups, dtype=torch.int32, device=flat.device)
    return dest, counts, weights.reshape(-1)


def _masked_layout(topk_ids: torch.Tensor, topk_weights: torch.Tensor, groups: int, max_m: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`masked_layout` and each pair's token: on a CUDA device one Triton launch, not two dozen."""
    if _triton_quantises(topk_ids.device):
        from deepinfer_nvidia_sm100 import fp8_ops

        return fp8_ops.masked_layout(topk_ids, topk_weights, groups, max_m)
    k = topk_ids.shape[-1]
    token = torch.arange(topk_ids.numel(), device=topk_ids.device) // k
    return (*masked_layout(topk_ids, topk_weights, groups, max_m), token)


def _scatter_rows(q: torch.Tensor, s: torch.Tensor, source: torch.Tensor, dest: torch.Tensor, rows: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 rows ``q`` and their scales ``s``, row ``source[i]`` to row ``dest[i]`` (``rows``: a trash row)
    of ``rows`` rows; unfilled scales are 0."""
    qs = torch.empty((rows + 1, q.shape[1]), dtype=q.dtype, device=q.device)
    ss = torch.zeros((rows + 1, s.shape[1]), dtype=s.dtype, device=s.device)
    qs.view(torch.uint8)[dest] = q.view(torch.uint8)[source]  # no index_put for float8 on every build
    ss[dest] = s[source]
    return qs[:rows], ss[:rows]


def _swiglu_quantize_slab(gate_up: torch.Tensor, limit: float, dest: torch.Tensor, groups: int
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The masked down GEMM's operand: :func:`_swiglu_quantize` of slab rows ``dest`` of ``gate_up``
    [slab rows, 2I] (a pair in the trash, ``dest`` = slab rows, skipped), in the same rows of a new slab
    ([groups, M, I], [groups, M, I / 128]; unfilled rows as in :func:`_quantize_rows`). On a CUDA device one
    Triton launch."""
    slab, inter = gate_up.shape[0], gate_up.shape[1] // 2
    if not _triton_quantises(gate_up.device):
        pairs = torch.arange(dest.numel(), device=dest.device)
        q, s = _scatter_rows(*_swiglu_quantize(gate_up[dest.clamp(max=slab - 1)], limit), pairs, dest, slab)
        return q.view(groups, -1, inter), s.view(groups, -1, s.shape[1])
    from deepinfer_nvidia_sm100 import fp8_ops

    q = torch.empty((slab, inter), dtype=FP8_DTYPE, device=gate_up.device)
    s = fp8_ops.mn_major_scales(slab // groups, -(-inter // FP8_BLOCK), gate_up.device, slabs=groups)
    fp8_ops.swiglu_quantize_rows(gate_up, limit, dest.contiguous(), q, s)
    return q.view(groups, -1, inter), s


def deep_gemm_moe_fp8_masked_with(gemm: Callable, x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights,
                                  swiglu_limit) -> torch.Tensor:
    """``moe_experts_fp8`` through an ``m_grouped_fp8_gemm_nt_masked``-like callable ``gemm((a, sfa), (b, sfb),
    d, masked_m, expected_m)`` with a [G, M, K] slab per operand, M the tokens rounded up to
    :data:`MASKED_M_ALIGN` (for tests too)."""
    tokens, d = x.shape
    k = topk_ids.shape[-1]
    groups, n13 = w13.shape[0], w13.shape[1]
    max_m = -(-tokens // MASKED_M_ALIGN) * MASKED_M_ALIGN
    rows = groups * max_m
    dest, masked_m, weights, token = _masked_layout(topk_ids, topk_weights, groups, max_m)
    expected_m = max(1, -(-tokens * k // groups))
    gate_up = torch.empty((groups, max_m, n13), dtype=torch.bfloat16, device=x.device)
    gemm(_quantize_rows(x, token, dest, rows, groups), (w13, w13_scale.float()), gate_up, masked_m, expected_m)
    h = _swiglu_quantize_slab(gate_up.view(rows, n13), swiglu_limit, dest, groups)
    down = torch.empty((groups, max_m, d), dtype=torch.bfloat16, device=x.device)
    gemm(h, (w2, w2_scale.float()), down, masked_m, expected_m)
    return _sum_rows(down.view(rows, d), dest, weights, tokens, k, x.dtype)  # dest = rows: the trash, adds 0


def deep_gemm_linear_fp8(x, weight, weight_scale):
    """``linear_fp8`` through ``deep_gemm.fp8_gemm_nt`` (bfloat16 activations, K a multiple of 128)."""
    if x.numel() == 0:
        return x.new_empty((*x.shape[:-1], weight.shape[0]))
    return deep_gemm_linear_fp8_with(_library("deep_gemm").fp8_gemm_nt, x, weight, weight_scale)


def deep_gemm_moe_experts_fp8(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, swiglu_limit):
    """``moe_experts_fp8`` through ``deep_gemm.m_grouped_fp8_gemm_nt_masked`` up to
    :data:`MASKED_MAX_TOKENS` tokens; above, ``m_grouped_fp8_gemm_nt_contiguous`` where the experts average
    :data:`CONTIGUOUS_MIN_ROWS` rows (:func:`_takes_contiguous`), else the backend's Triton FP8 MoE."""
    if x.numel() == 0:
        return torch.zeros_like(x)
    args = (x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, swiglu_limit)
    if x.shape[0] <= MASKED_MAX_TOKENS:
        return deep_gemm_moe_fp8_masked_with(_masked_fp8_gemm(), *args)
    if _takes_contiguous(topk_ids.numel(), w13.shape[0], x.device):
        return _deep_gemm_moe_fp8_contiguous(*args)
    from deepinfer_nvidia_sm100 import fp8_ops

    return fp8_ops.moe_experts_fp8(*args)


def _deep_gemm_moe_fp8_contiguous(*args) -> torch.Tensor:
    return deep_gemm_moe_fp8_with(_library("deep_gemm").m_grouped_fp8_gemm_nt_contiguous, _deep_gemm_alignment(),
                                  *args)


#: a call above MASKED_MAX_TOKENS tokens whose (token, slot) pairs average at least this many rows per expert
#: takes DeepGEMM's contiguous GEMM: its layout pads every expert's rows to 128, so fewer rows compute
#: mostly padding. On an H200 at V4-Flash widths (256 experts, top 6; 96 rows per expert) 4096 tokens took
#: 2.64 ms in its two GEMMs and 4.39 ms in all, before the combine's one launch, against the Triton FP8
#: MoE's 4.37 ms
CONTIGUOUS_MIN_ROWS = 64
_CONTIGUOUS_OK: dict[str, bool] = {}  # device -> whether the contiguous GEMM passed its self-check


def _takes_contiguous(pairs: int, experts: int, device: torch.device) -> bool:
    """Whether a call of ``pairs`` (token, slot) pairs over ``experts`` takes the contiguous GEMM: by
    :data:`CONTIGUOUS_MIN_ROWS` unless :data:`DEEPGEMM_CONTIGUOUS_MOE_ENV` says (1: always, 0: never), and
    only where its self-check passed (run here if it has not been, but never inside a CUDA graph capture)."""
    forced = _contiguous_fp8_moe()
    if forced is False or (forced is None and pairs < CONTIGUOUS_MIN_ROWS * experts):
        return False
    if _device_key(device) not in _CONTIGUOUS_OK and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    return _contiguous_passes(device)


def _device_key(device: torch.device) -> str:
    """``device`` with its index ("cuda" and "cuda:0" are one device to the self-check's cache)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


def _contiguous_passes(device: torch.device) -> bool:
    """Whether DeepGEMM's contiguous FP8 GEMM is there and passed its self-check on ``device`` (run once)."""
    key = _device_key(device)
    if key not in _CONTIGUOUS_OK:
        _CONTIGUOUS_OK[key] = (capability.library_feature("deep_gemm", "m_grouped_fp8_gemm_nt_contiguous")
                               and _self_check("deep_gemm_moe_fp8_contiguous", key)[0])
    return _CONTIGUOUS_OK[key]


def _contiguous_fp8_moe() -> bool | None:
    """:data:`DEEPGEMM_CONTIGUOUS_MOE_ENV`: True (1), False (0), None (unset: by rows per expert)."""
    return {"1": True, "0": False}.get(os.environ.get(DEEPGEMM_CONTIGUOUS_MOE_ENV, ""))


@functools.cache
def _masked_fp8_gemm() -> Callable:
    """DeepGEMM's masked grouped FP8 GEMM with float32 scales kept as they are (Hopper's recipe)."""
    gemm = _library("deep_gemm").m_grouped_fp8_gemm_nt_masked
    return functools.partial(gemm, disable_ue8m0_cast=True)


def _gemm_dims(model_config: Any, feature: str) -> dict[str, int]:
    """The K (and N) widths the model hands a DeepGEMM ``feature``: they must be multiples of 128."""
    dims = {"hidden_size": model_config.hidden_size, "moe_intermediate_size": model_config.moe_intermediate_size}
    if feature == "fp8_gemm_nt":  # every projection of the model may be an FP8 linear
        dims["q_lora_rank"] = getattr(model_config, "q_lora_rank", None)
        groups, rank = getattr(model_config, "o_groups", None), getattr(model_config, "o_lora_rank", None)
        dims["o_groups * o_lora_rank"] = groups * rank if groups and rank else None
    return {name: n for name, n in dims.items() if n}


def _deep_gemm_usable(feature: str, check: str, *more: tuple[str, str]
                      ) -> Callable[[Any, Any, Any, bool], tuple[bool, str]]:
    """Usable when every (feature, check) pair is: the library has the feature, its self-check passes."""
    pairs = [(feature, check), *more]

    def usable(device, dtype, model_config, self_check) -> tuple[bool, str]:
        if declined := _declined(device, dtype, model_config, self_check):
            return declined
        device = capability.as_device(device)
        if model_config is not None:
            dims = _gemm_dims(model_config, feature)
            if any(n % FP8_BLOCK for n in dims.values()):
                return False, f"model widths {dims} are not all multiples of {FP8_BLOCK}"
        for name, _ in pairs:
            if not capability.library_feature("deep_gemm", name):
                return False, f"deep_gemm with {name} is not importable"
        for _, name in pairs if self_check else ():
            ok, reason = _self_check(name, str(device))
            if not ok:
                return ok, reason
        return True, ""

    return usable


def _linear_fp8_check_inputs(device: torch.device):
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(5, 512, generator=g)
    x[1] = 0  # the amax floor
    w, s = quantize_fp8_block(torch.randn(384, 512, generator=g) * 512**-0.5)
    return x.bfloat16().to(device), w.to(device), s.to(device)


def _moe_fp8_check_inputs(device: torch.device, tokens: int | None = None):
    x, w13, w2, ids, weights, limit = _moe_check_inputs(torch.device("cpu"))
    if tokens is not None:  # more tokens than the check's: the same ones again, routed the same
        reps = -(-tokens // x.shape[0])
        x, ids, weights = (t.repeat(reps, *([1] * (t.dim() - 1)))[:tokens] for t in (x, ids, weights))
    q13, s13 = quantize_fp8_block(w13.float())
    q2, s2 = quantize_fp8_block(w2.float())
    args = (x, q13, s13, q2, s2, ids, weights, limit)
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


# --- DeepGEMM: the mHC mixing GEMM ---------------------------------------------------------------------

HC_BLOCK_M, HC_BLOCK_K = 64, 64  # the sm90 kernel's tiles
HC_MAX_MIXES = 32  # it takes N <= 32, a multiple of 8


def _hc_splits(m: int, k: int, sms: int = 132) -> int:
    """Split-K parts: about enough M-tile x split programs to fill the SMs, each split an equal share of at
    least 4 K-tiles."""
    tiles = k // HC_BLOCK_K
    target = max(1, min(tiles // 4, sms // -(-m // HC_BLOCK_M)))
    return max(d for d in range(1, target + 1) if tiles % d == 0)


def deep_gemm_hc_mixes_with(gemm: Callable, a: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
    """a [M, K] (bfloat16) . fn [N, K]^T in TF32 -> float32 [M, N], through a ``tf32_hc_prenorm_gemm``-like
    callable ``gemm(a, b, d, sqr_sum, num_splits=...)``; split along K (the parts summed) when M is small."""
    m, k = a.shape
    b = fn.float().contiguous()
    splits = _hc_splits(m, k)
    if splits == 1:
        d = torch.empty((m, b.shape[0]), dtype=torch.float32, device=a.device)
        gemm(a, b, d, torch.empty(m, dtype=torch.float32, device=a.device))
        return d
    d = torch.empty((splits, m, b.shape[0]), dtype=torch.float32, device=a.device)
    gemm(a, b, d, torch.empty((splits, m), dtype=torch.float32, device=a.device), num_splits=splits)
    return d.sum(0)


def deep_gemm_hc_pre(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps):
    """``hc_pre`` with its mixing GEMM through ``deep_gemm.tf32_hc_prenorm_gemm`` (TF32, as DeepSeek's
    kernels compute it), the RMS factor, Sinkhorn and collapse in the backend's Triton kernel."""
    from deepinfer_nvidia_sm100 import hc_ops

    tokens, n, d = streams.shape
    a = streams.reshape(tokens, n * d)
    mixes = deep_gemm_hc_mixes_with(_library("deep_gemm").tf32_hc_prenorm_gemm, a.contiguous(), fn) if tokens \
        else torch.empty((0, fn.shape[0]), dtype=torch.float32, device=streams.device)
    return hc_ops.hc_pre_from_mixes(streams, mixes, base, scale, sinkhorn_iters, hc_eps, norm_eps)


def _deep_gemm_hc_usable(device, dtype, model_config, self_check) -> tuple[bool, str]:
    if declined := _declined(device, dtype, model_config, self_check):
        return declined
    device = capability.as_device(device)
    if model_config is not None:
        hc, hidden = getattr(model_config, "hc_mult", None), getattr(model_config, "hidden_size", None)
        mixes = (2 + hc) * hc if hc else None
        if not mixes or mixes > HC_MAX_MIXES or mixes % 8 or not hidden or (hc * hidden) % HC_BLOCK_K:
            return False, (f"hc_mult {hc} x hidden {hidden}: tf32_hc_prenorm_gemm takes at most {HC_MAX_MIXES} "
                           f"mixes (a multiple of 8) over a multiple of {HC_BLOCK_K} columns")
    if not capability.library_feature("deep_gemm", "tf32_hc_prenorm_gemm"):
        return False, "deep_gemm with tf32_hc_prenorm_gemm is not importable"
    ok, reason = capability.triton_usable(device)
    if not ok:
        return False, f"its epilogue is the backend's Triton kernel: {reason}"
    if self_check:
        return _self_check("deep_gemm_hc", str(device))
    return True, ""


def _hc_check_inputs(device: torch.device):
    g = torch.Generator(device="cpu").manual_seed(0)
    streams = torch.randn(5, 4, 512, generator=g).bfloat16()
    fn = torch.randn(24, 4 * 512, generator=g) * 0.02
    base, scale = torch.randn(24, generator=g) * 0.1, torch.rand(3, generator=g) + 0.5
    return streams.to(device), fn.to(device), base.to(device), scale.to(device), 20, 1e-6, 1e-6


# --- self-check -------------------------------------------------------------------------------------

#: check name -> (op, adapter, inputs)
_CHECKS: dict[str, tuple[str, Callable, Callable]] = {
    "flash_mla": ("sparse_attention", flash_mla_sparse_attention, _attention_check_inputs),
    "flash_mla_fp8": ("sparse_attention_fp8", flash_mla_sparse_attention_fp8, _attention_fp8_check_inputs),
    "deep_gemm": ("moe_experts", deep_gemm_moe_experts, _moe_check_inputs),
    "deep_gemm_fp8": ("linear_fp8", deep_gemm_linear_fp8, _linear_fp8_check_inputs),
    "deep_gemm_moe_fp8": ("moe_experts_fp8", deep_gemm_moe_experts_fp8, _moe_fp8_check_inputs),  # masked
    "deep_gemm_moe_fp8_contiguous": ("moe_experts_fp8", _deep_gemm_moe_fp8_contiguous,
                                     functools.partial(_moe_fp8_check_inputs, tokens=MASKED_MAX_TOKENS + 7)),
    "deep_gemm_hc": ("hc_pre", deep_gemm_hc_pre, _hc_check_inputs),
}


def _flat(out) -> torch.Tensor:
    """An op's output (a tensor or a tuple of them) as one float64 vector on the CPU."""
    return torch.cat([t.double().flatten().cpu() for t in (out if isinstance(out, tuple) else (out,))])


@functools.cache
def _self_check(library: str, device: str) -> tuple[bool, str]:
    """Run the adapter and the core's native body (in float64) on the same inputs on ``device``; cached
    per device. ``library`` names the check (a library may serve several ops)."""
    op, adapter, inputs = _CHECKS[library]
    try:
        args = inputs(torch.device(device))
        got = adapter(*args)
        want = native.NATIVE_OPS[op](*[a.double() if isinstance(a, torch.Tensor) and a.is_floating_point()
                                       and a.dtype != FP8_DTYPE else a for a in args])
        got, want = _flat(got), _flat(want)
        if torch.isnan(got).any():
            raise AssertionError("NaN in the output")
        cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0).item()
        err = (got - want).abs().max().item()
        if cos < 0.999 or err > 0.1:
            raise AssertionError(f"mismatch against the reference: cosine {cos:.6f}, max abs err {err:.3g}")
    except Exception as exc:
        reason = f"{library} self-check failed on {device}: {type(exc).__name__}: {exc}"
        logger.warning("%s; %s is served by the next implementation", reason, op)  # once: the check is cached
        return False, reason
    return True, ""


#: the bfloat16 DeepGEMM MoE is opt-in: its contiguous layout pads every expert's rows to 128, and on an
#: H200 at V4-Flash widths (256 experts) it made the decode step 2.5x slower at batch 64 and 4096-token
#: prefill 1.4x slower than the Triton grouped MoE
DEEPGEMM_MOE_ENV = "DEEPINFER_NVIDIA_DEEPGEMM_MOE"
#: FlashMLA's bfloat16 sparse attention (its prefill kernel, one call per pool and a merge) is opt-in: on
#: an H200 at V4-Flash widths it took 4096-token prefill from 63,851 to 42,804 tok/s and cost 2.4-11x the
#: Triton kernel per decode call
FLASH_MLA_BF16_ENV = "DEEPINFER_NVIDIA_FLASH_MLA_BF16"
#: whether calls above MASKED_MAX_TOKENS tokens take DeepGEMM's contiguous FP8 MoE: 1 always, 0 never; unset,
#: those whose experts average CONTIGUOUS_MIN_ROWS rows
DEEPGEMM_CONTIGUOUS_MOE_ENV = "DEEPINFER_NVIDIA_DEEPGEMM_CONTIGUOUS_MOE"
#: DeepGEMM's mHC mixing GEMM is opt-in until it is measured against the float32 GEMM it replaces
DEEPGEMM_HC_ENV = "DEEPINFER_NVIDIA_DEEPGEMM_HC"


def _opt_in(env: str, usable: Callable[[Any, Any, Any, bool], tuple[bool, str]],
            why: str = "slower than the Triton kernel at the shapes measured"
            ) -> Callable[[Any, Any, Any, bool], tuple[bool, str]]:
    def opted_in(device, dtype, model_config, self_check) -> tuple[bool, str]:
        if os.environ.get(env, "") == "1":
            return usable(device, dtype, model_config, self_check)
        probed = usable(device, dtype, model_config, False)
        if not probed[0]:
            return probed
        return False, f"opt-in ({env}=1): {why}"

    return opted_in


def _deep_gemm_moe_fp8_usable(device, dtype, model_config, self_check) -> tuple[bool, str]:
    """The masked GEMM's check, and the Triton FP8 MoE's availability for the calls above MASKED_MAX_TOKENS
    tokens that the contiguous GEMM does not take; with the contiguous GEMM forced on
    (:data:`DEEPGEMM_CONTIGUOUS_MOE_ENV` = 1), its check instead. Otherwise the contiguous GEMM's check only
    decides whether it serves (a failure warns once)."""
    if _contiguous_fp8_moe():
        return _deep_gemm_usable("m_grouped_fp8_gemm_nt_masked", "deep_gemm_moe_fp8",
                                 ("m_grouped_fp8_gemm_nt_contiguous", "deep_gemm_moe_fp8_contiguous")
                                 )(device, dtype, model_config, self_check)
    ok, reason = _deep_gemm_usable("m_grouped_fp8_gemm_nt_masked", "deep_gemm_moe_fp8")(
        device, dtype, model_config, self_check)
    if ok:
        ok, why = capability.triton_usable(capability.as_device(device))
        reason = "" if ok else f"calls above {MASKED_MAX_TOKENS} tokens go to the Triton FP8 MoE: {why}"
    if ok and self_check and _contiguous_fp8_moe() is None:
        _contiguous_passes(capability.as_device(device))
    return ok, reason


ADAPTERS = [
    Adapter("sparse_attention", "flash_mla", flash_mla_sparse_attention,
            _opt_in(FLASH_MLA_BF16_ENV, _flash_mla_usable)),
    Adapter("sparse_attention_fp8", "flash_mla", flash_mla_sparse_attention_fp8, _flash_mla_fp8_usable),
    Adapter("moe_experts", "deep_gemm", deep_gemm_moe_experts,
            _opt_in(DEEPGEMM_MOE_ENV, _deep_gemm_usable("m_grouped_bf16_gemm_nt_contiguous", "deep_gemm"))),
    Adapter("linear_fp8", "deep_gemm", deep_gemm_linear_fp8, _deep_gemm_usable("fp8_gemm_nt", "deep_gemm_fp8")),
    Adapter("hc_pre", "deep_gemm", deep_gemm_hc_pre,
            _opt_in(DEEPGEMM_HC_ENV, _deep_gemm_hc_usable, "not measured against the float32 GEMM yet")),
    Adapter("moe_experts_fp8", "deep_gemm", deep_gemm_moe_experts_fp8, _deep_gemm_moe_fp8_usable),
]

"""Launchers of the Triton kernels, with the catalogue signatures.

The kernels module (and so ``triton``) is imported on the first call, never when this module is
imported. The launchers take float32, bfloat16 and float16 inputs (:data:`KERNEL_DTYPES`) and nothing
else: their registration's predicate declines other model dtypes at build time, so float64 golden runs
resolve to the core's native bodies instead. No launcher waits for the device (no host
synchronisation): every size comes from shapes, so the ops can be captured in CUDA graphs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from deepinfer_core.ops.native import select_topk as core_select_topk

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=1)
def _k():
    from deepinfer_nvidia_sm100 import triton_kernels
    from deepinfer_nvidia_sm100.capability import interpreting

    if interpreting():
        _patch_interpreter()
    return triton_kernels


def _patch_interpreter() -> None:
    """Two gaps of Triton 3.6's interpreter (``TRITON_INTERPRET=1``, the CPU tests) that compiled kernels
    do not have, closed so that the very same kernels run there:

    * a scalar kernel argument becomes an int through ``int(array)``, which numpy >= 2.4 refuses for a
      1-element 1-d array, so every ``range(0, n, BLOCK)`` over a runtime ``n`` fails
      (triton-lang/triton#9171, fixed upstream in #9172);
    * ``tl.dot`` multiplies the raw uint16 storage of bfloat16 operands; here they are widened to
      float32 first (exact), as the tensor cores do before accumulating in float32;
    * ``tl.dot`` of float32 operands is numpy's matmul, whose result for one row of the block depends
      on the row's position in it (as no tensor core's does); it runs through torch's matmul instead,
      which computes every row of a block alike (batch-invariant mode's kernels rely on that).
    """
    import numpy as np
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is not None and not getattr(original, "deepinfer_fix", False):

        def patch_tensor(tensor, scope):
            original(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

        patch_tensor.deepinfer_fix = True
        interpreter._patch_lang_tensor = patch_tensor

    builder = getattr(interpreter, "InterpreterBuilder", None)
    dot = getattr(builder, "create_dot", None)
    if dot is not None and not getattr(dot, "deepinfer_fix", False):
        import triton.language as tl

        def widen(handle):
            if handle.dtype.scalar == tl.bfloat16:
                bits = np.asarray(handle.data).astype(np.uint32) << 16
                return interpreter.TensorHandle(bits.view(np.float32), tl.float32)
            return handle

        def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
            a, b = widen(a), widen(b)
            if a.dtype.scalar == b.dtype.scalar == d.dtype.scalar == tl.float32:
                prod = torch.from_numpy(np.ascontiguousarray(a.data)) @ torch.from_numpy(np.ascontiguousarray(b.data))
                return interpreter.TensorHandle(prod.numpy() + d.data, d.dtype.scalar)
            return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

        create_dot.deepinfer_fix = True
        builder.create_dot = create_dot


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A view whose last dimension is contiguous (copying only when it is not)."""
    return t if t.stride(-1) == 1 else t.contiguous()


# --- norm and rope --------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    if x.numel() == 0:
        return torch.empty_like(x)
    d = x.shape[-1]
    x2 = _rows(x.reshape(-1, d))
    out = torch.empty((x2.shape[0], d), dtype=x.dtype, device=x.device)
    w = weight.contiguous() if weight is not None else x2
    block = min(_pow2(d), 4096)
    _k().rms_norm_kernel[(x2.shape[0],)](
        x2, x2.stride(0), w, out, out.stride(0), d, float(eps),
        HAS_WEIGHT=weight is not None, BLOCK_D=block, num_warps=4 if block <= 1024 else 8,
    )
    return out.view(x.shape)


def rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    if x.numel() == 0:
        return torch.empty_like(x)
    tokens, heads, d = x.shape
    x = _rows(x)
    cos, sin = _rows(cos), _rows(sin)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    block_h = min(_pow2(heads), 16)
    block_d = min(_pow2(d), 128)
    _k().rotary_kernel[(tokens, _cdiv(heads, block_h))](
        x, x.stride(0), x.stride(1), cos, sin, cos.stride(0), sin.stride(0),
        out, out.stride(0), out.stride(1), heads, d, 2 * cos.shape[-1], -1.0 if inverse else 1.0,
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4,
    )
    return out


# --- attention -------------------------------------------------------------------------------------


def sparse_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    extra_kv: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    *,
    keep_extra: bool = False,
    splits: int | None = None,
) -> torch.Tensor:
    """``keep_extra``: take the extra pool's branch whenever one is given, even with no index column
    (batch-invariant mode: the kernel a query runs then does not depend on its batch's widest list).
    ``splits``: how many programs share each query's index lists (None: enough to fill the GPU when the
    batch has few queries, see :func:`attention_splits`; 1 in batch-invariant mode)."""
    has_extra = extra_kv is not None and extra_indices is not None and (keep_extra or extra_indices.shape[-1] > 0)
    tokens, heads, d = q.shape
    out = torch.empty((tokens, heads, d), dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    q, kv, indices, sinks = _rows(q), _rows(kv), _rows(indices), sinks.contiguous()
    if has_extra:
        ekv, eidx = _rows(extra_kv), _rows(extra_indices)
    else:  # never read: HAS_EXTRA is off
        ekv, eidx = kv, indices
    # all 64 heads and the whole 512-wide value in one program read each gathered row once
    # (backends/nvidia_sm100/benchmarks/bench_attention.py: 3.3x faster than 32 heads x 256 at V4-Flash decode shapes)
    block_h = 16 if heads <= 16 else 32 if heads <= 32 else 64
    block_dv = min(_pow2(d), 512 if block_h == 64 else 256)
    block_dk = min(_pow2(d), 128)
    block_k = 32
    programs = _cdiv(heads, block_h) * _cdiv(d, block_dv)
    columns = indices.shape[-1] + (eidx.shape[-1] if has_extra else 0)
    if splits is None:
        splits = attention_splits(tokens * programs, columns, block_k)
    if splits > 1:
        return _split_attention(q, kv, indices, sinks, scale, ekv, eidx, has_extra, out, splits, columns,
                                block_h, block_k, block_dk, block_dv)
    grid = (tokens, _cdiv(heads, block_h), _cdiv(d, block_dv))
    _k().sparse_attention_kernel[grid](
        q, q.stride(0), q.stride(1),
        kv, kv.stride(0), kv.shape[0],
        indices, indices.stride(0), indices.shape[-1],
        ekv, ekv.stride(0), ekv.shape[0],
        eidx, eidx.stride(0), eidx.shape[-1] if has_extra else 0,
        sinks, out, out.stride(0), out.stride(1),
        heads, d, float(scale),
        HAS_EXTRA=has_extra, BLOCK_H=block_h, BLOCK_K=block_k, BLOCK_DK=block_dk, BLOCK_DV=block_dv,
        DOT_PREC=_prec(q.dtype), num_warps=4 if block_dv <= 128 else 8,
    )
    return out


#: programs a split attention aims to launch (about one per SM of an H100/H200, 132)
SPLIT_TARGET_PROGRAMS = 128
#: index columns one split covers at least
SPLIT_MIN_COLUMNS = 64


def attention_splits(programs: int, columns: int, block_k: int) -> int:
    """Splits of each query's index columns for a launch of ``programs`` programs without splitting: a
    decode batch of a few queries runs one program per query on one SM each, which reads the query's
    whole list alone (at batch 1, one SM of the GPU). Split, every program covers at least
    ``SPLIT_MIN_COLUMNS`` columns (whole ``block_k`` steps) and the launch about ``SPLIT_TARGET_PROGRAMS``."""
    if programs <= 0 or programs * 2 > SPLIT_TARGET_PROGRAMS:
        return 1
    chunk = max(SPLIT_MIN_COLUMNS, block_k)
    return max(1, min(SPLIT_TARGET_PROGRAMS // programs, _cdiv(columns, chunk)))


def _split_attention(q, kv, indices, sinks, scale, ekv, eidx, has_extra, out, splits, columns,
                     block_h, block_k, block_dk, block_dv):
    """:func:`sparse_attention` over ``splits`` column ranges per query, merged with the sinks after."""
    tokens, heads, d = q.shape
    chunk = _cdiv(_cdiv(columns, splits), block_k) * block_k
    splits = _cdiv(columns, chunk)
    m = torch.empty((tokens, splits, heads), dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    part = torch.empty((tokens, splits, heads, d), dtype=torch.float32, device=q.device)
    grid = (tokens, _cdiv(heads, block_h) * _cdiv(d, block_dv), splits)
    _k().sparse_attention_split_kernel[grid](
        q, q.stride(0), q.stride(1),
        kv, kv.stride(0), kv.shape[0],
        indices, indices.stride(0), indices.shape[-1],
        ekv, ekv.stride(0), ekv.shape[0],
        eidx, eidx.stride(0), eidx.shape[-1] if has_extra else 0,
        m, l, part,
        heads, d, float(scale), chunk, splits,
        HAS_EXTRA=has_extra, BLOCK_H=block_h, BLOCK_K=block_k, BLOCK_DK=block_dk, BLOCK_DV=block_dv,
        DOT_PREC=_prec(q.dtype), num_warps=4 if block_dv <= 128 else 8,
    )
    return _combine(m, l, part, sinks, out, block_h)


def _combine(m, l, part, sinks, out, block_h):
    """Merge the split softmax states ``m``, ``l`` [T, S, H] and values ``part`` [T, S, H, D] with the
    sinks into ``out``."""
    tokens, splits, heads, d = part.shape
    combine_h = min(block_h, 16)
    combine_v = min(_pow2(d), 128)
    _k().sparse_attention_combine_kernel[(tokens, _cdiv(heads, combine_h), _cdiv(d, combine_v))](
        m, l, part, sinks, out, out.stride(0), out.stride(1), heads, d, splits,
        BLOCK_H=combine_h, BLOCK_DV=combine_v, num_warps=4,
    )
    return out


def compress_windows(kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    windows, length, d = kv.shape
    if kv.numel() == 0:
        return kv.new_empty((windows, d))
    kv, gate = _rows(kv), _rows(gate)
    out = torch.empty((windows, d), dtype=kv.dtype, device=kv.device)
    block_d = min(_pow2(d), 128)
    block_l = min(_pow2(length), 32)
    _k().compress_windows_kernel[(windows, _cdiv(d, block_d))](
        kv, kv.stride(0), kv.stride(1), gate, gate.stride(0), gate.stride(1), out, out.stride(0),
        length, d, BLOCK_L=block_l, BLOCK_D=block_d, num_warps=4,
    )
    return out


def indexer_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    candidates: torch.Tensor,
    scale: float,
    *,
    block_c: int | None = None,
) -> torch.Tensor:
    """The indexer's scores in Triton, float32, -inf where a candidate is -1 (or past the pool).
    ``block_c``: candidates per program (default: by the candidate count)."""
    tokens, heads, d = q.shape
    n_cand = candidates.shape[-1]
    q, weights, keys, candidates = _rows(q), _rows(weights), _rows(keys), _rows(candidates)
    scores = torch.empty((tokens, n_cand), dtype=torch.float32, device=q.device)
    if tokens and n_cand:
        block_c = block_c or (64 if n_cand > 32 else 32)
        block_h = min(max(_pow2(heads), 16), 64)
        block_d = min(max(_pow2(d), 16), 128)
        _k().indexer_scores_kernel[(tokens, _cdiv(n_cand, block_c))](
            q, q.stride(0), q.stride(1), weights, weights.stride(0), keys, keys.stride(0), keys.shape[0],
            candidates, candidates.stride(0), n_cand, scores, scores.stride(0), heads, d, float(scale),
            BLOCK_H=block_h, BLOCK_C=block_c, BLOCK_D=block_d, DOT_PREC=_prec(q.dtype), num_warps=4,
        )
    return scores


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    candidates: torch.Tensor,
    topk: int,
    scale: float,
    *,
    block_c: int | None = None,
) -> torch.Tensor:
    """Scores in Triton (:func:`indexer_scores`); the selection is a stable sort (ties towards the earlier
    candidate). ``block_c``: candidates per program (default: by the candidate count)."""
    scores = indexer_scores(q, weights, keys, candidates, scale, block_c=block_c)
    return select_topk(scores, _rows(candidates), keys.shape[0], topk)


#: rows up to this wide are selected by one sort in registers (``select_topk_kernel``); wider ones by the
#: core's partial selection
SELECT_MAX_WIDTH = 2048


def select_topk(scores: torch.Tensor, candidates: torch.Tensor, key_rows: int, topk: int) -> torch.Tensor:
    """The core's ``select_topk`` (stable descending order, invalid or missing picks -1) where a candidate
    is valid in ``[0, key_rows)``; a row of up to SELECT_MAX_WIDTH candidates is one kernel, where torch's
    sort and the picks' gathers were some six (21 us for 1024 candidates at batch 1 on the H200)."""
    tokens, width = scores.shape
    if not tokens or not width or width > SELECT_MAX_WIDTH:
        return core_select_topk(scores, (candidates >= 0) & (candidates < key_rows), candidates, topk)
    out = torch.empty((tokens, topk), dtype=candidates.dtype, device=scores.device)
    block = max(_pow2(width), 16)
    _k().select_topk_kernel[(tokens,)](
        scores, scores.stride(0), candidates, candidates.stride(0), key_rows, width,
        out, out.stride(0), min(topk, width), topk, BLOCK=block, num_warps=4 if block <= 512 else 8,
    )
    return out


# --- MoE -------------------------------------------------------------------------------------------


def expert_layout(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Sort the (token, slot) pairs by expert and pad every expert's run to a multiple of ``block_m``.

    Returns ``(sorted_pairs [rows], block_expert [rows // block_m])``: ``sorted_pairs[r]`` is the flat
    pair index ``token * k + slot`` placed at row ``r`` (``num_pairs`` = padding) and ``block_expert[b]``
    the expert of rows ``b*block_m ...`` (-1: a block with no rows). Slots with an id outside
    ``[0, num_experts)`` (-1 = an expert of another rank) get no row. Sizes come from shapes alone
    (an upper bound on the padding), so nothing waits for the device.
    """
    device = topk_ids.device
    flat = topk_ids.reshape(-1)
    pairs = flat.numel()
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, torch.full_like(flat, num_experts))
    # scatter_add rather than bincount, which reads the maximum back to the host on CUDA
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts = counts.scatter_add_(0, key, torch.ones_like(key))[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    cnt_start = torch.cumsum(counts, 0) - counts
    order = torch.sort(key, stable=True).indices
    sorted_key = key[order]
    expert = sorted_key.clamp(max=num_experts - 1)
    within = torch.arange(pairs, device=device) - cnt_start[expert]
    rows = _cdiv(pairs + min(num_experts, pairs) * (block_m - 1), block_m) * block_m
    dest = torch.where(sorted_key < num_experts, pad_start[expert] + within, torch.full_like(within, rows))
    sorted_pairs = torch.full((rows + 1,), pairs, dtype=torch.long, device=device)
    sorted_pairs.scatter_(0, dest, order)
    block_start = torch.arange(0, rows, block_m, device=device)
    block_expert = torch.searchsorted(pad_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, torch.full_like(block_expert, -1))
    return sorted_pairs[:rows], block_expert.to(torch.int32)


@dataclass
class MoeLayout:
    """A grouped MoE call's shapes and its rows sorted by expert (:func:`expert_layout`)."""

    tokens: int
    d: int
    inter: int
    k: int
    pairs: int  # tokens * k
    block_m: int
    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor
    weights: torch.Tensor  # [pairs] routing weights, flat

    @property
    def rows(self) -> int:
        return self.sorted_pairs.shape[0]

    def combine(self, out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[pairs, d] float32 contributions -> [tokens, d]: a token's k summed in slot order."""
        return out.view(self.tokens, self.k, self.d).sum(dim=1).to(dtype)


def moe_layout(x: torch.Tensor, w13: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
               block_m: int | None = None) -> MoeLayout:
    """The layout of one call: ``block_m`` rows per block (default 16 for at most 64 pairs, else 64)."""
    tokens, d = x.shape
    num_experts, two_i = w13.shape[0], w13.shape[1]
    k = topk_ids.shape[-1]
    pairs = tokens * k
    block_m = block_m or (16 if pairs <= 64 else 64)
    sorted_pairs, block_expert = expert_layout(topk_ids, num_experts, block_m)
    return MoeLayout(tokens, d, two_i // 2, k, pairs, block_m, sorted_pairs, block_expert,
                     topk_weights.reshape(-1).contiguous())


def moe_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    swiglu_limit: float,
) -> torch.Tensor:
    """Fused grouped MoE: gate/up GEMM + SwiGLU, then down GEMM scaled by the routing weight, per block
    of rows of one expert; the k contributions of a token are summed in float32 in slot order."""
    if x.shape[0] == 0:
        return torch.zeros_like(x)
    lay = moe_layout(x, w13, topk_ids, topk_weights)
    return lay.combine(moe_slots(x, w13, w2, lay, swiglu_limit), x.dtype)


def moe_slots(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, lay: MoeLayout,
              swiglu_limit: float) -> torch.Tensor:
    """The [pairs, d] float32 contributions of :func:`moe_experts` before a token's k are summed."""
    x, w13, w2 = _rows(x), _rows(w13), _rows(w2)
    h = torch.empty((lay.rows, lay.inter), dtype=x.dtype, device=x.device)
    out = torch.zeros((lay.pairs, lay.d), dtype=torch.float32, device=x.device)
    block_k = 32 if x.dtype == torch.float32 else 64
    kern, prec = _k(), _prec(x.dtype)
    kern.moe_gate_up_kernel[(lay.rows // lay.block_m, _cdiv(lay.inter, 64))](
        x, x.stride(0), w13, w13.stride(0), w13.stride(1), lay.sorted_pairs, lay.block_expert, h, h.stride(0),
        lay.pairs, lay.k, lay.d, lay.inter, float(swiglu_limit),
        BLOCK_M=lay.block_m, BLOCK_N=64, BLOCK_K=block_k, DOT_PREC=prec, num_warps=4,
    )
    kern.moe_down_kernel[(lay.rows // lay.block_m, _cdiv(lay.d, 64))](
        h, h.stride(0), w2, w2.stride(0), w2.stride(1), lay.sorted_pairs, lay.block_expert, lay.weights,
        out, out.stride(0), lay.pairs, lay.d, lay.inter,
        BLOCK_M=lay.block_m, BLOCK_N=64, BLOCK_K=block_k, DOT_PREC=prec, num_warps=4,
    )
    return out


# --- FP4 routed experts ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _k_fp4():
    from deepinfer_nvidia_sm100 import fp4_moe_kernels

    _k()  # imports Triton the same way, with the interpreter's gaps closed
    return fp4_moe_kernels


#: ``ROUND`` of the FP4 kernels: the model dtype the DeepSeek numerics round intermediates to
_ROUND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _fp4_scales(scale: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(scales the kernel reads, whether they are ue8m0 bytes): ``float8_e8m0fnu`` as its bytes, any
    other dtype as float32."""
    if scale.dtype == torch.float8_e8m0fnu:
        return _rows(scale.view(torch.uint8)), True
    return _rows(scale.float()), False


def quantize_act_ue8m0(x2: torch.Tensor, block: int = 128, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Rows [M, K] (stride 1 along K) -> DeepSeek's act_quant with ue8m0 scales per ``block`` channels,
    simulated (E4M3, power-of-two scales, dequantised), in ``dtype`` (bfloat16 or wider, where those values
    are exact): bit for bit :func:`deepinfer_core.quant.fp4.fake_quant_act_ue8m0`."""
    m, k = x2.shape
    q = torch.empty((m, k), dtype=dtype, device=x2.device)
    if m:
        _k_fp4().act_quant_ue8m0_kernel[(_cdiv(m, 16), _cdiv(k, block))](
            x2, x2.stride(0), q, q.stride(0), m, k, BLOCK_M=16, ACT_BLOCK=block, num_warps=4,
        )
    return q


@dataclass(frozen=True)
class Fp4Tiles:
    """Launch shapes of the FP4 grouped MoE (W4A16; with quantised activations the gate/up kernel's columns
    are one activation group): inputs per K step, then columns, warps and pipeline stages of the gate/up
    kernel and of the down kernel. ``benchmarks/tune_moe_fp4.py`` times the alternatives."""

    block_k: int = 64
    up_n: int = 64
    up_warps: int = 4
    up_stages: int = 3
    down_n: int = 64
    down_warps: int = 4
    down_stages: int = 3

    def __post_init__(self):
        if self.block_k not in (32, 64, 128, 256):  # whole 32-input scale groups per step
            raise ValueError(f"Fp4Tiles.block_k must be 32, 64, 128 or 256, not {self.block_k}")


def _grouped_moe(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, swiglu_limit: float,
                 quant_act: bool, act_block: int, packed: bool) -> torch.Tensor:
    """The grouped MoE of :mod:`.fp4_moe_kernels` (``packed``: FP4 experts with their scales; else experts
    in a float dtype, the scales unused)."""
    if x.shape[0] == 0:
        return torch.zeros_like(x)
    out, lay = grouped_moe_slots(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, swiglu_limit,
                                 quant_act, act_block, packed)
    return lay.combine(out, x.dtype)


def grouped_moe_slots(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, swiglu_limit: float,
                      quant_act: bool, act_block: int, packed: bool, block_m: int | None = None,
                      tiles: Fp4Tiles | None = None) -> tuple[torch.Tensor, MoeLayout]:
    """:func:`_grouped_moe`'s [pairs, d] float32 contributions before a token's k are summed, and the layout
    (``block_m``: rows per block, default by the number of pairs; ``tiles``: the launch shapes, default
    :class:`Fp4Tiles`'s, 32 inputs a step for float32 activations)."""
    lay = moe_layout(x, w13, topk_ids, topk_weights, block_m)
    block_m, rows, inter, d = lay.block_m, lay.rows, lay.inter, lay.d
    x = _rows(x)
    if packed:
        w13, w2 = _rows(w13.view(torch.uint8)), _rows(w2.view(torch.uint8))
        (s13, e8m0_13), (s2, e8m0_2) = _fp4_scales(w13_scale), _fp4_scales(w2_scale)
    else:  # the scale pointers are never read
        w13, w2 = _rows(w13), _rows(w2)
        (s13, e8m0_13), (s2, e8m0_2) = (w13, False), (w2, False)
    kern, rnd, quant_act = _k_fp4(), _ROUND[x.dtype], bool(quant_act)
    if tiles is None:
        tiles = Fp4Tiles(block_k=32) if x.dtype == torch.float32 and not quant_act else Fp4Tiles()
    if quant_act:
        # one activation group per program's channels: a power of two the dots can tile
        if act_block not in (16, 32, 64, 128):
            raise ValueError(f"the Triton grouped MoE quantises activations per 16, 32, 64 or 128 channels, "
                             f"not {act_block}")
        # FP4 weights times power-of-two scales are exact in bfloat16, as are the quantised activations;
        # float weights multiply in the model dtype
        a = quantize_act_ue8m0(x, act_block, torch.bfloat16 if packed else x.dtype)
        up_n, up_warps = act_block, max(tiles.up_warps, 8 if act_block == 128 else 4)  # one group of h a program
    else:
        a, up_n, up_warps = x, tiles.up_n, tiles.up_warps
    prec = _prec(a.dtype)
    h = torch.empty((rows, inter), dtype=a.dtype, device=x.device)
    out = torch.zeros((lay.pairs, d), dtype=torch.float32, device=x.device)
    kern.moe_fp4_gate_up_kernel[(rows // block_m, _cdiv(inter, up_n))](
        a, a.stride(0), w13, w13.stride(0), w13.stride(1), s13, s13.stride(0), s13.stride(1),
        lay.sorted_pairs, lay.block_expert, lay.weights, h, h.stride(0), lay.pairs, lay.k, d, inter,
        float(swiglu_limit),
        SCALE_E8M0=e8m0_13, QUANT_ACT=quant_act, ROUND=rnd, PACKED=packed,
        BLOCK_M=block_m, BLOCK_N=up_n, BLOCK_K=tiles.block_k, DOT_PREC=prec, num_warps=up_warps,
        num_stages=tiles.up_stages,
    )
    kern.moe_fp4_down_kernel[(rows // block_m, _cdiv(d, tiles.down_n))](
        h, h.stride(0), w2, w2.stride(0), w2.stride(1), s2, s2.stride(0), s2.stride(1),
        lay.sorted_pairs, lay.block_expert, lay.weights, out, out.stride(0), lay.pairs, d, inter,
        SCALE_E8M0=e8m0_2, QUANT_ACT=quant_act, ROUND=rnd, PACKED=packed,
        BLOCK_M=block_m, BLOCK_N=tiles.down_n, BLOCK_K=tiles.block_k, DOT_PREC=prec, num_warps=tiles.down_warps,
        num_stages=tiles.down_stages,
    )
    return out, lay


def moe_experts_fp4(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    swiglu_limit: float,
    quant_act: bool,
) -> torch.Tensor:
    """Grouped MoE reading the experts in FP4 (:mod:`.fp4_moe_kernels`): the rows sorted by expert as
    :func:`moe_experts` sorts them, gate/up GEMM + SwiGLU, then the down GEMM, each dequantising its
    packed weights in registers; a token's k contributions summed in float32 in slot order. W4A16
    (``quant_act=False``): x.dtype operands; DeepSeek's numerics (``quant_act=True``): the tokens and the
    SwiGLU output quantised to E4M3 per 128 with power-of-two scales, multiplied in bfloat16 (exact)."""
    return _grouped_moe(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, swiglu_limit, quant_act, 128,
                        packed=True)


def moe_experts_fp4_quant_act(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    swiglu_limit: float,
    block: int,
) -> torch.Tensor:
    """:func:`moe_experts_fp4` with DeepSeek's numerics, the activations quantised per ``block`` channels
    (DeepSeek-V4.1: 32)."""
    return _grouped_moe(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, swiglu_limit, True,
                        block, packed=True)


def moe_experts_quant_act(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    swiglu_limit: float,
    block: int,
) -> torch.Tensor:
    """DeepSeek's numerics over experts held in a float dtype (the activations quantised per ``block``
    channels), through the FP4 MoE's kernels with the weights read as they are."""
    return _grouped_moe(x, w13, None, w2, None, topk_ids, topk_weights, swiglu_limit, True, block,
                        packed=False)


def moe_experts_act_quant(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    swiglu_limit: float,
) -> torch.Tensor:
    """:func:`moe_experts_quant_act` per 128 channels (DeepSeek-V4's experts held in a float dtype)."""
    return moe_experts_quant_act(x, w13, w2, topk_ids, topk_weights, swiglu_limit, 128)


ALL_OPS = {
    "rms_norm": rms_norm,
    "rotary_emb": rotary_emb,
    "sparse_attention": sparse_attention,
    "compress_windows": compress_windows,
    "indexer_topk": indexer_topk,
    "indexer_scores": indexer_scores,
    "moe_experts": moe_experts,
}
#: served by default; ``DEEPINFER_NVIDIA_FP4_TRITON=0`` leaves the op to the native body (:mod:`.registration`)
FP4_OPS = {"moe_experts_fp4": moe_experts_fp4, "moe_experts_fp4_quant_act": moe_experts_fp4_quant_act}
#: DeepSeek's numerics on experts held in a float dtype: no host round trip, so decode captures in graphs
QUANT_ACT_OPS = {"moe_experts_quant_act": moe_experts_quant_act, "moe_experts_act_quant": moe_experts_act_quant}


# --- sparse attention over DeepSeek's FP8 KV entries -------------------------------------------------


@functools.lru_cache(maxsize=1)
def _k_fp8_kv():
    from deepinfer_nvidia_sm100 import fp8_kv_kernels

    _k()  # imports Triton the same way, with the interpreter's gaps closed
    return fp8_kv_kernels


def _fp8_entries(pool: torch.Tensor, entry_bytes: int, name: str) -> torch.Tensor:
    if pool.dim() != 2 or pool.element_size() != 1 or pool.shape[-1] != entry_bytes:
        raise ValueError(f"sparse_attention_fp8: {name} must be uint8 entries [rows, {entry_bytes}], "
                         f"got {pool.dtype} {tuple(pool.shape)}")
    return _rows(pool.view(torch.uint8))


def sparse_attention_fp8(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    rope_dim: int,
    rope_dtype: torch.dtype,
    extra_kv: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    *,
    splits: int | None = None,
) -> torch.Tensor:
    """:func:`sparse_attention` reading the FP8 entries as they are stored (:mod:`.fp8_kv_kernels`: the
    gathered uint8 rows decoded in registers), with its tiles and its column splits for a small batch.
    RoPE values in a dtype the kernels do not take (float64) go to the core's native body. No host
    read-back: every size comes from shapes."""
    from deepinfer_core.ops import native
    from deepinfer_core.quant.kv_fp8 import kv_fp8_entry_bytes

    if rope_dtype not in _ROUND:
        return native.sparse_attention_fp8(q, kv, indices, sinks, scale, rope_dim, rope_dtype, extra_kv, extra_indices)
    tokens, heads, d = q.shape
    entry = kv_fp8_entry_bytes(d, rope_dim, rope_dtype)
    kv = _fp8_entries(kv, entry, "kv")
    has_extra = extra_kv is not None and extra_indices is not None and extra_indices.shape[-1] > 0
    out = torch.empty((tokens, heads, d), dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    q, indices, sinks = _rows(q), _rows(indices), sinks.contiguous()
    if has_extra:
        ekv, eidx = _fp8_entries(extra_kv, entry, "extra_kv"), _rows(extra_indices)
    else:  # never read: HAS_EXTRA is off
        ekv, eidx = kv, indices
    nope = d - rope_dim
    # whole 8-byte words per entry: the codes load 8 at a time, the RoPE values through a typed pointer
    aligned = nope % rope_dtype.itemsize == 0 and all(
        p.stride(0) % 8 == 0 and p.data_ptr() % 8 == 0 for p in (kv, ekv))
    block_h = 16 if heads <= 16 else 32 if heads <= 32 else 64
    block_dv = min(_pow2(d), 512 if block_h == 64 else 256)
    # float32 at 64 x 512 with 32 keys a step: ptxas (sm_90a) spills 8.7 kB a thread; with 16, 0.7 kB
    block_k = 16 if q.dtype == torch.float32 and block_h * block_dv > 64 * 256 else 32
    columns = indices.shape[-1] + (eidx.shape[-1] if has_extra else 0)
    if splits is None:
        splits = attention_splits(tokens * _cdiv(heads, block_h) * _cdiv(d, block_dv), columns, block_k)
    if splits > 1:
        chunk = _cdiv(_cdiv(columns, splits), block_k) * block_k
        splits = _cdiv(columns, chunk)
        m = torch.empty((tokens, splits, heads), dtype=torch.float32, device=q.device)
        l = torch.empty_like(m)
        part = torch.empty((tokens, splits, heads, d), dtype=torch.float32, device=q.device)
        _k_fp8_kv().sparse_attention_fp8_split_kernel[(tokens, _cdiv(heads, block_h) * _cdiv(d, block_dv), splits)](
            q, q.stride(0), q.stride(1),
            kv, kv.stride(0), kv.shape[0],
            indices, indices.stride(0), indices.shape[-1],
            ekv, ekv.stride(0), ekv.shape[0],
            eidx, eidx.stride(0), eidx.shape[-1] if has_extra else 0,
            m, l, part, heads, float(scale), chunk, splits,
            D=d, NOPE=nope, SCALE_AT=nope + rope_dim * rope_dtype.itemsize, ROPE_FMT=_ROUND[rope_dtype],
            ALIGNED=aligned, HAS_EXTRA=has_extra,
            BLOCK_H=block_h, BLOCK_K=block_k, BLOCK_R=max(16, _pow2(rope_dim)), BLOCK_DV=block_dv,
            DOT_PREC=_prec(q.dtype), num_warps=4 if block_dv <= 128 else 8,
        )
        return _combine(m, l, part, sinks, out, block_h)
    grid = (tokens, _cdiv(heads, block_h), _cdiv(d, block_dv))
    _k_fp8_kv().sparse_attention_fp8_kernel[grid](
        q, q.stride(0), q.stride(1),
        kv, kv.stride(0), kv.shape[0],
        indices, indices.stride(0), indices.shape[-1],
        ekv, ekv.stride(0), ekv.shape[0],
        eidx, eidx.stride(0), eidx.shape[-1] if has_extra else 0,
        sinks, out, out.stride(0), out.stride(1),
        heads, float(scale),
        D=d, NOPE=nope, SCALE_AT=nope + rope_dim * rope_dtype.itemsize, ROPE_FMT=_ROUND[rope_dtype],
        ALIGNED=aligned, HAS_EXTRA=has_extra,
        BLOCK_H=block_h, BLOCK_K=block_k, BLOCK_R=max(16, _pow2(rope_dim)), BLOCK_DV=block_dv,
        DOT_PREC=_prec(q.dtype), num_warps=4 if block_dv <= 128 else 8,
    )
    return out


#: served by default; ``DEEPINFER_NVIDIA_FP8_KV_TRITON=0`` leaves the op to the native body (:mod:`.registration`)
FP8_KV_OPS = {"sparse_attention_fp8": sparse_attention_fp8}

"""Batch-invariant variants of the reference ops whose result for one row depends on the batch.

Registered with ``batch_invariant=True`` and chosen only when the engine runs in batch-invariant mode
(``LLM(..., batch_invariant=True)`` or ``DEEPINFER_BATCH_INVARIANT=1``). Each one keeps the
reference's semantics and changes only how the work is cut, so that every row goes through kernel
calls whose shapes depend on that row alone:

* GEMMs (``linear``, ``grouped_linear``, the projections of ``moe_experts``, their FP8 variants, the
  ``fn`` products of ``hc_pre`` / ``hc_mixes`` / ``hc_head``): torch's CPU ``F.linear`` (MKL) computes a
  row with one of three kernels picked by the number of rows M (M = 1: GEMV; M = 2..3; M >= 4), so a
  token's projection changes in the last bits with the size of its batch. Here rows are computed in
  tiles of exactly :data:`TILE` rows (the last one zero-padded) in freshly allocated, aligned buffers:
  every call has the same shape, and within a tile a row's result does not depend on its position or
  its neighbours (measured: float32 and float64, 1 and 2 threads, K up to 4096).
* ``sparse_attention``: the extra (compressed) index list is padded to the batch's longest, and both
  the softmax (whose sink column sits after the last index) and the probability-weighted sum reduce
  over that padded width, so the padding changes the summation order. Here each query's width is
  its own last used slot rounded up to :data:`WIDTH_BUCKET`; queries of one width are computed
  together, in tiles of :data:`ATTENTION_TILE` queries.
* ``indexer_scores``: its candidates are padded to the batch's widest list, and torch's CPU GEMM picks
  its kernel by that width, as its sum over the heads picks its order. Here each candidate's dot products
  come from a GEMM of exactly :data:`SCORE_TILE` candidates and the heads are added one after another.
* Elementwise ``sigmoid`` / ``silu`` / ``softplus`` (``swiglu``, ``moe_route``, ``hc_pre``, ``hc_mixes``,
  ``hc_head``): torch's kernels compute the bulk of a contiguous run with SIMD code and its remainder
  with scalar code, and the two disagree in the last bit for 1-10 % of inputs (measured, float32:
  sigmoid 52, silu 59, softplus 456 of 4096); which of a token's values fall in the remainder depends
  on the batch. Here they are composed from ``exp`` and ``log1p`` of contiguous tensors (torch runs
  these through one vectorised routine for every element, remainder included: 0 of 4096 differ) and
  correctly rounded ``+ - * /``.

The other ops are batch-invariant in the reference already (per-row reductions of fixed length, or
exactly rounded arithmetic) and the catalogue marks them so; ``tests/engine/test_batch_invariance.py`` checks
both claims.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from deepinfer_core.ops import native as ref

#: rows per GEMM call: a multiple of 16 keeps each tile of a fresh buffer 64-byte aligned
TILE = 16
#: queries per ``sparse_attention`` call
ATTENTION_TILE = 32
#: the extra-index width of a query in ``sparse_attention`` is rounded up to a multiple of this
WIDTH_BUCKET = 32
#: candidates per GEMM of ``indexer_scores``
SCORE_TILE = 64


def _tiled(fn: Callable, *args: tuple[torch.Tensor, float | int], tile: int | None = None
           ) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """``fn`` over ``args`` (tensors sharing their leading dim, each with the value that pads it),
    called on tiles of exactly ``tile`` (default TILE) rows; the results are concatenated and the
    padding dropped."""
    tile = tile or TILE
    rows = args[0][0].shape[0]
    if rows == 0:
        return fn(*(t for t, _ in args))
    padded_rows = -(-rows // tile) * tile
    bufs = []
    for t, pad in args:
        buf = t.new_full((padded_rows, *t.shape[1:]), pad)
        buf[:rows] = t
        bufs.append(buf)
    outs = [fn(*(b[i:i + tile] for b in bufs)) for i in range(0, padded_rows, tile)]
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(parts)[:rows] for parts in zip(*outs))
    return torch.cat(outs)[:rows]


def _exp(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x.contiguous())


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    return torch.reciprocal(_exp(-x) + 1)


def _silu(x: torch.Tensor) -> torch.Tensor:
    return x / (_exp(-x) + 1)


def _softplus(x: torch.Tensor) -> torch.Tensor:
    """torch's softplus (beta 1, threshold 20)."""
    return torch.where(x > 20, x, torch.log1p(_exp(x)))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    out = _tiled(lambda t: F.linear(t, weight, bias), (flat, 0))
    return out.reshape(*x.shape[:-1], weight.shape[0])


def grouped_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return _tiled(lambda t: ref.grouped_linear(t, weight), (x, 0))


def swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return _silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


# The native (reference) bodies with the tiled GEMM and the invariant elementwise functions plugged in; the
# rest of their work is per row already. moe_experts keeps the reference's loop (ascending expert id).
hc_pre = partial(ref.hc_pre, mm=linear, sigmoid=_sigmoid)
hc_head = partial(ref.hc_head, mm=linear, sigmoid=_sigmoid)
moe_route = partial(ref.moe_route, scoring={
    "sqrtsoftplus": lambda x: _softplus(x).sqrt(),
    "sigmoid": _sigmoid,
    "softmax": lambda x: torch.softmax(x, dim=-1),
})
moe_experts = partial(ref.moe_experts, linear=linear, swiglu=swiglu)
# FP8: activations are quantised per row already; only the GEMMs and the SwiGLU need the invariant versions
linear_fp8 = partial(ref.linear_fp8, linear=linear)
moe_experts_fp8 = partial(ref.moe_experts_fp8, linear=linear, swiglu=swiglu)


def _used_width(indices: torch.Tensor) -> torch.Tensor:
    """Per row: one past the last slot that is not -1 (0 for an all -1 row)."""
    cols = torch.arange(1, indices.shape[-1] + 1, device=indices.device)
    return torch.where(indices >= 0, cols, torch.zeros_like(cols)).amax(dim=-1)


def _to_width(indices: torch.Tensor, width: int) -> torch.Tensor:
    """``indices`` cut or -1-padded to ``width`` columns (only -1 columns are ever cut)."""
    if width <= indices.shape[-1]:
        return indices[:, :width]
    return torch.cat([indices, indices.new_full((indices.shape[0], width - indices.shape[-1]), -1)], dim=1)


def sparse_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    extra_kv: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference, per group of queries that need the same extra width, in tiles of TILE queries.

    The window index list is used at the width given: the engine's is the model's sliding window for
    every query, whatever the batch.
    """
    if extra_kv is None or extra_indices is None or extra_indices.shape[-1] == 0:
        return _tiled(lambda qq, ii: ref.sparse_attention(qq, kv, ii, sinks, scale), (q, 0), (indices, -1),
                      tile=ATTENTION_TILE)
    widths = -(-_used_width(extra_indices) // WIDTH_BUCKET) * WIDTH_BUCKET
    out = torch.empty_like(q)
    for width in torch.unique(widths).tolist():
        rows = torch.nonzero(widths == width).squeeze(1)
        extra = _to_width(extra_indices[rows], int(width))
        if width == 0:
            part = _tiled(lambda qq, ii: ref.sparse_attention(qq, kv, ii, sinks, scale),
                          (q[rows], 0), (indices[rows], -1), tile=ATTENTION_TILE)
        else:
            part = _tiled(lambda qq, ii, ee: ref.sparse_attention(qq, kv, ii, sinks, scale, extra_kv, ee),
                          (q[rows], 0), (indices[rows], -1), (extra, -1), tile=ATTENTION_TILE)
        out[rows] = part
    return out


def indexer_scores(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, candidates: torch.Tensor, scale: float
) -> torch.Tensor:
    """The reference's scores, each candidate's dot products from a GEMM of SCORE_TILE candidates (the
    list zero-padded to a multiple), the heads' terms added in head order."""
    acc = ref.acc_dtype(q.dtype)
    cand_keys, valid = ref.gather_rows(keys, candidates)
    tokens, heads, dim = q.shape
    width = candidates.shape[-1]
    tiles = -(-width // SCORE_TILE)
    padded = torch.zeros((tokens, tiles * SCORE_TILE, dim), dtype=acc)
    padded[:, :width] = cand_keys
    per_tile = q.to(acc).unsqueeze(1).expand(tokens, tiles, heads, dim).reshape(tokens * tiles, heads, dim)
    dots = torch.bmm(per_tile, padded.view(tokens * tiles, SCORE_TILE, dim).transpose(1, 2))
    dots = dots.view(tokens, tiles, heads, SCORE_TILE).transpose(1, 2).reshape(tokens, heads, -1)[..., :width]
    terms = torch.relu(dots) * scale * weights.to(acc).unsqueeze(-1)
    scores = terms[:, 0]
    for h in range(1, heads):
        scores = scores + terms[:, h]
    return scores.masked_fill(~valid, float("-inf"))


ALL_OPS = {
    "linear": linear,
    "grouped_linear": grouped_linear,
    "swiglu": swiglu,
    "moe_route": moe_route,
    "sparse_attention": sparse_attention,
    "hc_pre": hc_pre,
    "hc_head": hc_head,
    "moe_experts": moe_experts,
    "linear_fp8": linear_fp8,
    "moe_experts_fp8": moe_experts_fp8,
}

# FP4: the same loop, its GEMMs and SwiGLU the invariant ones (activation quantisation is per row)
moe_experts_fp4 = partial(ref.moe_experts_fp4, linear=linear, swiglu=swiglu)
ALL_OPS["moe_experts_fp4"] = moe_experts_fp4

# FP8 KV entries: decoded rows, then the invariant attention (decoding is per row)
sparse_attention_fp8 = partial(ref.sparse_attention_fp8, attention=sparse_attention)
ALL_OPS["sparse_attention_fp8"] = sparse_attention_fp8
ALL_OPS["linear_fp8_ue8m0"] = partial(ref.linear_fp8_ue8m0, linear=linear)
ALL_OPS["moe_experts_act_quant"] = partial(ref.moe_experts_act_quant, linear=linear, swiglu=swiglu)
# DeepSeek-V4.1: the indexer's scores, single-pass mHC's mixes, and the experts with their activations quantised
# per `block` channels
ALL_OPS["indexer_scores"] = indexer_scores
ALL_OPS["hc_mixes"] = partial(ref.hc_mixes, mm=linear, sigmoid=_sigmoid)
ALL_OPS["moe_experts_quant_act"] = partial(ref.moe_experts_quant_act, linear=linear, swiglu=swiglu)
ALL_OPS["moe_experts_fp4_quant_act"] = partial(ref.moe_experts_fp4_quant_act, linear=linear, swiglu=swiglu)

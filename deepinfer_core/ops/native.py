"""Every op the DeepSeek-V4 model and the sampler call, declared once, on its plain-torch body.

``@op(signature, semantics, batch_invariant=..., syncs_host=...)`` on a body declares the op of the
body's name: its :class:`OpSpec` (the catalogue entry) carries the signature, the reference semantics,
the batch-invariance promise, the body itself and whether the body waits for the host. The body is the
semantics written out literally (vLLM's ``forward_native``): cpu_ref serves it as the golden reference,
other backends register it below their own kernels with :func:`register`, so an op a backend does not
accelerate is served by the same body everywhere. :data:`CATALOGUE`, :data:`NATIVE_OPS` and
:data:`SYNCS_HOST` are read off the declarations; adding an op is one decorated function here.

Reductions run in at least float32 (float64 stays float64); results come back in the input dtype.
Some bodies take keyword-only hooks (``mm``, ``sigmoid``, ``linear``, ``swiglu``, ``scoring``,
``attention``) so that a variant can swap the GEMM or an elementwise function and keep the rest of the
body (``deepinfer_cpu_ref.batch_invariant``). Nothing here waits for the device except the MoE bodies,
which loop over the experts that have tokens (``syncs_host=True``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch
import torch.nn.functional as F

from deepinfer_core.quant.fp4 import (
    dequantize_fp4_block,
    fake_quant_act_fp4,
    fake_quant_act_ue8m0,
    fake_quant_fp4_e4m3_scale,
    fp4_expert,
    hadamard,
)
from deepinfer_core.quant.fp8 import dequantize_act_fp8, dequantize_fp8_block, quantize_act_fp8
from deepinfer_core.quant.kv_fp4 import FORMATS as KV_FP4_FORMATS
from deepinfer_core.quant.kv_fp4 import pack_kv_fp4, unpack_kv_fp4
from deepinfer_core.quant.kv_fp8 import pack_kv_fp8, unpack_kv_fp8

# --- the catalogue ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class OpSpec:
    """One catalogued op.

    ``batch_invariant`` is a promise every implementation of the op must keep: the result for one row
    (token, window, sampled sequence) is bit-identical whatever the other rows of the call are, how many
    there are, where the row sits among them, and how far shared index lists are padded with ``-1``.
    Ops marked ``False`` may break that in the default mode (blocked GEMMs pick their kernel by the
    number of rows; reductions change order with the padded width); an engine built with
    ``batch_invariant=True`` resolves each of them only to an implementation registered with
    ``batch_invariant=True`` (cpu_ref: ``deepinfer_cpu_ref.batch_invariant``), so a request's tokens and
    logprobs do not depend on what it was batched with.

    ``native`` is the op's plain-torch body; ``syncs_host``: that body reads values back to the host
    (the per-expert loops), so a step that calls it cannot be captured in a graph.
    """

    name: str
    signature: str
    semantics: str
    batch_invariant: bool = True
    syncs_host: bool = False
    native: Callable | None = field(default=None, compare=False, repr=False)


#: every declared op by name, in declaration order (the order listings show)
CATALOGUE: dict[str, OpSpec] = {}

_Body = TypeVar("_Body", bound=Callable)


def op(
    signature: str, semantics: str, *, batch_invariant: bool = True, syncs_host: bool = False
) -> Callable[[_Body], _Body]:
    """Declare the decorated function as the native body of the op of its name (returned unchanged)."""

    def declare(body: _Body) -> _Body:
        name = body.__name__
        if name in CATALOGUE:
            raise ValueError(f"op {name!r} declared twice")
        CATALOGUE[name] = OpSpec(name, signature, semantics, batch_invariant, syncs_host, body)
        return body

    return declare


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype of an op on ``dtype`` inputs: float64 stays float64, the rest float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# --- dense layers ----------------------------------------------------------------------------------


@op("(ids: Long[T], weight: [V, D]) -> [T, D]", "Row lookup weight[ids].")
def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight[ids]


@op(
    "(ids: Long[T], weight: E4M3 [V, D], scale: f32|E8M0 [V, D/G]) -> f32 [T, D]",
    "Row lookup of a table kept in FP8, each row's groups of G = D / scale.shape[1] values scaled by their "
    "scale: weight[ids] * scale[ids] (per group), in float32.",
)
def embedding_fp8(ids: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    group = weight.shape[-1] // scale.shape[-1]
    return weight[ids].float() * scale[ids].float().repeat_interleave(group, dim=-1)


@op(
    "(x: [..., D], weight: [D] | None, eps: float) -> [..., D]",
    "x * rsqrt(mean(x^2) + eps) (* weight when given), computed in at least float32, returned in x.dtype.",
)
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = x.to(acc_dtype(x.dtype))
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(y.dtype)
    return y.to(x.dtype)


@op(
    "(x: [T, H, D], cos: [T, R/2], sin: [T, R/2], inverse: bool) -> [T, H, D]",
    "Interleaved-pair RoPE on the trailing R channels of each head (pairs (2i, 2i+1) rotated by "
    "angle i); inverse=True rotates by the negative angle. Leading D-R channels unchanged.",
)
def rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    rope_dim = 2 * cos.shape[-1]
    acc = acc_dtype(x.dtype)
    cos = cos.to(acc).repeat_interleave(2, dim=-1).unsqueeze(-2)  # [T, 1, R]
    sin = sin.to(acc).repeat_interleave(2, dim=-1).unsqueeze(-2)
    if inverse:
        sin = -sin
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:].to(acc)
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated_half = torch.stack((-odd, even), dim=-1).flatten(-2)
    rotated = rope * cos + rotated_half * sin
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)


@op("(x: [..., K], weight: [N, K], bias: [N] | None) -> [..., N]", "x @ weight.T + bias.", batch_invariant=False)
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


@op(
    "(x: [T, G, K], weight: [G*N, K]) -> [T, G, N]",
    "Block-diagonal projection: group g uses weight rows g*N:(g+1)*N.",
    batch_invariant=False,
)
def grouped_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    groups = x.shape[-2]
    w = weight.view(groups, -1, x.shape[-1])  # [G, N, K]
    return torch.einsum("tgk,gnk->tgn", x, w)


@op(
    "(gate_up: [T, 2I], limit: float) -> [T, I]",
    "silu(min(gate, limit)) * clamp(up, -limit, limit), gate = first half, up = second half.",
    batch_invariant=False,
)
def swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


# --- attention, compression, indexer ---------------------------------------------------------------


def gather_rows(pool: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``pool[indices]`` with -1 entries replaced by zeros (never reading the pool there), and the mask
    of the valid entries."""
    valid = indices >= 0
    rows = pool[indices.clamp(min=0)]
    rows = torch.where(valid.unsqueeze(-1), rows, torch.zeros((), dtype=pool.dtype, device=pool.device))
    return rows, valid


@op(
    "(q: [T, H, D], kv: [N, D], indices: Long[T, K], sinks: [H], scale: float, "
    "extra_kv: [M, D] | None, extra_indices: Long[T, K2] | None) -> [T, H, D]",
    "Shared-KV MQA: for each query t the keys (= values) are kv[indices[t]] and "
    "extra_kv[extra_indices[t]] (index -1 = unused slot, never read). softmax over the logits "
    "q.k*scale plus a per-head sink logit that only enters the denominator; output = sum p*v.",
    batch_invariant=False,
)
def sparse_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    extra_kv: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    acc = acc_dtype(q.dtype)
    keys, valid = gather_rows(kv, indices)
    if extra_kv is not None and extra_indices is not None and extra_indices.shape[-1] > 0:
        extra_keys, extra_valid = gather_rows(extra_kv, extra_indices)
        keys, valid = torch.cat([keys, extra_keys], 1), torch.cat([valid, extra_valid], 1)
    keys = keys.to(acc)  # [T, K, D]
    logits = torch.einsum("thd,tkd->thk", q.to(acc), keys) * scale
    logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
    sink = sinks.to(acc).view(1, -1, 1).expand(q.shape[0], -1, 1)
    combined = torch.cat([logits, sink], dim=-1)
    probs = torch.softmax(combined, dim=-1)[..., :-1]
    return torch.einsum("thk,tkd->thd", probs, keys).to(q.dtype)


@op(
    "(q: [B, N, H, D], k: [B, N, H, D], v: [B, N, H, D], scale: float) -> [B, N, H, D]",
    "Bidirectional multi-head attention within each of B sequences of N tokens (a vision encoder's "
    "patches): softmax over all N keys of q.k*scale, no mask, no sink; output = sum p*v. In at least "
    "float32, returned in q.dtype; sequence b never reads another sequence.",
)
def encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    acc = acc_dtype(q.dtype)
    # one call per sequence: a sequence's result cannot depend on the others (batch invariance)
    out = [F.scaled_dot_product_attention(*(t[b].transpose(0, 1).to(acc) for t in (q, k, v)), scale=scale)
           for b in range(q.shape[0])]
    return torch.stack(out).transpose(1, 2).to(q.dtype) if out else q.clone()


@op(
    "(kv: [W, L, D], gate: [W, L, D]) -> [W, D]",
    "Per window: sum over L of softmax_L(gate) * kv, softmax in float32 (gate -inf = empty slot).",
)
def compress_windows(kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    weights = torch.softmax(gate.to(acc_dtype(gate.dtype)), dim=1)
    return (kv.to(weights.dtype) * weights).sum(dim=1).to(kv.dtype)


SORT_ALL_WIDTH_PER_PICK = 4


def select_topk(scores: torch.Tensor, valid: torch.Tensor, candidates: torch.Tensor, topk: int) -> torch.Tensor:
    """The candidate ids of the ``topk`` best scores, best first, ties towards the earlier candidate
    (the first ``topk`` of a stable descending sort), invalid picks and missing slots as -1.

    Rows wider than ``SORT_ALL_WIDTH_PER_PICK * topk`` sort only the picks: the k-th best score is found
    by a partial selection; every slot scoring above it and the earliest slots equal to it are the
    picks, which are then ordered. Shorter rows (every decode up to a few thousand tokens of context)
    are sorted whole, which takes fewer kernels."""
    k = min(topk, candidates.shape[-1])
    picked = _stable_topk_columns(scores, k)
    chosen = candidates.gather(1, picked)
    chosen = torch.where(valid.gather(1, picked), chosen, torch.full_like(chosen, -1))
    if k < topk:
        chosen = torch.cat([chosen, chosen.new_full((chosen.shape[0], topk - k), -1)], dim=1)
    return chosen


def _stable_topk_columns(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Columns of the ``k`` best scores per row in the order of a stable descending sort, without one."""
    if k == 0:
        return torch.zeros((scores.shape[0], 0), dtype=torch.long, device=scores.device)
    width = scores.shape[-1]
    if width <= SORT_ALL_WIDTH_PER_PICK * k:  # short rows: one sort costs less than two selections and two sorts
        return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    values, columns = torch.topk(scores, k, dim=-1)  # best first; the order among equal scores is open
    kth = values[:, -1:]
    above = (values > kth).sum(-1, keepdim=True)  # these columns are certain picks
    # the earliest columns scoring exactly the k-th score fill the remaining places
    first = width - torch.arange(width, dtype=torch.int32, device=scores.device)
    earliest = width - torch.topk(torch.where(scores == kth, first, 0), k, dim=-1).values.long()
    place = torch.arange(k, device=scores.device)
    picks = torch.where(place < above, columns, earliest.gather(1, (place - above).clamp(min=0)))
    # order the picks by (score descending, column ascending)
    picks = picks.sort(dim=-1).values
    order = torch.sort(scores.gather(1, picks), dim=-1, descending=True, stable=True).indices
    return picks.gather(1, order)


@op(
    "(q: [T, H, d], weights: [T, H], keys: [N, d], candidates: Long[T, C], topk: int, "
    "scale: float) -> Long[T, topk]",
    "Lightning indexer: score(t, c) = sum_h weights[t,h] * relu(q[t,h] . keys[candidates[t,c]]) * "
    "scale over the valid candidates (-1 = none); return the candidate key ids of the topk best "
    "scores, best first, ties broken towards the earlier candidate, padded with -1.",
)
def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    candidates: torch.Tensor,
    topk: int,
    scale: float,
) -> torch.Tensor:
    acc = acc_dtype(q.dtype)
    cand_keys, valid = gather_rows(keys, candidates)  # [T, C, d]
    dots = torch.einsum("thd,tcd->thc", q.to(acc), cand_keys.to(acc))
    scores = (torch.relu(dots) * scale * weights.to(acc).unsqueeze(-1)).sum(dim=1)  # [T, C]
    scores = scores.masked_fill(~valid, float("-inf"))
    return select_topk(scores, valid, candidates, topk)


@op(
    "(q: [T, H, d], weights: [T, H], keys: [N, d], candidates: Long[T, C], scale: float) -> [T, C]",
    "The lightning indexer's scores without the selection: score(t, c) = sum_h weights[t,h] * "
    "relu(q[t,h] . keys[candidates[t,c]]) * scale, -inf where candidates[t,c] = -1; computed in at least "
    "float32 and returned so.",
    batch_invariant=False,
)
def indexer_scores(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, candidates: torch.Tensor, scale: float
) -> torch.Tensor:
    acc = acc_dtype(q.dtype)
    cand_keys, valid = gather_rows(keys, candidates)  # [T, C, d]
    dots = torch.einsum("thd,tcd->thc", q.to(acc), cand_keys.to(acc))
    scores = (torch.relu(dots) * scale * weights.to(acc).unsqueeze(-1)).sum(dim=1)
    return scores.masked_fill(~valid, float("-inf"))


@op(
    "(scores: [T, C], valid: Bool[T, C], block: int, topk_blocks: int) -> Bool[T, C]",
    "Level one of a two-level top-k (DeepSeek-V4.1's candidate filter): columns in blocks of `block` "
    "consecutive ones, each block scored by its max score (-inf where it has no valid column); the block "
    "of a row's last valid column pinned (+inf); the topk_blocks best blocks kept (ties towards the lower "
    "block), blocks scoring -inf never; returns which valid columns lie in kept blocks.",
)
def candidate_blocks(scores: torch.Tensor, valid: torch.Tensor, block: int, topk_blocks: int) -> torch.Tensor:
    rows, width = scores.shape
    if width == 0:  # no columns: nothing to keep
        return valid.clone()
    num_blocks = -(-width // block)
    padded = torch.full((rows, num_blocks * block), float("-inf"), dtype=scores.dtype, device=scores.device)
    padded[:, :width] = scores.masked_fill(~valid, float("-inf"))
    block_scores = padded.view(rows, num_blocks, block).amax(dim=-1)
    columns = torch.arange(width, device=scores.device)
    last = torch.where(valid, columns, -1).amax(dim=-1, keepdim=True)  # -1: none valid
    newest = last.div(block, rounding_mode="floor")  # -1: none valid
    block_scores = block_scores.masked_fill(torch.arange(num_blocks, device=scores.device) == newest, float("inf"))
    order = torch.sort(block_scores, dim=-1, descending=True, stable=True).indices[:, :topk_blocks]
    kept = torch.zeros_like(block_scores, dtype=torch.bool)
    kept.scatter_(1, order, block_scores.gather(1, order) > float("-inf"))
    return kept.repeat_interleave(block, dim=-1)[:, :width] & valid


# --- manifold-constrained hyper-connections --------------------------------------------------------


def _mm(a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return a @ weight.T


def _unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@op(
    "(streams: [T, n, D], fn: [(2+n)n, nD], base: [(2+n)n], scale: [3], sinkhorn_iters: int, "
    "hc_eps: float, norm_eps: float) -> (post: [T, n], comb: [T, n, n], collapsed: [T, D])",
    "mHC: mixes = fn . unweighted_rmsnorm(flatten(streams)); pre = sigmoid(m*s0+b)+eps, "
    "post = 2 sigmoid(m*s1+b), comb = softmax(m*s2+b)+eps then column, (row, column)*(iters-1) "
    "Sinkhorn normalisation; collapsed = sum_i pre_i streams_i. Computed in at least float32.",
    batch_invariant=False,
)
def hc_pre(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
    *,
    mm: Callable = _mm,
    sigmoid: Callable = torch.sigmoid,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    pre, post, comb = hc_mixes(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, mm=mm, sigmoid=sigmoid)
    collapsed = (pre.unsqueeze(-1) * streams.to(pre.dtype)).sum(dim=1).to(streams.dtype)
    return post, comb, collapsed


@op(
    "(block_out: [T, D], streams: [T, n, D], post: [T, n], comb: [T, n, n]) -> [T, n, D]",
    "new_streams[k] = post[k] * block_out + sum_j comb[j, k] * streams[j].",
)
def hc_post(
    block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    dtype = streams.dtype
    mixed = torch.einsum("tjk,tjd->tkd", comb.to(dtype), streams)
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(1) + mixed


@op(
    "(streams: [T, n, D], fn: [n, nD], base: [n], scale: [1], hc_eps: float, norm_eps: float) "
    "-> [T, D]",
    "Final collapse: pre = sigmoid(fn . unweighted_rmsnorm(flatten(streams)) * scale + base) + eps; "
    "sum_i pre_i streams_i.",
    batch_invariant=False,
)
def hc_head(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    hc_eps: float,
    norm_eps: float,
    *,
    mm: Callable = _mm,
    sigmoid: Callable = torch.sigmoid,
) -> torch.Tensor:
    acc = acc_dtype(streams.dtype)
    flat = _unweighted_rms(streams.flatten(1).to(acc), norm_eps)
    pre = sigmoid(mm(flat, fn.to(acc)) * scale.to(acc) + base.to(acc)) + hc_eps
    return (pre.unsqueeze(-1) * streams.to(acc)).sum(dim=1).to(streams.dtype)


@op(
    "(streams: [T, n, D], fn: [(2+n)n, nD], base: [(2+n)n], scale: [3], sinkhorn_iters: int, "
    "hc_eps: float, norm_eps: float) -> (pre: [T, n], post: [T, n], comb: [T, n, n])",
    "hc_pre's three mixes without the collapse (single-pass mHC computes a sublayer's pre for the next "
    "sublayer), in at least float32.",
    batch_invariant=False,
)
def hc_mixes(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
    *,
    mm: Callable = _mm,
    sigmoid: Callable = torch.sigmoid,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = streams.shape[1]
    acc = acc_dtype(streams.dtype)
    mixes = mm(_unweighted_rms(streams.flatten(1).to(acc), norm_eps), fn.to(acc))
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.to(acc).split([n, n, n * n])
    s = scale.to(acc)
    pre = sigmoid(pre_w * s[0] + pre_b) + hc_eps
    post = 2 * sigmoid(post_w * s[1] + post_b)
    comb = torch.softmax(comb_w.reshape(-1, n, n) * s[2] + comb_b.view(n, n), dim=-1) + hc_eps
    return pre, post, _sinkhorn(comb, sinkhorn_iters, hc_eps)


def _sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """``comb / (column sums + eps)``, then ``iters - 1`` times the same by rows and by columns (comb: this
    call's own [T, n, n] tensor). On the CPU, for float32 / float64 and n <= 4 (every published hc_mult), in
    numpy and in place: numpy and torch's CPU sums both add up to 4 values in index order (tests/ops checks
    that the two paths agree bit for bit), and the 117 small operations of 20 iterations cost a fraction of
    torch's dispatch."""
    if (comb.device.type != "cpu" or comb.shape[-1] > 4 or comb.dtype not in (torch.float32, torch.float64)
            or comb.requires_grad):
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        for _ in range(iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        return comb
    comb = comb.contiguous()
    c = comb.numpy()  # the same memory: the operations below write comb
    e = c.dtype.type(eps)
    cols = c.sum(axis=1, keepdims=True)  # dim -2
    rows = np.empty((*c.shape[:2], 1), dtype=c.dtype)  # dim -1, written by each iteration
    cols += e
    c /= cols
    for _ in range(iters - 1):
        c.sum(axis=2, keepdims=True, out=rows)
        rows += e
        c /= rows
        c.sum(axis=1, keepdims=True, out=cols)
        cols += e
        c /= cols
    return comb


@op(
    "(streams: [T, n, D], pre: [T, n]) -> [T, D]",
    "sum_i pre[t, i] * streams[t, i], in at least float32, returned in streams.dtype.",
)
def hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    acc = acc_dtype(streams.dtype)
    return (pre.to(acc).unsqueeze(-1) * streams.to(acc)).sum(dim=1).to(streams.dtype)


@op(
    "(streams: [T, n, D], key: [T, n, D], value: [T, D], q_weight: [n, D], k_weight: [n, D], eps: float) "
    "-> [T, n, D]",
    "DeepSeek-V4.1's Engram gate, per stream i: dot = sum_d streams[t,i,d] * q_weight[i,d] * k_weight[i,d] * "
    "key[t,i,d] * rsqrt(mean_d streams[t,i]^2 + eps) * rsqrt(mean_d key[t,i]^2 + eps) / sqrt(D); gate = "
    "sigmoid(sign(dot) * sqrt(max(|dot|, 1e-6))); out = streams + gate * value. In at least float32, "
    "returned in streams.dtype.",
)
def engram_gate(streams: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_weight: torch.Tensor,
                k_weight: torch.Tensor, eps: float) -> torch.Tensor:
    acc = acc_dtype(streams.dtype)
    h, k = streams.to(acc), key.to(acc)
    weight = q_weight.to(acc) * k_weight.to(acc)
    rstd = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(k.square().mean(-1) + eps)
    dot = (h * weight * k).sum(-1) * rstd * h.shape[-1] ** -0.5
    # 1 / (1 + exp(-z)) rather than torch.sigmoid, whose CPU kernel rounds a value differently by where it
    # falls in a vector run: a token's gate must not depend on the other tokens of the batch
    gate = 1 / (1 + torch.exp(-torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot)))
    return (h + gate.unsqueeze(-1) * value.to(acc).unsqueeze(-2)).to(streams.dtype)


@op(
    "(history: Long[T, n], token_map: Long[M], multipliers: Long[L, n], primes: Long[L, n-1, H], "
    "offsets: Long[L, (n-1)*H], pad_id: int) -> Long[T, L, (n-1)*H]",
    "DeepSeek-V4.1's n-gram hash of every token into each Engram layer's table rows. history[t, s] is the "
    "token id at position p - s, or negative (before the sequence start, a dead token): from the first negative "
    "shift on, every shift takes pad_id, the others token_map[id]. Per layer l: x_s = id_s * multipliers[l, s] "
    "(int64), r_1 = x_0 ^ x_1, r_k = r_(k-1) ^ x_k; column (k-1)*H + h = r_k % primes[l, k-1, h] + "
    "offsets[l, (k-1)*H + h]. Ids must lie below M (not checked: no host sync).",
)
def engram_hash(history: torch.Tensor, token_map: torch.Tensor, multipliers: torch.Tensor, primes: torch.Tensor,
                offsets: torch.Tensor, pad_id: int) -> torch.Tensor:
    history = history.to(torch.int64)
    # once a shift is blocked every longer look-back is too
    stop = torch.cumsum(history < 0, dim=1) > 0
    ids = torch.where(stop, pad_id, token_map[history.clamp_min(0)])  # [T, n]
    products = ids.unsqueeze(1) * multipliers  # [T, L, n]
    running = products[..., 0]
    columns = []
    for size in range(2, history.shape[1] + 1):
        running = running ^ products[..., size - 1]  # the hash of the `size`-gram
        columns.append(running.unsqueeze(-1) % primes[:, size - 2])  # [T, L, H]
    return torch.cat(columns, dim=-1) + offsets


@op(
    "(ids: Long[T, C], weight: E4M3 [V, D], scale: f32|E8M0 [V, D/G], row_start: int) -> f32 [T, C*D]",
    "Engram's row lookup from a table, or from the shard of one that holds rows row_start .. row_start+V-1: "
    "row r = ids[t, c] - row_start dequantised per group of G = D / scale.shape[1] values (weight[r] * "
    "scale[r]), the C rows of a token side by side; an id outside the shard gives a row of zeros (all bits "
    "clear), so the shards' results sum, bit pattern by bit pattern, to the whole table's. The table may live "
    "in host memory (pinned, or a file's mapping) while ids are on the device; the result is on ids' device.",
)
def engram_lookup(ids: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, row_start: int) -> torch.Tensor:
    tokens, cols = ids.shape
    local = ids.to(weight.device) - row_start  # the native body reads host tables on the host (a copy)
    inside = (local >= 0) & (local < weight.shape[0])
    rows = local.clamp(0, weight.shape[0] - 1).reshape(-1)
    group = weight.shape[-1] // scale.shape[-1]
    values = weight[rows].float() * scale[rows].float().repeat_interleave(group, dim=-1)
    values = values.masked_fill(~inside.reshape(-1, 1), 0.0)
    return values.reshape(tokens, cols * weight.shape[-1]).to(ids.device)


# --- mixture of experts ----------------------------------------------------------------------------

SCORING: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sqrtsoftplus": lambda x: F.softplus(x).sqrt(),
    "sigmoid": torch.sigmoid,
    "softmax": lambda x: torch.softmax(x, dim=-1),
}


@op(
    "(logits: [T, E], scoring_func: str, top_k: int, correction_bias: [E] | None, "
    "fixed_ids: Long[T, k] | None, routed_scaling_factor: float) -> (weights: [T, k], ids: Long[T, k])",
    "scores = sqrtsoftplus|sigmoid|softmax(logits); ids = fixed_ids (hash routing) or the top_k of "
    "scores + correction_bias (ties towards the lower expert id); weights = scores[ids] / sum * "
    "routed_scaling_factor.",
    batch_invariant=False,
)
def moe_route(
    logits: torch.Tensor,
    scoring_func: str,
    top_k: int,
    correction_bias: torch.Tensor | None,
    fixed_ids: torch.Tensor | None,
    routed_scaling_factor: float,
    *,
    scoring: dict[str, Callable] = SCORING,
) -> tuple[torch.Tensor, torch.Tensor]:
    if scoring_func not in scoring:
        raise ValueError(f"unknown scoring_func {scoring_func!r}; expected one of {sorted(scoring)}")
    scores = scoring[scoring_func](logits)
    if fixed_ids is not None:
        ids = fixed_ids.long()
    else:
        acc = acc_dtype(scores.dtype)
        choice = scores.to(acc) if correction_bias is None else scores.to(acc) + correction_bias.to(acc)
        # a stable sort: among equal scores the lower expert id wins, as the catalogue says
        ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = scores.gather(1, ids)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


def expert_pairs(topk_ids: torch.Tensor, num_experts: int) -> Iterator[tuple[int, torch.Tensor]]:
    """(expert, its flat ``token * k + slot`` pairs in ascending order) for every expert with pairs, in
    ascending expert order; ids outside ``[0, num_experts)`` get none. Reads the counts back to the host
    once (one sort and one count for all experts)."""
    flat = topk_ids.reshape(-1)
    key = torch.where((flat >= 0) & (flat < num_experts), flat, torch.full_like(flat, num_experts))
    order = torch.sort(key, stable=True).indices
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts].tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count:
            yield expert, order[start : start + count]
            start += count


@op(
    "(x: [T, D], w13: [E, 2I, D], w2: [E, D, I], topk_ids: Long[T, k], topk_weights: [T, k], "
    "swiglu_limit: float) -> [T, D]",
    "sum_k topk_weights[t,k] * w2[e] . swiglu(w13[e] . x[t]) with e = topk_ids[t,k] (ids < 0 skipped).",
    batch_invariant=False,
    syncs_host=True,
)
def moe_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    swiglu_limit: float,
    *,
    linear: Callable = F.linear,
    swiglu: Callable = swiglu,
) -> torch.Tensor:
    """Experts in ascending id order, so a token's terms are always summed in one order."""
    k = topk_ids.shape[-1]
    out = torch.zeros_like(x)
    for expert, pairs in expert_pairs(topk_ids, w13.shape[0]):
        token_idx = pairs // k
        h = swiglu(linear(x[token_idx], w13[expert]), swiglu_limit)
        y = linear(h, w2[expert]) * topk_weights.reshape(-1)[pairs, None].to(x.dtype)
        out.index_add_(0, token_idx, y)
    return out


def _fake_quant_act(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x quantised per token per 128 channels (from float32) and dequantised again, in ``dtype``."""
    return dequantize_act_fp8(*quantize_act_fp8(x), dtype=dtype)


@op(
    "(x: [..., K], weight: E4M3 [N, K], weight_scale: f32 [ceil(N/128), ceil(K/128)]) -> [..., N]",
    "DeepSeek's block FP8 (as DeepGEMM): each row of x is quantised per 128-channel group g (the last "
    "may be partial) from its float32 values: s_x = max(amax_g |x|, 1e-4) / 448, q_x = e4m3(x / s_x) "
    "(round to nearest even); weight_scale[i, j] scales the 128x128 weight tile (i, j). "
    "out = sum_g (q_x . q_w) * s_x * s_w over the K groups, accumulated in at least float32, "
    "returned in x.dtype.",
    batch_invariant=False,
)
def linear_fp8(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, *, linear: Callable = F.linear
) -> torch.Tensor:
    """Quantised activations times the dequantised weight (both exact in float64)."""
    acc = acc_dtype(x.dtype)
    w = dequantize_fp8_block(weight, weight_scale, dtype=acc)
    return linear(_fake_quant_act(x, acc), w).to(x.dtype)


@op(
    "(x: [T, D], w13: E4M3 [E, 2I, D], w13_scale: f32 [E, ceil(2I/128), ceil(D/128)], "
    "w2: E4M3 [E, D, I], w2_scale: f32 [E, ceil(D/128), ceil(I/128)], topk_ids: Long[T, k], "
    "topk_weights: [T, k], swiglu_limit: float) -> [T, D]",
    "moe_experts with both projections as linear_fp8: gate_up = linear_fp8(x[t], w13[e], w13_scale[e]) "
    "and h = swiglu(gate_up) kept in float32 (not rounded to x.dtype), h quantised per 128 channels "
    "like x, out[t] = sum_k topk_weights[t,k] * linear_fp8(h, w2[e], w2_scale[e]) summed in at least float32 "
    "(ids < 0 skipped), returned in x.dtype.",
    batch_invariant=False,
    syncs_host=True,
)
def moe_experts_fp8(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    swiglu_limit: float,
    *,
    linear: Callable = F.linear,
    swiglu: Callable = swiglu,
) -> torch.Tensor:
    """Experts in ascending id order; gate/up, SwiGLU and the sum stay in the accumulation dtype."""
    acc = acc_dtype(x.dtype)
    k = topk_ids.shape[-1]
    xq = _fake_quant_act(x, acc)
    out = torch.zeros(x.shape, dtype=acc, device=x.device)
    for expert, pairs in expert_pairs(topk_ids, w13.shape[0]):
        token_idx = pairs // k
        gate_up = linear(xq[token_idx], dequantize_fp8_block(w13[expert], w13_scale[expert], dtype=acc))
        h = _fake_quant_act(swiglu(gate_up, swiglu_limit), acc)
        y = linear(h, dequantize_fp8_block(w2[expert], w2_scale[expert], dtype=acc))
        out.index_add_(0, token_idx, y * topk_weights.reshape(-1)[pairs, None].to(acc))
    return out.to(x.dtype)


# --- sampling --------------------------------------------------------------------------------------


@op(
    "(logits: [B, V], prompt_mask: Bool[B, V], output_counts: [B, V], repetition: [B], "
    "presence: [B], frequency: [B]) -> [B, V]",
    "Repetition penalty on tokens seen in prompt or output (divide positive, multiply negative "
    "logits), then logits -= frequency*count + presence*(count>0).",
)
def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    seen = prompt_mask | (output_counts > 0)
    rep = repetition.to(logits.dtype).unsqueeze(1).expand_as(logits)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    counts = output_counts.to(logits.dtype)
    logits = logits - frequency.to(logits.dtype).unsqueeze(1) * counts
    return logits - presence.to(logits.dtype).unsqueeze(1) * (counts > 0).to(logits.dtype)


@op(
    "(logits: [B, V], top_k: Long[B], top_p: [B], min_p: [B]) -> [B, V]",
    "Set to -inf every logit outside the top_k (k<=0: off), outside the smallest set with "
    "probability mass >= top_p (ties at the boundary kept), or with probability < min_p * max prob.",
)
def top_k_top_p_min_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    neg_inf = torch.full((), float("-inf"), dtype=logits.dtype, device=logits.device)  # a fill: no host copy
    vocab = logits.shape[-1]
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
    logits = torch.where(logits < kth, neg_inf, logits)
    probs = torch.softmax(logits.to(acc_dtype(logits.dtype)), dim=-1)
    sorted_probs = probs.gather(1, order)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # top_p >= 1 is off: a float32 cumsum over a large vocab reaches 1 early and would cut the tail
    drop_sorted = (mass_before >= top_p.to(probs.dtype).unsqueeze(1)) & (top_p < 1).unsqueeze(1)
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    # ties at the top_p boundary are kept: nothing as probable as the least probable kept token is dropped
    drop = drop & (probs < probs.masked_fill(drop, float("inf")).min(dim=-1, keepdim=True).values)
    logits = torch.where(drop, neg_inf, logits)
    max_prob = probs.max(dim=-1, keepdim=True).values
    return torch.where(probs < min_p.to(probs.dtype).unsqueeze(1) * max_prob, neg_inf, logits)


@op(
    "(probs: [B, V], noise: [B, V]) -> Long[B]",
    "Exponential race: argmax(probs / noise) with noise ~ Exp(1) supplied by the caller "
    "(per-request generators keep seeded requests reproducible in any batch).",
)
def random_sample(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    return (probs / noise).argmax(dim=-1)


@op(
    "(logits: [B, V], bitmask: Int32[B, ceil(V/32)]) -> [B, V]",
    "xgrammar layout: bit (v % 32) of word v // 32 set = token v allowed; disallowed -> -inf.",
)
def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab]
    if allowed.shape[-1] < vocab:
        pad = allowed.new_zeros((allowed.shape[0], vocab - allowed.shape[-1]))
        allowed = torch.cat([allowed, pad], dim=-1)
    return logits.masked_fill(~allowed, float("-inf"))


# --- DeepSeek's FP4 routed experts and simulated activation quantisation (quant.fp4) ----------------


@op(
    "(x: [T, D], w13: U8 [E, 2I, D/2], w13_scale: E8M0|f32 [E, 2I, D/32], w2: U8 [E, D, I/2], "
    "w2_scale: E8M0|f32 [E, D, I/32], topk_ids: Long[T, k], topk_weights: [T, k], swiglu_limit: float, "
    "quant_act: bool) -> [T, D]",
    "Routed experts in FP4 e2m1, packed two a byte along the input dim (even element in the low nibble; "
    "codes 0-7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6, 8-15 their negatives), each row's 32 consecutive inputs "
    "scaled by one power of two (w = value * scale). quant_act=False: exactly moe_experts on the weights "
    "dequantised to x.dtype. quant_act=True (DeepSeek's inference/model.py): per expert e and its tokens, "
    "x quantised per 128 channels to E4M3 with power-of-two scales s = 2^ceil(log2(max(amax, 1e-4) / 448)) "
    "(quantise then dequantise), gate_up = xq . w13[e] accumulated in at least float32 and rounded to "
    "x.dtype, h = swiglu(gate_up) * topk_weights[t,k] in at least float32, rounded to x.dtype and quantised "
    "like x, y = hq . w2[e] rounded to x.dtype; out[t] = sum_k y summed in at least float32 (ids < 0 "
    "skipped), returned in x.dtype.",
    batch_invariant=False,
    syncs_host=True,
)
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
    *,
    linear: Callable = F.linear,
    swiglu: Callable = swiglu,
) -> torch.Tensor:
    """Experts in ascending id order, each one's packed weights dequantised on the fly (never the stack)."""
    k = topk_ids.shape[-1]
    if not quant_act:  # moe_experts on the dequantised weights
        out = torch.zeros_like(x)
        for expert, pairs in expert_pairs(topk_ids, w13.shape[0]):
            token_idx = pairs // k
            h = swiglu(linear(x[token_idx], dequantize_fp4_block(w13[expert], w13_scale[expert], x.dtype)),
                       swiglu_limit)
            y = linear(h, dequantize_fp4_block(w2[expert], w2_scale[expert], x.dtype))
            out.index_add_(0, token_idx, y * topk_weights.reshape(-1)[pairs, None].to(x.dtype))
        return out
    return _experts_quant_act(x, fp4_expert(w13, w13_scale), fp4_expert(w2, w2_scale), w13.shape[0],
                              topk_ids, topk_weights, swiglu_limit, linear=linear, swiglu=swiglu)


def _experts_quant_act(x: torch.Tensor, w13_of: Callable, w2_of: Callable, num_experts: int,
                       topk_ids: torch.Tensor, topk_weights: torch.Tensor, swiglu_limit: float, *,
                       linear: Callable, swiglu: Callable, block: int = 128) -> torch.Tensor:
    """DeepSeek's Expert.forward behind its quantised linears, per expert in ascending id order;
    ``w13_of(e, dtype)`` / ``w2_of(e, dtype)``: expert e's weights in ``dtype``."""
    k = topk_ids.shape[-1]
    acc = acc_dtype(x.dtype)
    xq = fake_quant_act_ue8m0(x, block).to(acc)
    out = torch.zeros(x.shape, dtype=acc, device=x.device)
    groups = list(expert_pairs(topk_ids, num_experts))
    if not groups:
        return out.to(x.dtype)
    hs = []
    for expert, pairs in groups:
        gate_up = linear(xq[pairs // k], w13_of(expert, acc))
        h = swiglu(gate_up.to(x.dtype).to(acc), swiglu_limit) * topk_weights.reshape(-1)[pairs, None].to(acc)
        hs.append(h.to(x.dtype))
    # the quantisation is per row: every expert's rows in one call
    hq = fake_quant_act_ue8m0(torch.cat(hs), block).to(acc).split([len(pairs) for _, pairs in groups])
    for (expert, pairs), h in zip(groups, hq):
        y = linear(h, w2_of(expert, acc)).to(x.dtype)
        out.index_add_(0, pairs // k, y.to(acc))
    return out.to(x.dtype)


@op(
    "(x: [..., K], block: int, fmt: str, rotate: bool) -> [..., K]",
    "DeepSeek's simulated activation quantisation (quantise, then dequantise; inference/model.py's "
    "act_quant and fp4_act_quant with inplace=True). rotate=True first applies the Walsh-Hadamard "
    "transform x @ H * K^-0.5 (Sylvester order, H[i,j] = (-1)^popcount(i&j), K a power of two), rounded "
    "to x.dtype as DeepSeek's kernel returns it. Then per "
    "block consecutive values along K (the last group may be partial): s = 2^ceil(log2(max(amax, eps) / "
    "qmax)); fmt 'e4m3': qmax 448, eps 1e-4, x/s rounded to E4M3 (nearest even, saturating); 'e2m1': "
    "qmax 6, eps 6 * 2^-126, x/s rounded to the nearest of 0, 0.5, 1, 1.5, 2, 3, 4, 6 (ties to even, "
    "signed); out = q * s. Computed in at least float32, returned in x.dtype.",
)
def act_quant_sim(x: torch.Tensor, block: int, fmt: str, rotate: bool) -> torch.Tensor:
    if fmt not in ("e4m3", "e2m1"):
        raise ValueError(f"unknown fmt {fmt!r}; expected 'e4m3' or 'e2m1'")
    y = hadamard(x) if rotate else x
    return fake_quant_act_ue8m0(y, block) if fmt == "e4m3" else fake_quant_act_fp4(y, block)


@op(
    "(x: [..., K], block: int) -> [..., K]",
    "DeepSeek-V4.1's compressed-KV quantisation, simulated (quantise, then dequantise): per block "
    "consecutive values along K (the last group may be partial) the E4M3 scale s = e4m3(max(amax, 6 * 2^-9) "
    "/ 6) (round to nearest even), q = e2m1(x / s) (nearest of 0, 0.5, 1, 1.5, 2, 3, 4, 6, ties to even, "
    "signed, saturating); out = q * s. Computed in at least float32, returned in x.dtype.",
)
def fp4_kv_sim(x: torch.Tensor, block: int) -> torch.Tensor:
    return fake_quant_fp4_e4m3_scale(x, block)


# --- DeepSeek-V4.1's packed KV entries (quant.kv_fp4) ---------------------------------------------


@op(
    "(x: [N, D], kind: str) -> U8 [N, B]",
    "DeepSeek-V4.1's packed KV entry of each row (quant.kv_fp4). kind 'window': the E4M3 codes of all D "
    "values, each group of 32 divided by s = 2^ceil(log2(max(amax, 1e-4) / 448)) (round to nearest even, "
    "saturating), then one byte log2(s) + 127 per group (D + D/32 bytes); 'compressed': e2m1 codes (nearest "
    "of 0, 0.5, 1, 1.5, 2, 3, 4, 6, ties to even, signed) of x / s per group of 16 with s = e4m3(max(amax, "
    "6 * 2^-9) / 6), packed two a byte (even value in the low nibble), then each group's E4M3 scale byte "
    "(D/2 + D/16 bytes); 'index': e2m1 codes per group of 32 with s = 2^ceil(log2(max(amax, 6 * 2^-126) / 6)) "
    "packed, then one byte log2(s) + 127 per group (D/2 + D/32 bytes). Computed in float32 (float64 stays "
    "float64).",
)
def kv_fp4_pack(x: torch.Tensor, kind: str) -> torch.Tensor:
    if kind not in KV_FP4_FORMATS:
        raise ValueError(f"unknown packed KV kind {kind!r}; expected one of {sorted(KV_FP4_FORMATS)}")
    return pack_kv_fp4(x, kind)


@op(
    "(rows: U8 [N, B], kind: str, dim: int) -> f32 [N, dim]",
    "The values of kv_fp4_pack's rows of that kind (codes times their group's scale), in float32.",
)
def kv_fp4_unpack(rows: torch.Tensor, kind: str, dim: int) -> torch.Tensor:
    if kind not in KV_FP4_FORMATS:
        raise ValueError(f"unknown packed KV kind {kind!r}; expected one of {sorted(KV_FP4_FORMATS)}")
    return unpack_kv_fp4(rows, kind, dim, torch.float32)


# --- DeepSeek's FP8 KV entry (quant.kv_fp8) -------------------------------------------------------


@op(
    "(kv: [N, D], rope_dim: int) -> U8 [N, B]",
    "DeepSeek's FP8 KV entry of each row: the first D - rope_dim values quantised per 64 (the last group "
    "may be partial) with s = 2^ceil(log2(max(amax, 1e-4) / 448)) (from float32; float64 stays float64), "
    "e4m3(x / s) round to nearest even; bytes [0, D-R) the E4M3 codes, then the rope_dim RoPE values in "
    "kv.dtype, then one byte per group, log2(s) + 127, then zeros to a multiple of 8 "
    "(D 512, R 64, bf16: 448 + 128 + 7 + 1 = 584 bytes).",
)
def kv_fp8_pack(kv: torch.Tensor, rope_dim: int) -> torch.Tensor:
    return pack_kv_fp8(kv, rope_dim)


def _decoded_rows(pool: torch.Tensor, indices: torch.Tensor, head_dim: int, rope_dim: int,
                  rope_dtype: torch.dtype, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(a dense pool, indices into it) holding the values of every row ``indices`` reads: the whole pool
    decoded when that is less work, else the read rows gathered and decoded one per slot."""
    if indices.numel() >= pool.shape[0]:
        return unpack_kv_fp8(pool, head_dim, rope_dim, rope_dtype, dtype), indices
    flat = indices.reshape(-1)
    rows = unpack_kv_fp8(pool[flat.clamp(min=0)], head_dim, rope_dim, rope_dtype, dtype)
    slots = torch.arange(flat.numel(), device=flat.device)
    return rows, torch.where(flat >= 0, slots, torch.full_like(slots, -1)).view_as(indices)


@op(
    "(q: [T, H, D], kv: U8 [N, B], indices: Long[T, K], sinks: [H], scale: float, rope_dim: int, "
    "rope_dtype: dtype, extra_kv: U8 [M, B] | None, extra_indices: Long[T, K2] | None) -> [T, H, D]",
    "sparse_attention over FP8 KV entries (kv_fp8_pack's layout, RoPE values in rope_dtype): each read "
    "row is first decoded to its values, E4M3 code * 2^(byte - 127) and the RoPE values, exactly, in "
    "q.dtype; -1 slots are never read.",
    batch_invariant=False,
)
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
    attention: Callable = sparse_attention,
) -> torch.Tensor:
    """``attention`` (a ``sparse_attention`` body) over the decoded rows: the same arithmetic as on a
    dense pool holding those values."""
    head_dim = q.shape[-1]
    rows, idx = _decoded_rows(kv, indices, head_dim, rope_dim, rope_dtype, q.dtype)
    extra_rows = extra_idx = None
    if extra_kv is not None and extra_indices is not None:
        extra_rows, extra_idx = _decoded_rows(extra_kv, extra_indices, head_dim, rope_dim, rope_dtype, q.dtype)
    return attention(q, rows, idx, sinks, scale, extra_rows, extra_idx)


# --- DeepSeek's quantised linears: power-of-two activation scales ----------------------------------


@op(
    "(x: [..., K], weight: E4M3 [N, K], weight_scale: f32 [ceil(N/128), ceil(K/128)]) -> [..., N]",
    "DeepSeek's fp8_gemm after act_quant(x, 128, 'ue8m0'): linear_fp8 with power-of-two activation scales, "
    "s_x = 2^ceil(log2(max(amax_g |x|, 1e-4) / 448)) per 128-channel group of a row (from its float32 "
    "values; float64 stays float64), q_x = e4m3(x / s_x) (round to nearest even, saturating); "
    "out = sum_g (q_x . q_w) * s_x * s_w accumulated in at least float32, returned in x.dtype.",
    batch_invariant=False,
)
def linear_fp8_ue8m0(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, *, linear: Callable = F.linear
) -> torch.Tensor:
    """Power-of-two quantised activations times the dequantised weight (both exact in float32)."""
    acc = acc_dtype(x.dtype)
    w = dequantize_fp8_block(weight, weight_scale, dtype=acc)
    return linear(fake_quant_act_ue8m0(x.to(acc)), w).to(x.dtype)


@op(
    "(x: [T, D], w13: [E, 2I, D], w2: [E, D, I], topk_ids: Long[T, k], topk_weights: [T, k], "
    "swiglu_limit: float) -> [T, D]",
    "Routed experts held in a float dtype under DeepSeek's numerics, where every expert is a quantised "
    "linear: moe_experts_fp4 with quant_act=True on these weights (x and the weighted SwiGLU output "
    "quantised per 128 channels to E4M3 with power-of-two scales before each projection).",
    batch_invariant=False,
    syncs_host=True,
)
def moe_experts_act_quant(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    swiglu_limit: float,
    *,
    linear: Callable = F.linear,
    swiglu: Callable = swiglu,
) -> torch.Tensor:
    """moe_experts_fp4's quant_act arithmetic on experts held in a float dtype."""
    return _experts_quant_act(x, lambda e, dt: w13[e].to(dt), lambda e, dt: w2[e].to(dt), w13.shape[0],
                              topk_ids, topk_weights, swiglu_limit, linear=linear, swiglu=swiglu)


@op(
    "(x: [T, D], w13: [E, 2I, D], w2: [E, D, I], topk_ids: Long[T, k], topk_weights: [T, k], "
    "swiglu_limit: float, block: int) -> [T, D]",
    "moe_experts_act_quant with the activations quantised per `block` channels instead of 128 "
    "(DeepSeek-V4.1: 32).",
    batch_invariant=False,
    syncs_host=True,
)
def moe_experts_quant_act(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    swiglu_limit: float,
    block: int,
    *,
    linear: Callable = F.linear,
    swiglu: Callable = swiglu,
) -> torch.Tensor:
    return _experts_quant_act(x, lambda e, dt: w13[e].to(dt), lambda e, dt: w2[e].to(dt), w13.shape[0],
                              topk_ids, topk_weights, swiglu_limit, linear=linear, swiglu=swiglu, block=block)


@op(
    "(x: [T, D], w13: U8 [E, 2I, D/2], w13_scale: E8M0|f32 [E, 2I, D/32], w2: U8 [E, D, I/2], "
    "w2_scale: E8M0|f32 [E, D, I/32], topk_ids: Long[T, k], topk_weights: [T, k], swiglu_limit: float, "
    "block: int) -> [T, D]",
    "moe_experts_fp4 with quant_act=True, the activations quantised per `block` channels instead of 128 "
    "(DeepSeek-V4.1: 32).",
    batch_invariant=False,
    syncs_host=True,
)
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
    *,
    linear: Callable = F.linear,
    swiglu: Callable = swiglu,
) -> torch.Tensor:
    return _experts_quant_act(x, fp4_expert(w13, w13_scale), fp4_expert(w2, w2_scale), w13.shape[0],
                              topk_ids, topk_weights, swiglu_limit, linear=linear, swiglu=swiglu, block=block)


# --- the tables read off the declarations, and their registration ----------------------------------

#: op -> its native body
NATIVE_OPS: dict[str, Callable] = {name: spec.native for name, spec in CATALOGUE.items()}

#: the native bodies that read values back to the host (the per-expert loops): no CUDA graph around them
SYNCS_HOST: frozenset[str] = frozenset(name for name, spec in CATALOGUE.items() if spec.syncs_host)


def register(registry: Any, priority: int, skip: Iterable[str] = ()) -> None:
    """Register every native body (but those in ``skip``) on ``registry`` at ``priority``, under the
    registering plugin's name, flagged ``syncs_host`` where it waits for the host. A backend calls this
    from its ``deepinfer_register_ops`` below the priorities of its own kernels."""
    skipped = set(skip)
    for name, spec in CATALOGUE.items():
        if name not in skipped:
            registry.register(name, spec.native, priority=priority, syncs_host=spec.syncs_host)

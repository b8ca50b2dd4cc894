"""Plain-torch implementations of every catalogued op, written to run well on a GPU.

They serve the ops where cuBLAS or a few fused torch kernels are already fast (linear, embedding, the
sampler ops, mHC, routing) and stand in for the Triton kernels where those cannot run (float64, no
Triton). Reductions accumulate in float32 (float64 stays float64); results come back in the input
dtype, as the catalogue says. Nothing here synchronises with the host except ``moe_experts``.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# --- dense layers ----------------------------------------------------------------------------------


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, weight)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    tokens, groups, k = x.shape
    w = weight.view(groups, -1, k)  # [G, N, K]
    out = torch.bmm(x.transpose(0, 1), w.transpose(1, 2))  # [G, T, N]
    return out.transpose(0, 1)


def swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    gate, up = gate_up.to(acc_dtype(gate_up.dtype)).chunk(2, dim=-1)
    return (F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)).to(gate_up.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = x.to(acc_dtype(x.dtype))
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(y.dtype)
    return y.to(x.dtype)


def rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    acc = acc_dtype(x.dtype)
    half = cos.shape[-1]
    rope = x[..., x.shape[-1] - 2 * half :].to(acc).unflatten(-1, (half, 2))
    even, odd = rope[..., 0], rope[..., 1]
    c = cos.to(acc).unsqueeze(-2)  # [T, 1, R/2]
    s = sin.to(acc).unsqueeze(-2)
    if inverse:
        s = -s
    rotated = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)
    out = x.clone()
    out[..., x.shape[-1] - 2 * half :] = rotated.to(x.dtype)
    return out


# --- attention -------------------------------------------------------------------------------------


def _gather(pool: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``pool[indices]`` (zero where the index is -1 or out of range; those rows are never read)."""
    valid = (indices >= 0) & (indices < pool.shape[0])
    rows = pool[torch.where(valid, indices, torch.zeros_like(indices))]
    zero = torch.zeros((), dtype=pool.dtype, device=pool.device)
    return torch.where(valid.unsqueeze(-1), rows, zero), valid


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
    qf = q.to(acc)
    segments = [(kv, indices)]
    if extra_kv is not None and extra_indices is not None and extra_indices.shape[-1] > 0:
        segments.append((extra_kv, extra_indices))
    # online softmax over the segments, the sink as the starting point of the running max and sum
    m = sinks.to(acc).view(1, -1).expand(q.shape[0], -1).clamp(min=-1e30)  # [T, H]
    denom = torch.exp(sinks.to(acc).view(1, -1) - m)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    for pool, idx in segments:
        keys, valid = _gather(pool, idx)
        keys = keys.to(acc)  # [T, K, D]
        logits = torch.einsum("thd,tkd->thk", qf, keys) * scale
        logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
        m_new = torch.maximum(m, logits.amax(-1))
        alpha = torch.exp(m - m_new)
        p = torch.exp(logits - m_new.unsqueeze(-1))
        denom = denom * alpha + p.sum(-1)
        out = out * alpha.unsqueeze(-1) + torch.einsum("thk,tkd->thd", p, keys)
        m = m_new
    return (out / denom.unsqueeze(-1)).to(q.dtype)


def compress_windows(kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    acc = acc_dtype(torch.promote_types(kv.dtype, gate.dtype))
    weights = torch.softmax(gate.to(acc), dim=1)
    return (kv.to(acc) * weights).sum(dim=1).to(kv.dtype)


def select_topk(
    scores: torch.Tensor, valid: torch.Tensor, candidates: torch.Tensor, topk: int
) -> torch.Tensor:
    """The candidate ids of the ``topk`` best scores, best first, ties towards the earlier candidate
    (a stable sort), invalid picks and missing slots as -1."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    k = min(topk, candidates.shape[-1])
    picked = order[:, :k]
    chosen = candidates.gather(1, picked)
    chosen = torch.where(valid.gather(1, picked), chosen, torch.full_like(chosen, -1))
    if k < topk:
        chosen = torch.cat([chosen, chosen.new_full((chosen.shape[0], topk - k), -1)], dim=1)
    return chosen


def indexer_scores(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, candidates: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    acc = acc_dtype(q.dtype)
    cand_keys, valid = _gather(keys, candidates)  # [T, C, d]
    dots = torch.einsum("thd,tcd->thc", q.to(acc), cand_keys.to(acc))
    scores = torch.einsum("thc,th->tc", torch.relu(dots), weights.to(acc)) * scale
    return scores.masked_fill(~valid, float("-inf")), valid


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    candidates: torch.Tensor,
    topk: int,
    scale: float,
) -> torch.Tensor:
    scores, valid = indexer_scores(q, weights, keys, candidates, scale)
    return select_topk(scores, valid, candidates, topk)


# --- manifold-constrained hyper-connections --------------------------------------------------------


def _mhc_mixes(streams: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    acc = acc_dtype(streams.dtype)
    flat = streams.flatten(1).to(acc)
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    return flat @ fn.to(acc).T


def hc_pre(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = streams.shape[1]
    acc = acc_dtype(streams.dtype)
    mixes = _mhc_mixes(streams, fn, norm_eps)
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.to(acc).split([n, n, n * n])
    s = scale.to(acc)
    pre = torch.sigmoid(pre_w * s[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * s[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * s[2] + comb_b.view(n, n), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    collapsed = torch.einsum("tn,tnd->td", pre, streams.to(acc)).to(streams.dtype)
    return post, comb, collapsed


def hc_post(
    block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    acc = acc_dtype(streams.dtype)
    mixed = torch.einsum("tjk,tjd->tkd", comb.to(acc), streams.to(acc))
    out = post.to(acc).unsqueeze(-1) * block_out.to(acc).unsqueeze(1) + mixed
    return out.to(streams.dtype)


def hc_head(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    hc_eps: float,
    norm_eps: float,
) -> torch.Tensor:
    acc = acc_dtype(streams.dtype)
    pre = torch.sigmoid(_mhc_mixes(streams, fn, norm_eps) * scale.to(acc) + base.to(acc)) + hc_eps
    return torch.einsum("tn,tnd->td", pre, streams.to(acc)).to(streams.dtype)


# --- mixture of experts ----------------------------------------------------------------------------

_SCORING = {
    "sqrtsoftplus": lambda x: F.softplus(x).sqrt(),
    "sigmoid": torch.sigmoid,
    "softmax": lambda x: torch.softmax(x, dim=-1),
}


def moe_route(
    logits: torch.Tensor,
    scoring_func: str,
    top_k: int,
    correction_bias: torch.Tensor | None,
    fixed_ids: torch.Tensor | None,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    if scoring_func not in _SCORING:
        raise ValueError(f"unknown scoring_func {scoring_func!r}; expected one of {sorted(_SCORING)}")
    scores = _SCORING[scoring_func](logits.to(acc_dtype(logits.dtype)))
    if fixed_ids is not None:
        ids = fixed_ids.long()
    else:
        choice = scores if correction_bias is None else scores + correction_bias.to(scores.dtype)
        # a stable sort: among equal scores the lower expert id wins, as the catalogue says
        ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = scores.gather(1, ids)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


def expert_pairs(topk_ids: torch.Tensor, num_experts: int) -> Iterator[tuple[int, torch.Tensor]]:
    """(expert, its flat ``token * k + slot`` pairs) for every expert with pairs, in expert order; ids
    outside ``[0, num_experts)`` get none. Reads the counts back to the host."""
    flat = topk_ids.reshape(-1)
    key = torch.where((flat >= 0) & (flat < num_experts), flat, torch.full_like(flat, num_experts))
    order = torch.sort(key, stable=True).indices
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts].tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count:
            yield expert, order[start : start + count]
            start += count


def moe_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    swiglu_limit: float,
) -> torch.Tensor:
    """Tokens sorted by expert, one GEMM pair per expert that has tokens (a host sync for the loop)."""
    acc = acc_dtype(x.dtype)
    tokens, k = topk_ids.shape
    out = torch.zeros((tokens * k, x.shape[-1]), dtype=acc, device=x.device)
    for expert, pairs in expert_pairs(topk_ids, w13.shape[0]):
        h = swiglu(F.linear(x[pairs // k], w13[expert]), swiglu_limit)
        y = F.linear(h, w2[expert]).to(acc)
        out[pairs] = y * topk_weights.reshape(-1)[pairs].to(acc).unsqueeze(-1)
    return out.view(tokens, k, -1).sum(dim=1).to(x.dtype)


moe_experts.syncs_host = True  # per-expert loop over counts read back: no CUDA graph around it


# --- sampling --------------------------------------------------------------------------------------


def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    seen = prompt_mask | (output_counts > 0)
    rep = repetition.to(logits.dtype).unsqueeze(1)
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    counts = output_counts.to(logits.dtype)
    logits = logits - frequency.to(logits.dtype).unsqueeze(1) * counts
    return logits - presence.to(logits.dtype).unsqueeze(1) * (counts > 0).to(logits.dtype)


def top_k_top_p_min_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    neg_inf = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
    vocab = logits.shape[-1]
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
    logits = torch.where(logits < kth, neg_inf, logits)
    probs = torch.softmax(logits.to(acc_dtype(logits.dtype)), dim=-1)
    sorted_probs = probs.gather(1, order)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # top_p >= 1 is off (a float32 cumsum over a large vocabulary reaches 1 early)
    drop_sorted = (mass_before >= top_p.to(probs.dtype).unsqueeze(1)) & (top_p < 1).unsqueeze(1)
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    # ties at the top_p boundary are kept: nothing as probable as the least probable kept token drops
    least_kept = probs.masked_fill(drop, float("inf")).amin(dim=-1, keepdim=True)
    drop = drop & (probs < least_kept)
    logits = torch.where(drop, neg_inf, logits)
    max_prob = probs.amax(dim=-1, keepdim=True)
    return torch.where(probs < min_p.to(probs.dtype).unsqueeze(1) * max_prob, neg_inf, logits)


def random_sample(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    return (probs / noise).argmax(dim=-1)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)
    if allowed.shape[-1] < vocab:
        allowed = F.pad(allowed, (0, vocab - allowed.shape[-1]), value=False)
    return logits.masked_fill(~allowed[:, :vocab], float("-inf"))


ALL_OPS = {
    "embedding": embedding,
    "rms_norm": rms_norm,
    "rotary_emb": rotary_emb,
    "linear": linear,
    "grouped_linear": grouped_linear,
    "swiglu": swiglu,
    "sparse_attention": sparse_attention,
    "compress_windows": compress_windows,
    "indexer_topk": indexer_topk,
    "hc_pre": hc_pre,
    "hc_post": hc_post,
    "hc_head": hc_head,
    "moe_route": moe_route,
    "moe_experts": moe_experts,
    "apply_penalties": apply_penalties,
    "top_k_top_p_min_p": top_k_top_p_min_p,
    "random_sample": random_sample,
    "apply_token_bitmask": apply_token_bitmask,
}

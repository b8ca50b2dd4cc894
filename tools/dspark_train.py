"""DSpark's drafter run on every position of a sequence at once, and its training losses
(``tools/train_tiny_v41.py``).

For a window of tokens ``t_0 .. t_{L-1}`` whose target forward gave ``main_hidden`` and logits, the block
after position ``p`` (``0 <= p <= L - 2 - k``, ``k`` the block size) is what model.py's ``forward_spec``
drafts at decode step ``p``: the tokens ``[t_{p+1}, noise x (k - 1)]`` at positions ``p + 1 .. p + k``,
attending, not causally, to the whole block and to the ring of ``wkv(main_x)`` at positions
``p - window + 1 .. p``; the stages' hyper-connections, MoE and head as in ``Block.forward`` /
``forward_head``. The Markov head is teacher-forced: position ``j`` adds ``head_m(embed_m(t_{p+1+j}))`` (at
decoding it is the token drafted before it, the same token whenever the prefix is accepted).

Losses per block position ``j`` (predicting ``t_{p+2+j}``), as the DSpark paper lists them: cross-entropy
on the data token, total variation ``TV_j`` between the draft's and the frozen target's distributions
(the target's logits at position ``p + 1 + j``), and binary cross-entropy of the confidence logit against
``1 - TV_j``: the probability that rejection sampling accepts position ``j`` once the ones before it are
accepted. The confidence head reads detached features: it is a probe of the drafter, not a second
objective for it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def rotate(x: torch.Tensor, freqs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """model.py's ``apply_rotary_emb`` on the last ``2 * freqs.shape[-1]`` values of ``x`` [..., d], with a
    rotation per row: ``freqs`` broadcasts against ``x``'s leading dims (complex [..., rd / 2])."""
    rd = 2 * freqs.shape[-1]
    head, tail = x[..., :-rd], x[..., -rd:]
    c = torch.view_as_complex(tail.float().unflatten(-1, (-1, 2)).contiguous())
    rotated = torch.view_as_real(c * (freqs.conj() if inverse else freqs)).flatten(-2).to(x.dtype)
    return torch.cat([head, rotated], dim=-1)


def attention(a: Any, h: torch.Tensor, main_x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``DSparkAttention`` for every block: ``h`` [B, P, k, D] the blocks' normed inputs, ``main_x`` [B, S, D],
    ``p`` [P] the position each block follows."""
    b, n, k, _ = h.shape
    win, hd, heads = a.window_size, a.head_dim, a.n_local_heads
    freqs = a.freqs_cis
    main_kv = rotate(a.kv_norm(a.wkv(main_x)), freqs[: main_x.shape[1]])  # [B, S, hd]
    ring = p.unsqueeze(1) - win + 1 + torch.arange(win)  # [P, win] positions p - win + 1 .. p
    ring_kv = main_kv[:, ring.clamp(min=0)]  # [B, P, win, hd]
    block_freqs = freqs[p.unsqueeze(1) + 1 + torch.arange(k)]  # [P, k, rd / 2]
    q = a.wq_b(a.q_norm(a.wq_a(h))).unflatten(-1, (heads, hd))
    q = rotate(q, block_freqs.unsqueeze(2))  # [B, P, k, H, hd]
    kv = rotate(a.kv_norm(a.wkv(h)), block_freqs)  # [B, P, k, hd]
    keys = torch.cat([ring_kv, kv], dim=2)  # [B, P, win + k, hd]
    logits = torch.einsum("bpkhd,bptd->bpkht", q, keys) * a.softmax_scale
    dead = torch.cat([ring < 0, torch.zeros(n, k, dtype=torch.bool)], dim=1)  # [P, win + k]
    logits = logits.masked_fill(dead.view(1, n, 1, 1, -1), float("-inf"))
    sink = a.attn_sink.view(1, 1, 1, -1, 1).expand(*logits.shape[:4], 1)
    probs = torch.cat([logits, sink], dim=-1).softmax(-1)[..., :-1]
    o = rotate(torch.einsum("bpkht,bptd->bpkhd", probs, keys), block_freqs.unsqueeze(2), inverse=True)
    o = o.reshape(b * n, k, a.n_local_groups, -1)
    o = torch.einsum("bsgd,grd->bsgr", o, a.wo_a.weight.view(a.n_local_groups, a.o_lora_rank, -1))
    return a.wo_b(o.flatten(2)).view(b, n, k, -1)


def draft_all(model: Any, ids: torch.Tensor, main_hidden: torch.Tensor, block: int, noise: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every block of the window ``ids`` [B, L] -> (logits [B, P, k, V] with the Markov biases of the data
    tokens, confidence logits [B, P, k], data targets [B, P, k]) for ``P = L - 1 - k`` blocks."""
    b, length = ids.shape
    k, n = block, length - 1 - block
    p = torch.arange(n)
    stages = model.mtp
    first, last = stages[0], stages[-1]
    main_x = first.main_norm(first.main_proj(main_hidden))
    block_ids = torch.full((b, n, k), noise, dtype=torch.long)
    block_ids[:, :, 0] = ids[:, 1 : n + 1]
    x = model.embed(block_ids).unsqueeze(3).repeat(1, 1, 1, model.hc_mult, 1)  # [B, P, k, hc, D]
    x = x.flatten(0, 1)  # the block functions take [batch, seq, hc, D]: blocks are the batch
    pre = torch.zeros(*x.shape[:3], dtype=torch.float32)
    pre[..., 0] = 1.0
    for stage in stages:
        residual = x
        attn_pre, post, comb = stage.hc_mixes(x, stage.hc_attn_fn, stage.hc_attn_scale, stage.hc_attn_base)
        h = stage.attn_norm(stage.hc_pre(x, pre))
        h = attention(stage.attn, h.view(b, n, k, -1), main_x, p).flatten(0, 1)
        x = stage.hc_post(h, residual, post, comb)
        residual = x
        ffn_pre, post, comb = stage.hc_mixes(x, stage.hc_ffn_fn, stage.hc_ffn_scale, stage.hc_ffn_base)
        h = stage.ffn(stage.ffn_norm(stage.hc_pre(x, attn_pre)))
        x, pre = stage.hc_post(h, residual, post, comb), ffn_pre
    hidden = last.hc_pre(x, pre)  # [B * P, k, D]
    logits = model.head(last.norm(hidden), full_logits=True)
    steps = torch.arange(k)
    previous = ids[:, (p.unsqueeze(1) + 1 + steps)]  # [B, P, k]: t_{p+1+j}
    bias, markov = last.markov_head(previous.flatten(0, 1))
    logits = (logits + bias).view(b, n, k, -1)
    confidence = last.confidence_head(hidden.detach(), markov.detach()).view(b, n, k)
    targets = ids[:, (p.unsqueeze(1) + 2 + steps)]
    return logits, confidence, targets


def losses(logits: torch.Tensor, confidence: torch.Tensor, targets: torch.Tensor, target_logits: torch.Tensor,
           block: int) -> dict[str, torch.Tensor]:
    """The three losses (means over blocks and positions) and per-position figures. ``target_logits``
    [B, L, V]: the frozen target's, position ``p + 1 + j`` predicting what block position ``j`` drafts."""
    b, n, k, v = logits.shape
    steps = torch.arange(k)
    rows = torch.arange(n).unsqueeze(1) + 1 + steps  # [P, k]
    target_probs = target_logits[:, rows].float().softmax(-1)  # [B, P, k, V]
    draft_log = logits.float().log_softmax(-1)
    ce = F.cross_entropy(draft_log.flatten(0, 2), targets.flatten(), reduction="none").view(b, n, k)
    tv = 0.5 * (draft_log.exp() - target_probs).abs().sum(-1)
    accept = (1 - tv).detach().clamp(0, 1)
    bce = F.binary_cross_entropy_with_logits(confidence, accept, reduction="none")
    greedy = (logits.argmax(-1) == target_probs.argmax(-1)).float()
    return {"ce": ce.mean(), "tv": tv.mean(), "bce": bce.mean(),
            "ce_per_position": ce.mean((0, 1)).detach(), "accept_per_position": accept.mean((0, 1)),
            "greedy_match_per_position": greedy.mean((0, 1)),
            "confidence_per_position": torch.sigmoid(confidence).mean((0, 1)).detach()}

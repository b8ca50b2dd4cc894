"""The output end of a DSpark drafter, shared by every architecture that carries one (V4.1, V4-Flash-0731):
the block's logits, the Markov head's sequential walk over them and the confidence head."""

from __future__ import annotations

from typing import Any

import torch


def dspark_head(target: Any, last: Any, hidden: torch.Tensor, token_ids: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``hidden`` [B, block, D]: the last stage's collapsed stream before the output norm; ``token_ids`` [B]:
    the token the block follows; ``last``: the last stage's weights (``norm``, ``markov_embed``,
    ``markov_head``, ``confidence``). Returns (ids [B, block + 1]: the given token then the greedy walk,
    logits [B, block, V] with each position's Markov bias from the token before it, confidence logits
    [B, block] over the hidden state and that token's Markov embedding)."""
    ops = target.ops
    b, k, d = hidden.shape
    logits = target.logits(ops.rms_norm(hidden.reshape(b * k, d), last.norm, target.cfg.rms_norm_eps))
    logits = logits.view(b, k, -1)
    acc = logits.dtype
    out, embeds = [token_ids], []
    for i in range(k):
        e = ops.embedding(out[-1], last.markov_embed)
        logits[:, i] += ops.linear(e.to(acc), last.markov_head.weight.to(acc))
        embeds.append(e)
        out.append(logits[:, i].argmax(dim=-1))
    features = torch.cat([hidden.to(acc), torch.stack(embeds, dim=1).to(acc)], dim=-1)
    confidence = ops.linear(features, last.confidence.weight.to(acc)).squeeze(-1)
    return torch.stack(out, dim=1), logits, confidence

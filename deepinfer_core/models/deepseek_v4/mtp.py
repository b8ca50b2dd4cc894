"""DeepSeek-V4's draft model: the checkpoint's multi-token-prediction layers (``mtp.{i}.*``).

The drafter owns its weights (the loader's :class:`~deepinfer_core.models.deepseek_v4.weights.MTPBlock`
records) and runs on the target's embedding, head, RoPE tables and ops, through the target's decoder
block and output norm.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from deepinfer_core.model.cache import ModelCache
from deepinfer_core.model.metadata import ForwardBatch
from deepinfer_core.models.deepseek_v4.weights import MoE, MTPBlock


class DeepseekV4MTP:
    """The MTP layers ``weights`` of ``target``; layer ``depth`` sits after the target's decoder layers
    (``num_hidden_layers + depth`` in the cache layout)."""

    def __init__(self, target: Any, weights: list[MTPBlock]):  # target: the DeepseekV4Model that owns it
        if not weights:
            raise ValueError("this checkpoint has no mtp.* weights")
        # a proxy: the target owns its drafter, so a strong reference back would make the pair (and every
        # weight) a cycle that only the cyclic garbage collector frees
        self.target, self.weights = weakref.proxy(target), weights

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: ModelCache, streams: torch.Tensor, next_ids: torch.Tensor,
                depth: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft logits for position t+2 from the main streams at t and token t+1 (``next_ids``).

        ``batch`` is the main model's batch (same positions and window blocks); the MTP block is plain
        sliding-window attention with its own window pool. Returns (draft logits of the
        ``logits_indices`` rows, the MTP block's output streams).
        """
        t = self.target
        ops, cfg, m = t.ops, t.cfg, self.weights[depth]
        eps = cfg.rms_norm_eps
        e = ops.rms_norm(ops.embedding(next_ids, t.weights.embed).to(t.dtype), m.enorm, eps)
        h = ops.rms_norm(streams, m.hnorm, eps)
        x = t.qlinear(e, m.e_proj).unsqueeze(1) + t.qlinear(h, m.h_proj)
        layer = cfg.num_hidden_layers + depth
        out = t.block(m.block, layer, x, batch, cache, t._rope(batch), next_ids, {})
        hidden = t.final_norm(out[batch.logits_indices], m.output)
        return t.logits(hidden), out

    def moe_layers(self, depth: int = 0) -> list[MoE]:
        """The MoE layers one draft step at ``depth`` runs (what an expert-parallel rank with nothing to
        draft runs with no tokens, so that its collectives meet its peers')."""
        return [self.weights[depth].block.moe]

    def dummy_step(self, depth: int = 0) -> None:
        """One draft step with no tokens: its MoE layers' dispatch and combine only."""
        from deepinfer_core.parallel.ep import dummy_moe

        for moe in self.moe_layers(depth):
            dummy_moe(self.target, moe)

"""DeepSeek-V4-Flash-0731's DSpark drafter: the checkpoint's ``mtp.{0..S-1}`` stages, which draft a block at once.

The same drafter as V4.1's (:mod:`deepinfer_core.models.deepseek_v41.dspark`) on the V4 architecture:

* every target step, each stage's window ring is seeded with ``wkv(main_x)`` of the step's tokens, where
  ``main_x = main_norm(main_proj(main_hidden))`` and ``main_hidden`` concatenates the stream mean of each
  target layer's **output** (V4.1 reads their attention inputs), what the target's forward returns;
* a draft after the current token ``p`` embeds ``[the next token, noise x (block - 1)]`` and runs the
  stages: window-only blocks whose attention reads the ring (positions up to ``p``) and every position of the
  block, not causally, RoPE at ``p + 1 ...``; each stage is a V4 block (every sublayer mixes its own mHC
  ``pre``, queries RMS-rescaled per head, entries stored as the cache stores window rows) with its own MoE;
* the last stage collapses the streams with its ``hc_head_*`` (as V4's MTP layer does) and normalises them;
  the shared head gives the block's logits; the Markov head walks the block left to right, adding
  ``head_m(embed_m(previous token))`` to each position's logits before it is taken (greedily); the confidence
  head maps ``[collapsed hidden before the norm, Markov embedding]`` to one logit per position, in float32.

The stages share the target's expert-parallel dispatcher (their expert count is the backbone's, 256).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from deepinfer_core.model.cache import ModelCache
from deepinfer_core.model.dspark_head import dspark_head
from deepinfer_core.model.metadata import ForwardBatch
from deepinfer_core.models.deepseek_v4.weights import Attention, DSparkStage, MoE


class DeepseekV4DSpark:
    """The DSpark stages ``stages`` of ``target`` (cache layers ``num_hidden_layers + j``)."""

    def __init__(self, target: Any, stages: list[DSparkStage]):  # target: the DeepseekV4Model that owns it
        if not stages:
            raise ValueError("this checkpoint has no DSpark stages (mtp.* weights)")
        last = stages[-1]
        heads = (last.hc_head, last.norm, last.markov_embed, last.markov_head, last.confidence)
        if stages[0].main_proj is None or any(x is None for x in heads):
            raise ValueError("the DSpark stages lack main_proj (first stage) or the output norm, Markov or "
                             "confidence head (last stage)")
        cfg = target.cfg
        # a proxy: the target owns its drafter; a strong reference back would make the pair a cycle
        self.target, self.weights = weakref.proxy(target), stages
        self.block_size = cfg.dspark_block_size
        self.noise_token_id = cfg.dspark_noise_token_id
        self.first_layer = cfg.num_hidden_layers
        self._num_experts, self.top_k = cfg.drafter_moe_config()

    def moe_layers(self, depth: int = 0) -> list[MoE]:
        """The MoE layers one draft runs (all stages at once)."""
        return [stage.block.moe for stage in self.weights]

    def moe(self, moe: MoE, h: torch.Tensor) -> torch.Tensor:
        """A stage's MoE: the stages' top-k, through the target's expert group."""
        t = self.target
        if t.ep is not None and self._num_experts != t.cfg.n_routed_experts:
            raise ValueError(f"the DSpark stages' {self._num_experts} experts cannot share the target's expert-"
                             f"parallel dispatcher over {t.cfg.n_routed_experts}")
        return t.moe(moe, h, None, top_k=self.top_k)

    @torch.inference_mode()
    def dummy_step(self, depth: int = 0) -> None:
        """One draft pass with no tokens: every stage's MoE collectives (expert parallel)."""
        from deepinfer_core.parallel.ep import dummy_moe

        for moe in self.moe_layers():
            dummy_moe(self.target, moe)

    # --- seeding: every target step ------------------------------------------------------------------

    def main_x(self, main_hidden: torch.Tensor) -> torch.Tensor:
        t, first = self.target, self.weights[0]
        return t.ops.rms_norm(t.qlinear(main_hidden, first.main_proj), first.main_norm, t.cfg.rms_norm_eps)

    @torch.inference_mode()
    def seed(self, main_hidden: torch.Tensor, batch: ForwardBatch, cache: ModelCache) -> None:
        """Write each stage's window rows for the step's tokens: ``wkv(main_x)``, normed and rotated at the
        tokens' positions, stored as the cache stores window entries."""
        t, eps = self.target, self.target.cfg.rms_norm_eps
        x = self.main_x(main_hidden)
        cos, sin = t.rope("main", batch.positions, t.dtype)
        for j, stage in enumerate(self.weights):
            a = stage.block.attn
            kv = t.ops.rms_norm(t.qlinear(x, a.wkv), a.kv_norm, eps)
            kv = t.ops.rotary_emb(kv.unsqueeze(1), cos, sin, False).squeeze(1)
            pool = cache.window_kv[self.first_layer + j]
            pool[batch.window_slots] = t.kv_entries(kv, cache, pool)

    # --- drafting ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def draft(self, token_ids: torch.Tensor, positions: torch.Tensor, window_rows: torch.Tensor,
              cache: ModelCache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One block per sequence after its current token: ``token_ids`` [B] the token at ``positions + 1``,
        ``positions`` [B] the current token's, ``window_rows`` [B, W] the window-pool rows of positions
        ``p - W + 1 .. p`` (-1: none). Returns (ids [B, block + 1]: the given token then the drafted ones,
        logits [B, block, V] with the Markov biases added, confidence logits [B, block] in float32)."""
        t, cfg = self.target, self.target.cfg
        ops, k, eps = t.ops, self.block_size, cfg.rms_norm_eps
        b, device = token_ids.shape[0], token_ids.device
        ids = torch.full((b, k), self.noise_token_id, dtype=torch.long, device=device)
        ids[:, 0] = token_ids
        x = ops.embedding(ids.reshape(-1), t.weights.embed).to(t.dtype)
        streams = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        cos, sin = t.rope("main", (positions.unsqueeze(1) + 1 + torch.arange(k, device=device)).reshape(-1), t.dtype)
        rows = window_rows.repeat_interleave(k, dim=0)
        block_rows = torch.arange(b, device=device).unsqueeze(1) * k + torch.arange(k, device=device)
        block_rows = block_rows.repeat_interleave(k, dim=0)  # every position of the block sees the whole block
        for j, stage in enumerate(self.weights):
            w = stage.block
            hc = w.attn_hc
            post, comb, collapsed = ops.hc_pre(streams, hc.fn, hc.base, hc.scale, cfg.hc_sinkhorn_iters, cfg.hc_eps,
                                               eps)
            h = ops.rms_norm(collapsed, w.attn_norm, eps)
            out = self.attention(w.attn, self.first_layer + j, h, cos, sin, rows, block_rows, cache)
            streams = ops.hc_post(out, streams, post, comb)
            hc = w.ffn_hc
            post, comb, collapsed = ops.hc_pre(streams, hc.fn, hc.base, hc.scale, cfg.hc_sinkhorn_iters, cfg.hc_eps,
                                               eps)
            h = ops.rms_norm(collapsed, w.ffn_norm, eps)
            streams = ops.hc_post(self.moe(w.moe, h), streams, post, comb)
        hc = self.weights[-1].hc_head
        hidden = ops.hc_head(streams, hc.fn, hc.base, hc.scale, cfg.hc_eps, eps)
        return self.head(hidden.view(b, k, -1), token_ids)

    def attention(self, a: Attention, layer: int, h, cos, sin, rows, block_rows, cache: ModelCache) -> torch.Tensor:
        """V4's attention over the ring rows ``rows`` and the block's own entries (``block_rows``)."""
        t, cfg, ops = self.target, self.target.cfg, self.target.ops
        n, eps = h.shape[0], cfg.rms_norm_eps
        q_res = ops.rms_norm(t.qlinear(h, a.wq_a), a.q_norm, eps)
        q = t.qlinear(q_res, a.wq_b).view(n, cfg.num_attention_heads, cfg.head_dim)
        q = ops.rotary_emb(ops.rms_norm(q, None, eps), cos, sin, False)
        kv = ops.rms_norm(t.qlinear(h, a.wkv), a.kv_norm, eps)
        kv = ops.rotary_emb(kv.unsqueeze(1), cos, sin, False).squeeze(1)
        pool = cache.window_kv[layer]
        block = t.kv_entries(kv, cache, pool)  # the block's entries as the pool would store them
        scale = cfg.head_dim**-0.5
        if cache.kv_spec.is_fp8:
            out = ops.sparse_attention_fp8(q, pool, rows, a.sinks, scale, cfg.rope_dim, cache.kv_spec.dtype, block,
                                           block_rows)
        else:
            out = ops.sparse_attention(q, pool, rows, a.sinks, scale, block, block_rows)
        out = ops.rotary_emb(out, cos, sin, True)
        out = ops.grouped_linear(out.reshape(n, cfg.o_groups, -1), a.wo_a)
        return t.qlinear(out.reshape(n, -1), a.wo_b)

    def head(self, hidden: torch.Tensor, token_ids: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The block's logits, the Markov walk (greedy) and the confidence logits (:func:`dspark_head`)."""
        return dspark_head(self.target, self.weights[-1], hidden, token_ids)

"""DeepSeek-V4.1's DSpark drafter: the checkpoint's ``mtp.{0,1,2}`` stages, which draft a whole block at once.

What the release's ``inference/model.py`` computes (``DSparkBlock``, ``DSparkAttention``, ``forward_spec``):

* every target step, each stage's window ring is seeded with ``wkv(main_x)`` of the step's tokens, where
  ``main_x = main_norm(main_proj(main_hidden))`` and ``main_hidden`` concatenates the stream mean of each
  ``dspark_target_layer_ids`` layer's input (what the target's forward returns);
* a draft of ``dspark_block_size`` positions after the current token ``p`` embeds ``[the next token,
  noise x (block - 1)]`` (the shared embedding, expanded to the mHC streams) and runs the stages: window-only
  blocks whose attention reads the ring (positions up to ``p``) and every position of the block, not
  causally, RoPE at ``p + 1 ...``; single-pass mHC chained across the stages; each stage's own MoE;
* the last stage's output norm and the shared head give the block's logits; the Markov head then walks the
  block left to right, adding ``head_m(embed_m(previous token))`` to each position's logits before it is
  sampled (greedily here); the confidence head maps ``[hidden before the norm, Markov embedding]`` to one
  logit per position, in float32.

Under expert parallel the stages' routed experts (their own count and top-k: ``drafter_moe_config``) are a
group of their own: sharded over the ranks by their own dispatcher (``ep``), their load counted by their
own recorder (``expert_load``) for EPLB, which rearranges them with the target's. Every rank runs one draft
pass over the stages each speculative step, one with nothing to draft with no tokens (:meth:`dummy_step`).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from deepinfer_core.model.cache import ModelCache
from deepinfer_core.model.dspark_head import dspark_head
from deepinfer_core.model.metadata import ForwardBatch
from deepinfer_core.models.deepseek_v41.weights import Attention, DrafterStage, MoE
from deepinfer_core.ops.native import acc_dtype


class DeepseekV41DSpark:
    """The DSpark stages ``stages`` of ``target`` (cache layers ``num_hidden_layers + j``)."""

    def __init__(self, target: Any, stages: list[DrafterStage]):  # target: the DeepseekV41Model that owns it
        if not stages:
            raise ValueError("this checkpoint has no DSpark stages (mtp.* weights)")
        cfg = target.cfg
        if stages[0].main_proj is None or stages[-1].markov_head is None or stages[-1].confidence is None:
            raise ValueError("the DSpark stages lack main_proj (first stage) or the Markov / confidence heads "
                             "(last stage)")
        # a proxy: the target owns its drafter; a strong reference back would make the pair a cycle
        self.target, self.weights = weakref.proxy(target), stages
        self.block_size = cfg.dspark_block_size
        self.noise_token_id = cfg.dspark_noise_token_id
        self.first_layer = cfg.num_hidden_layers
        self.num_experts, self.top_k = cfg.drafter_moe_config()

    #: expert parallel: the dispatcher over the stages' own experts (set by the worker; None: one process)
    ep = None
    #: the stages' expert load (EPLB's recorder over :meth:`moe_layers`), None where nothing counts it
    expert_load = None

    def moe_layers(self, depth: int = 0) -> list[MoE]:
        """The MoE layers one draft runs (all stages at once)."""
        return [stage.block.moe for stage in self.weights]

    def moe(self, moe: MoE, h: torch.Tensor) -> torch.Tensor:
        """A stage's MoE: the drafter's top-k, through its own expert group."""
        if self.target.ep is not None and self.ep is None:
            raise ValueError("the DSpark stages' experts have no expert-parallel dispatcher of their own")
        return self.target.moe(moe, h, top_k=self.top_k, group=self)

    @torch.inference_mode()
    def dummy_step(self, depth: int = 0) -> None:
        """One draft pass with no tokens: every stage's MoE collectives, in the order :meth:`draft` runs
        them (an expert-parallel rank with nothing to draft, so that its peers' collectives meet it)."""
        t = self.target
        for moe in self.moe_layers():
            self.moe(moe, torch.empty((0, t.cfg.hidden_size), dtype=t.dtype, device=t.device))

    # --- seeding: every target step ------------------------------------------------------------------

    def main_x(self, main_hidden: torch.Tensor) -> torch.Tensor:
        t, first = self.target, self.weights[0]
        return t.ops.rms_norm(t.qlinear(main_hidden, first.main_proj), first.main_norm, t.cfg.rms_norm_eps)

    @torch.inference_mode()
    def seed(self, main_hidden: torch.Tensor, batch: ForwardBatch, cache: ModelCache) -> None:
        """Write each stage's window rows for the step's tokens: ``wkv(main_x)``, normed and rotated at the
        tokens' positions, stored as the cache stores window entries."""
        t = self.target
        x = self.main_x(main_hidden)
        cos, sin = t.rope("main", batch.positions, t.dtype)
        for j, stage in enumerate(self.weights):
            a = stage.block.attn
            kv = t.ops.rms_norm(t.qlinear(x, a.wkv), a.kv_norm, t.cfg.rms_norm_eps)
            kv = t.ops.rotary_emb(kv.unsqueeze(1), cos, sin, False).squeeze(1)
            t.store(cache.window_kv[self.first_layer + j], batch.window_slots, kv, "window")

    # --- drafting ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def draft(self, token_ids: torch.Tensor, positions: torch.Tensor, window_rows: torch.Tensor,
              cache: ModelCache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One block per sequence after its current token: ``token_ids`` [B] the token at ``positions + 1``
        (the target's sample), ``positions`` [B] the current token's, ``window_rows`` [B, W] the window-pool
        rows of positions ``p - W + 1 .. p`` (-1: none; the rows the target's step attended from ``p``).
        Returns (ids [B, block + 1]: the given token then the drafted ones, logits [B, block, V] with the
        Markov biases added, confidence logits [B, block] in float32)."""
        t, cfg = self.target, self.target.cfg
        ops, k = t.ops, self.block_size
        b = token_ids.shape[0]
        device = token_ids.device
        ids = torch.full((b, k), self.noise_token_id, dtype=torch.long, device=device)
        ids[:, 0] = token_ids
        x = ops.embedding(ids.reshape(-1), t.weights.embed).to(t.dtype)
        streams = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        pre = torch.zeros(x.shape[0], cfg.hc_mult, dtype=acc_dtype(t.dtype), device=device)
        pre[:, 0] = 1.0
        cos, sin = t.rope("main", (positions.unsqueeze(1) + 1 + torch.arange(k, device=device)).reshape(-1), t.dtype)
        rows = window_rows.repeat_interleave(k, dim=0)
        block_rows = (torch.arange(b, device=device).unsqueeze(1) * k + torch.arange(k, device=device))
        block_rows = block_rows.repeat_interleave(k, dim=0)  # every position of the block sees the whole block
        for j, stage in enumerate(self.weights):
            w = stage.block
            attn_pre, post, comb = t.mixes(w.attn_hc, streams)
            h = ops.rms_norm(ops.hc_collapse(streams, pre), w.attn_norm, cfg.rms_norm_eps)
            out = self.attention(w.attn, self.first_layer + j, h, cos, sin, rows, block_rows, cache)
            streams = ops.hc_post(out, streams, post, comb)
            ffn_pre, post, comb = t.mixes(w.ffn_hc, streams)
            h = ops.rms_norm(ops.hc_collapse(streams, attn_pre), w.ffn_norm, cfg.rms_norm_eps)
            streams, pre = ops.hc_post(self.moe(w.moe, h), streams, post, comb), ffn_pre
        return self.head(ops.hc_collapse(streams, pre).view(b, k, -1), token_ids)

    def attention(self, a: Attention, layer: int, h, cos, sin, rows, block_rows, cache: ModelCache) -> torch.Tensor:
        t, cfg, ops = self.target, self.target.cfg, self.target.ops
        n = h.shape[0]
        q_res = ops.rms_norm(t.qlinear(h, a.wq_a), a.q_norm, cfg.rms_norm_eps)
        q = ops.rotary_emb(t.qlinear(q_res, a.wq_b).view(n, cfg.num_attention_heads, cfg.head_dim), cos, sin, False)
        kv = ops.rms_norm(t.qlinear(h, a.wkv), a.kv_norm, cfg.rms_norm_eps)
        kv = t.quant(ops.rotary_emb(kv.unsqueeze(1), cos, sin, False).squeeze(1), "window")
        window, window_idx = t.load(cache.window_kv[layer], rows, "window", cfg.head_dim)
        out = ops.sparse_attention(q, window, window_idx, a.sinks, cfg.head_dim**-0.5, kv, block_rows)
        out = ops.rotary_emb(out, cos, sin, True)
        out = ops.grouped_linear(out.reshape(n, cfg.o_groups, -1), a.wo_a)
        return t.qlinear(out.reshape(n, -1), a.wo_b)

    def head(self, hidden: torch.Tensor, token_ids: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The block's logits, the Markov walk (greedy) and the confidence logits (:func:`dspark_head`)."""
        return dspark_head(self.target, self.weights[-1], hidden, token_ids)

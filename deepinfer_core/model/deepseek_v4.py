"""DeepSeek-V4 forward built only from resolved ops, over a flat varlen batch and a paged cache."""

from __future__ import annotations

import torch

from deepinfer_core.config import ModelConfig
from deepinfer_core.model.cache import CompressorSpec, ModelCache, layer_cache_specs
from deepinfer_core.model.metadata import ForwardBatch
from deepinfer_core.ops import OpTable


class RotaryTables:
    """cos/sin of the "main" and "compress" RoPE, computed as transformers does (float32 angles)."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str):
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

        self.inv_freq, self.scaling = {}, {}
        for kind in ("main", "compress"):
            params = cfg.hf_config.rope_parameters[kind]
            rope_type = params.get("rope_type", "default")
            init = (
                DeepseekV4RotaryEmbedding.compute_default_rope_parameters
                if rope_type == "default"
                else ROPE_INIT_FUNCTIONS[rope_type]
            )
            inv_freq, scaling = init(cfg.hf_config, device, layer_type=kind)
            self.inv_freq[kind], self.scaling[kind] = inv_freq.float().to(device), float(scaling)

    def __call__(self, kind: str, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(-1) * self.inv_freq[kind]
        scale = self.scaling[kind]
        return (freqs.cos() * scale).to(dtype), (freqs.sin() * scale).to(dtype)


class DeepseekV4Model:
    """Holds the weights (DeepSeek names) and runs the forward through ``ops``."""

    def __init__(self, cfg: ModelConfig, params: dict[str, torch.Tensor], ops: OpTable, dtype: torch.dtype):
        self.cfg, self.p, self.ops, self.dtype = cfg, params, ops, dtype
        self.device = params["embed.weight"].device
        self.rope = RotaryTables(cfg, self.device)
        self.cache_specs = layer_cache_specs(cfg)
        self.has_mtp = any(k.startswith("mtp.") for k in params)

    def compressor_specs(self) -> set[CompressorSpec]:
        return {b for s in self.cache_specs for b in (s.compressor, s.indexer) if b is not None}

    # --- top level -------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: ModelCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (logits of ``batch.logits_indices`` rows, last layer's hyper-connection streams [T, n, D]).

        The streams are what the MTP module consumes.
        """
        ops, cfg = self.ops, self.cfg
        x = ops.embedding(batch.input_ids, self.p["embed.weight"]).to(self.dtype)
        streams = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        rope = self._rope(batch)
        for layer in range(cfg.num_hidden_layers):
            streams = self.block(f"layers.{layer}.", layer, streams, batch, cache, rope, batch.input_ids)
        hidden = self.final_norm(streams[batch.logits_indices], "")
        return self.logits(hidden), streams

    @torch.inference_mode()
    def mtp_forward(self, batch: ForwardBatch, cache: ModelCache, streams: torch.Tensor,
                    next_ids: torch.Tensor, depth: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft logits for position t+2 from the main streams at t and token t+1 (``next_ids``).

        ``batch`` is the main model's batch (same positions and window blocks); the MTP block is plain
        sliding-window attention with its own window pool. Returns (draft logits of the
        ``logits_indices`` rows, the MTP block's output streams).
        """
        if not self.has_mtp:
            raise ValueError("this checkpoint has no mtp.* weights")
        ops, p, cfg = self.ops, self.p, self.cfg
        m = f"mtp.{depth}."
        eps = cfg.rms_norm_eps
        e = ops.rms_norm(ops.embedding(next_ids, p["embed.weight"]).to(self.dtype), p[m + "enorm.weight"], eps)
        h = ops.rms_norm(streams, p[m + "hnorm.weight"], eps)
        x = self.linear(e, m + "e_proj.weight").unsqueeze(1) + self.linear(h, m + "h_proj.weight")
        layer = cfg.num_hidden_layers + depth
        out = self.block(m, layer, x, batch, cache, self._rope(batch), next_ids)
        hidden = self.final_norm(out[batch.logits_indices], m)
        return self.logits(hidden), out

    def _rope(self, batch: ForwardBatch) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {kind: self.rope(kind, batch.positions, self.dtype) for kind in ("main", "compress")}

    def final_norm(self, streams: torch.Tensor, prefix: str) -> torch.Tensor:
        p, cfg = self.p, self.cfg
        collapsed = self.ops.hc_head(
            streams, p[prefix + "hc_head_fn"], p[prefix + "hc_head_base"], p[prefix + "hc_head_scale"],
            cfg.hc_eps, cfg.rms_norm_eps,
        )
        return self.ops.rms_norm(collapsed, p[prefix + "norm.weight"], cfg.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.ops.linear(hidden, self.p["head.weight"])
        return logits if logits.dtype == torch.float64 else logits.float()

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """``x @ W.T`` for parameter ``name``; FP8 block-scaled when the weight was kept in FP8."""
        scale = self.p.get(name + "_scale")
        if scale is None:
            return self.ops.linear(x, self.p[name])
        return self.ops.linear_fp8(x, self.p[name], scale)

    # --- decoder block ---------------------------------------------------------------------------

    def block(self, prefix, layer, streams, batch, cache, rope, token_ids) -> torch.Tensor:
        ops, p, cfg = self.ops, self.p, self.cfg
        post, comb, collapsed = ops.hc_pre(
            streams, p[prefix + "hc_attn_fn"], p[prefix + "hc_attn_base"], p[prefix + "hc_attn_scale"],
            cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps,
        )
        h = ops.rms_norm(collapsed, p[prefix + "attn_norm.weight"], cfg.rms_norm_eps)
        streams = ops.hc_post(self.attention(prefix, layer, h, batch, cache, rope), streams, post, comb)
        post, comb, collapsed = ops.hc_pre(
            streams, p[prefix + "hc_ffn_fn"], p[prefix + "hc_ffn_base"], p[prefix + "hc_ffn_scale"],
            cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps,
        )
        h = ops.rms_norm(collapsed, p[prefix + "ffn_norm.weight"], cfg.rms_norm_eps)
        return ops.hc_post(self.moe(prefix + "ffn.", h, token_ids), streams, post, comb)

    # --- attention -------------------------------------------------------------------------------

    def attention(self, prefix, layer, h, batch: ForwardBatch, cache: ModelCache, rope) -> torch.Tensor:
        ops, p, cfg = self.ops, self.p, self.cfg
        a = prefix + "attn."
        eps, n_tok = cfg.rms_norm_eps, h.shape[0]
        spec = self.cache_specs[layer]
        cos, sin = rope["main" if spec.compressor is None else "compress"]

        q_res = ops.rms_norm(self.linear(h, a + "wq_a.weight"), p[a + "q_norm.weight"], eps)
        q = self.linear(q_res, a + "wq_b.weight").view(n_tok, cfg.num_attention_heads, cfg.head_dim)
        q = ops.rotary_emb(ops.rms_norm(q, None, eps), cos, sin, False)
        kv = ops.rms_norm(self.linear(h, a + "wkv.weight"), p[a + "norm.weight"], eps)
        kv = ops.rotary_emb(kv.unsqueeze(1), cos, sin, False).squeeze(1)
        window_pool = cache.window_kv[layer]
        window_pool[batch.window_slots] = kv.to(window_pool.dtype)

        extra_pool = extra_idx = None
        if spec.compressor is not None:
            meta = batch.compressors[spec.compressor.rate, spec.compressor.overlap]
            extra_pool = cache.comp_kv[layer]
            self.compress(a + "compressor.", h, spec.compressor, meta, extra_pool, cache.comp_state[layer],
                          cache.comp_boundary.get(layer))
            if spec.indexer is None:
                extra_idx = meta.candidates
            else:
                extra_idx = self.indexer(a + "indexer.", h, q_res, spec.indexer, batch, cache, layer, rope)

        out = ops.sparse_attention(
            q, window_pool, batch.window_indices, p[a + "attn_sink"], cfg.head_dim**-0.5, extra_pool, extra_idx
        )
        out = ops.rotary_emb(out, cos, sin, True)
        groups = cfg.o_groups
        out = ops.grouped_linear(out.reshape(n_tok, groups, -1), p[a + "wo_a.weight"])
        return self.linear(out.reshape(n_tok, -1), a + "wo_b.weight")

    def compress(self, c, h, spec: CompressorSpec, meta, pool, state, boundary) -> None:
        """Project this step's tokens, emit the entries of every window that closed, update the ring.

        With overlapping windows it also saves, for every block end crossed, the first-half features of
        the window before it into that block's boundary record (what a prefix-cache hit restores).
        """
        ops, p = self.ops, self.p
        ring_kv, ring_gate = state
        kv = self.linear(h, c + "wkv.weight").to(ring_kv.dtype)
        gate = self.linear(h, c + "wgate.weight").to(ring_kv.dtype) + p[c + "ape"][meta.bias_idx].to(ring_kv.dtype)
        dim = spec.dim
        if meta.entry_slots.numel() or meta.boundary_dst.numel():
            pad_kv = kv.new_zeros((1, kv.shape[1]))
            pad_gate = gate.new_full((1, gate.shape[1]), float("-inf"))
            src_kv = torch.cat([ring_kv[meta.ring_read], kv, pad_kv])
            src_gate = torch.cat([ring_gate[meta.ring_read], gate, pad_gate])
        if boundary is not None and meta.boundary_dst.numel():
            rows = (meta.boundary_dst.unsqueeze(1) * spec.rate + torch.arange(spec.rate, device=kv.device)).flatten()
            boundary[0][rows] = src_kv[meta.boundary_src.flatten()][:, :dim]
            boundary[1][rows] = src_gate[meta.boundary_src.flatten()][:, :dim]
        if meta.entry_slots.numel():
            if spec.overlap:
                win_kv = torch.cat([src_kv[meta.prev_idx][..., :dim], src_kv[meta.cur_idx][..., dim:]], dim=1)
                win_gate = torch.cat([src_gate[meta.prev_idx][..., :dim], src_gate[meta.cur_idx][..., dim:]], dim=1)
            else:
                win_kv, win_gate = src_kv[meta.cur_idx], src_gate[meta.cur_idx]
            entries = ops.compress_windows(win_kv.to(self.dtype), win_gate)
            entries = ops.rms_norm(entries, p[c + "norm.weight"], self.cfg.rms_norm_eps)
            cos, sin = self.rope("compress", meta.entry_positions, self.dtype)
            entries = ops.rotary_emb(entries.unsqueeze(1), cos, sin, False).squeeze(1)
            pool[meta.entry_slots] = entries.to(pool.dtype)  # slot -1: the trash block
        ring_kv[meta.ring_write] = kv[meta.ring_write_src]
        ring_gate[meta.ring_write] = gate[meta.ring_write_src]

    def indexer(self, i, h, q_res, spec: CompressorSpec, batch, cache: ModelCache, layer, rope) -> torch.Tensor:
        ops, cfg = self.ops, self.cfg
        meta = batch.compressors[spec.rate, spec.overlap]
        keys = cache.index_keys[layer]
        self.compress(i + "compressor.", h, spec, meta, keys, cache.index_state[layer], cache.index_boundary.get(layer))
        cos, sin = rope["compress"]
        q = self.linear(q_res, i + "wq_b.weight").view(h.shape[0], cfg.index_n_heads, cfg.index_head_dim)
        q = ops.rotary_emb(q, cos, sin, False)
        weights = self.linear(h, i + "weights_proj.weight") * cfg.index_n_heads**-0.5
        return ops.indexer_topk(q, weights, keys, meta.candidates, cfg.index_topk, cfg.index_head_dim**-0.5)

    # --- MoE -------------------------------------------------------------------------------------

    def moe(self, f, h, token_ids) -> torch.Tensor:
        ops, p, cfg = self.ops, self.p, self.cfg
        logits = self.linear(h, f + "gate.weight")
        tid2eid = p.get(f + "gate.tid2eid")
        fixed = tid2eid[token_ids] if tid2eid is not None else None
        weights, ids = ops.moe_route(
            logits, cfg.scoring_func, cfg.num_experts_per_tok, p.get(f + "gate.bias"), fixed,
            cfg.routed_scaling_factor,
        )
        w13, w2 = p[f + "experts.w13"], p[f + "experts.w2"]
        if f + "experts.w13_scale" in p:
            routed = ops.moe_experts_fp8(h, w13, p[f + "experts.w13_scale"], w2, p[f + "experts.w2_scale"], ids,
                                         weights, cfg.swiglu_limit)
        else:
            routed = ops.moe_experts(h, w13, w2, ids, weights, cfg.swiglu_limit)
        shared = ops.swiglu(self.linear(h, f + "shared_experts.w13"), cfg.swiglu_limit)
        return routed + self.linear(shared, f + "shared_experts.w2.weight")

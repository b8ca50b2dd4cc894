"""DeepSeek-V4 forward built only from resolved ops, over a flat varlen batch and a paged cache."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from types import MappingProxyType

import torch

from deepinfer_core.config import ModelConfig
from deepinfer_core.model.cache import CompressorSpec, ModelCache
from deepinfer_core.model.cache_layout import cache_layout
from deepinfer_core.model.metadata import ForwardBatch, compressed_candidates
from deepinfer_core.models.deepseek_v4.dspark import DeepseekV4DSpark
from deepinfer_core.models.deepseek_v4.mtp import DeepseekV4MTP
from deepinfer_core.models.deepseek_v4.weights import (
    Attention,
    Block,
    Compressor,
    Experts,
    Indexer,
    Linear,
    ModelWeights,
    MoE,
    OutputNorm,
    records,
)
from deepinfer_core.ops import OpTable

#: ops every forward calls, whatever its weights
_ALWAYS_USED = frozenset({"embedding", "rms_norm", "rotary_emb", "grouped_linear", "swiglu", "sparse_attention",
                          "hc_pre", "hc_post", "hc_head", "moe_route"})


#: "transformers": transformers' DeepseekV4 arithmetic; "deepseek": DeepSeek's inference/model.py, whose
#: activations are quantised (E4M3, power-of-two scales per 128) before its FP8 and FP4 linears
NUMERICS = ("transformers", "deepseek")


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
    """Runs the forward over ``weights`` (the loader's typed records) through ``ops``."""

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, ops: OpTable, dtype: torch.dtype,
                 numerics: str = "transformers"):
        if numerics not in NUMERICS:
            raise ValueError(f"unknown numerics {numerics!r}; expected one of {NUMERICS}")
        self.cfg, self.weights, self.ops, self.dtype, self.numerics = cfg, weights, ops, dtype, numerics
        self.device = weights.device
        self.rope = RotaryTables(cfg, self.device)
        self.cache_layout = cache_layout(cfg)
        self.cache_specs = self.cache_layout.layers
        #: the checkpoint's draft model (its mtp.* layers: one MTP layer, or V4-Flash-0731's DSpark stages),
        #: None where it has none
        drafter = cfg.architecture.drafters.get("dspark" if cfg.dspark_block_size else "mtp")
        self.drafter: DeepseekV4MTP | DeepseekV4DSpark | None = (
            drafter(self, weights.mtp) if weights.mtp and drafter else None)
        #: the layers whose outputs a DSpark drafter reads (what :meth:`forward` then returns), none for MTP
        self.dspark_targets = frozenset(cfg.dspark_target_layer_ids) if isinstance(
            self.drafter, DeepseekV4DSpark) else frozenset()

    @property
    def has_mtp(self) -> bool:
        return isinstance(self.drafter, DeepseekV4MTP)

    @property
    def dspark(self) -> DeepseekV4DSpark | None:
        """The DSpark drafter (V4-Flash-0731), None for an MTP checkpoint or one without drafter weights."""
        return self.drafter if isinstance(self.drafter, DeepseekV4DSpark) else None

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint name, tensor) of every weight; FP8 scales as ``name + "_scale"``."""
        return self.weights.named_parameters()

    @property
    def p(self) -> Mapping[str, torch.Tensor]:
        """Checkpoint name -> tensor, a read-only snapshot for tools and tests; the forward never reads it."""
        return MappingProxyType(dict(self.named_parameters()))

    def compressor_specs(self) -> set[CompressorSpec]:
        return self.cache_layout.branch_specs()

    def ops_in_use(self, mtp: bool = True, kv_fp8: bool | None = None) -> set[str]:
        """Names of the ops :meth:`forward` calls with these weights (with ``mtp``, the drafter's too)
        over a cache whose entries are FP8 (``kv_fp8``; None: the default layout of these numerics): the
        ``*_fp8`` ops only where weights are FP8, compression and indexing only where layers have them.
        The sampler's ops are not the model's."""
        w = self.weights
        roots = [w.head, w.output, *w.layers, *(self.drafter.weights if mtp and self.drafter else [])]
        used = set(_ALWAYS_USED) | ({"act_quant_sim"} if self.numerics == "deepseek" else set())
        if kv_fp8 is None:
            kv_fp8 = self.numerics == "deepseek"
        if kv_fp8:
            used = used - {"sparse_attention"} | {"kv_fp8_pack", "sparse_attention_fp8"}
        for r in records(roots, leaves=(Experts,)):
            if isinstance(r, Linear):
                fp8 = "linear_fp8_ue8m0" if self.numerics == "deepseek" else "linear_fp8"
                used.add(fp8 if r.is_fp8 else "linear")
            elif isinstance(r, Experts):
                plain = "moe_experts_act_quant" if self.numerics == "deepseek" else "moe_experts"
                used.add({"fp8": "moe_experts_fp8", "fp4": "moe_experts_fp4"}.get(r.w13.format, plain))
            elif isinstance(r, Compressor):
                used.add("compress_windows")
            elif isinstance(r, Indexer):
                used.add("indexer_topk")
        return used

    # --- top level -------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: ModelCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (logits of ``batch.logits_indices`` rows, what the drafter reads): the last layer's
        hyper-connection streams [T, n, D] (the MTP module's input), or with a DSpark drafter the mean over
        the streams of each target layer's output, concatenated [T, targets * D]."""
        ops, cfg, w = self.ops, self.cfg, self.weights
        x = ops.embedding(batch.input_ids, w.embed).to(self.dtype)
        streams = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        rope, candidates, targets = self._rope(batch), {}, []
        for layer, block in enumerate(w.layers):
            streams = self.block(block, layer, streams, batch, cache, rope, batch.input_ids, candidates)
            if layer in self.dspark_targets:  # 0731's drafter reads a target layer's output
                targets.append(streams.mean(dim=1))
        hidden = self.final_norm(streams[batch.logits_indices], w.output)
        return self.logits(hidden), torch.cat(targets, dim=-1) if targets else streams

    def mtp_forward(self, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`DeepseekV4MTP.forward` of :attr:`drafter`; a checkpoint without one refuses."""
        if self.drafter is None:
            raise ValueError("this checkpoint has no mtp.* weights")
        return self.drafter.forward(*args, **kwargs)

    def _rope(self, batch: ForwardBatch) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {kind: self.rope(kind, batch.positions, self.dtype) for kind in ("main", "compress")}

    def final_norm(self, streams: torch.Tensor, out: OutputNorm) -> torch.Tensor:
        cfg = self.cfg
        collapsed = self.ops.hc_head(streams, out.hc.fn, out.hc.base, out.hc.scale, cfg.hc_eps, cfg.rms_norm_eps)
        return self.ops.rms_norm(collapsed, out.norm, cfg.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.linear(hidden, self.weights.head)
        return logits if logits.dtype == torch.float64 else logits.float()

    def linear(self, x: torch.Tensor, lin: Linear) -> torch.Tensor:
        """``x @ W.T``; FP8 block-scaled when the weight was kept in FP8."""
        if lin.scale is None:
            return self.ops.linear(x, lin.weight)
        return self.ops.linear_fp8(x, lin.weight, lin.scale)

    def qlinear(self, x: torch.Tensor, lin: Linear) -> torch.Tensor:
        """A projection that is FP8 in DeepSeek's model: under ``numerics="deepseek"`` its input is first
        quantised as DeepSeek's ``act_quant`` does (E4M3, power-of-two scales per 128 values), by
        ``linear_fp8_ue8m0`` itself where the weight was kept in FP8."""
        if self.numerics != "deepseek":
            return self.linear(x, lin)
        if lin.scale is not None:
            return self.ops.linear_fp8_ue8m0(x, lin.weight, lin.scale)
        return self.linear(self.ops.act_quant_sim(x, 128, "e4m3", False), lin)

    def kv_sim(self, kv: torch.Tensor, rotate: bool = False) -> torch.Tensor:
        """``numerics="deepseek"``: a KV entry as DeepSeek stores it, its non-RoPE values FP8-simulated per
        64 with power-of-two scales (the RoPE values kept); an indexer key or query (``rotate``) Hadamard-
        rotated and FP4-simulated per 32. Otherwise ``kv`` unchanged."""
        if self.numerics != "deepseek":
            return kv
        if rotate:
            return self.ops.act_quant_sim(kv, 32, "e2m1", True)
        nope = kv.shape[-1] - self.cfg.rope_dim
        return torch.cat([self.ops.act_quant_sim(kv[..., :nope], 64, "e4m3", False), kv[..., nope:]], dim=-1)

    # --- decoder block ---------------------------------------------------------------------------

    def block(self, w: Block, layer, streams, batch, cache, rope, token_ids, candidates) -> torch.Tensor:
        ops, cfg = self.ops, self.cfg
        hc = w.attn_hc
        post, comb, collapsed = ops.hc_pre(streams, hc.fn, hc.base, hc.scale, cfg.hc_sinkhorn_iters, cfg.hc_eps,
                                           cfg.rms_norm_eps)
        h = ops.rms_norm(collapsed, w.attn_norm, cfg.rms_norm_eps)
        attn = self.attention(w.attn, layer, h, batch, cache, rope, candidates)
        streams = ops.hc_post(attn, streams, post, comb)
        hc = w.ffn_hc
        post, comb, collapsed = ops.hc_pre(streams, hc.fn, hc.base, hc.scale, cfg.hc_sinkhorn_iters, cfg.hc_eps,
                                           cfg.rms_norm_eps)
        h = ops.rms_norm(collapsed, w.ffn_norm, cfg.rms_norm_eps)
        return ops.hc_post(self.moe(w.moe, h, token_ids), streams, post, comb)

    # --- attention -------------------------------------------------------------------------------

    def attention(self, a: Attention, layer, h, batch: ForwardBatch, cache: ModelCache, rope,
                  candidates: dict[int, torch.Tensor]) -> torch.Tensor:
        """``candidates``: rate -> the step's compressed candidates (:func:`compressed_candidates`), derived
        on the device by the first layer of that rate and shared by the rest of the forward."""
        ops, cfg = self.ops, self.cfg
        eps, n_tok = cfg.rms_norm_eps, h.shape[0]
        spec = self.cache_specs[layer]
        cos, sin = rope["main" if spec.compressor is None else "compress"]

        q_res = ops.rms_norm(self.qlinear(h, a.wq_a), a.q_norm, eps)
        q = self.qlinear(q_res, a.wq_b).view(n_tok, cfg.num_attention_heads, cfg.head_dim)
        q = ops.rotary_emb(ops.rms_norm(q, None, eps), cos, sin, False)
        kv = ops.rms_norm(self.qlinear(h, a.wkv), a.kv_norm, eps)
        kv = ops.rotary_emb(kv.unsqueeze(1), cos, sin, False).squeeze(1)
        window_pool = cache.window_kv[layer]
        window_pool[batch.window_slots] = self.kv_entries(kv, cache, window_pool)

        extra_pool = extra_idx = None
        if spec.compressor is not None:
            rate = spec.compressor.rate
            meta = batch.compressors[rate, spec.compressor.overlap]
            extra_pool = cache.comp_kv[layer]
            self.compress(a.compressor, h, spec.compressor, meta, extra_pool, cache.comp_state[layer],
                          cache.comp_boundary.get(layer), cache=cache)
            if rate not in candidates:
                candidates[rate] = compressed_candidates(batch, rate, cache.block_size)
            if spec.indexer is None:
                extra_idx = candidates[rate]
            else:
                extra_idx = self.indexer(a.indexer, h, q_res, spec.indexer, batch, cache, layer, rope,
                                         candidates[rate])

        scale = cfg.head_dim**-0.5
        if cache.kv_spec.is_fp8:
            out = ops.sparse_attention_fp8(q, window_pool, batch.window_rows(), a.sinks, scale, cfg.rope_dim,
                                           cache.kv_spec.dtype, extra_pool, extra_idx)
        else:
            out = ops.sparse_attention(q, window_pool, batch.window_rows(), a.sinks, scale, extra_pool, extra_idx)
        out = ops.rotary_emb(out, cos, sin, True)
        groups = cfg.o_groups
        out = ops.grouped_linear(out.reshape(n_tok, groups, -1), a.wo_a)
        return self.qlinear(out.reshape(n_tok, -1), a.wo_b)

    def kv_entries(self, kv: torch.Tensor, cache: ModelCache, pool: torch.Tensor) -> torch.Tensor:
        """The rows a window or compressed pool stores for ``kv`` [N, head_dim]: DeepSeek's FP8 entries
        where the cache has that layout (:mod:`~deepinfer_core.quant.kv_fp8`), else the values
        (:meth:`kv_sim`'d) in the pool's dtype."""
        if pool.dtype == torch.uint8:
            return self.ops.kv_fp8_pack(kv.to(cache.kv_spec.dtype), self.cfg.rope_dim)
        return self.kv_sim(kv).to(pool.dtype)

    def compress(self, c: Compressor, h, spec: CompressorSpec, meta, pool, state, boundary,
                 rotate: bool = False, cache: ModelCache | None = None) -> None:
        """Project this step's tokens, emit the entries of every window that closed, update the ring
        (``rotate``: the indexer's keys, see :meth:`kv_sim`).

        With overlapping windows it also saves, for every block end crossed, the first-half features of
        the window before it into that block's boundary record (what a prefix-cache hit restores).
        """
        ops = self.ops
        ring_kv, ring_gate = state
        kv = self.linear(h, c.wkv).to(ring_kv.dtype)
        gate = self.linear(h, c.wgate).to(ring_kv.dtype) + c.ape[meta.bias_idx].to(ring_kv.dtype)
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
            entries = ops.rms_norm(entries, c.norm, self.cfg.rms_norm_eps)
            cos, sin = self.rope("compress", meta.entry_positions, self.dtype)
            entries = ops.rotary_emb(entries.unsqueeze(1), cos, sin, False).squeeze(1)
            if rotate:
                entries = self.kv_sim(entries, rotate).to(pool.dtype)
            else:
                entries = self.kv_entries(entries, cache, pool)
            pool[meta.entry_slots] = entries  # slot -1: the trash block
        ring_kv[meta.ring_write] = kv[meta.ring_write_src]
        ring_gate[meta.ring_write] = gate[meta.ring_write_src]

    def indexer(self, ix: Indexer, h, q_res, spec: CompressorSpec, batch, cache: ModelCache, layer,
                rope, candidates: torch.Tensor) -> torch.Tensor:
        ops, cfg = self.ops, self.cfg
        meta = batch.compressors[spec.rate, spec.overlap]
        keys = cache.index_keys[layer]
        self.compress(ix.compressor, h, spec, meta, keys, cache.index_state[layer], cache.index_boundary.get(layer),
                      rotate=True)
        cos, sin = rope["compress"]
        q = self.qlinear(q_res, ix.wq_b).view(h.shape[0], cfg.index_n_heads, cfg.index_head_dim)
        q = self.kv_sim(ops.rotary_emb(q, cos, sin, False), rotate=True)
        weights = self.linear(h, ix.weights_proj) * cfg.index_n_heads**-0.5
        return ops.indexer_topk(q, weights, keys, candidates, cfg.index_topk, cfg.index_head_dim**-0.5)

    # --- MoE -------------------------------------------------------------------------------------

    #: expert parallel: this rank's dispatcher (its stacks then hold only its own experts); None: all local
    ep = None
    #: per-layer counts of the pairs routed to each expert (EPLB statistics), None: not counted
    expert_load = None

    def moe(self, moe: MoE, h, token_ids, top_k: int | None = None) -> torch.Tensor:
        """Routed experts plus the shared expert; ``top_k``: experts per token (default: the target's)."""
        ops, cfg, gate, ex = self.ops, self.cfg, moe.gate, moe.experts
        logits = self.linear(h, gate.weight)
        fixed = gate.tid2eid[token_ids] if gate.tid2eid is not None else None
        weights, ids = ops.moe_route(
            logits, cfg.scoring_func, top_k or cfg.num_experts_per_tok, gate.bias, fixed, cfg.routed_scaling_factor,
        )
        if self.expert_load is not None:
            self.expert_load.record(moe, ids)
        x = h
        if self.ep is not None:  # each (token, expert) pair goes to the expert's rank, one row per pair
            x, ids, weights, handle = self.ep.dispatch(h, ids, weights)
            ids, weights = ids.unsqueeze(1), weights.unsqueeze(1)
        if ex.is_fp8:
            routed = ops.moe_experts_fp8(x, ex.w13.weight, ex.w13.scale, ex.w2.weight, ex.w2.scale, ids, weights,
                                         cfg.swiglu_limit)
        elif ex.is_fp4:
            routed = ops.moe_experts_fp4(x, ex.w13.weight, ex.w13.scale, ex.w2.weight, ex.w2.scale, ids, weights,
                                         cfg.swiglu_limit, self.numerics == "deepseek")
        elif self.numerics == "deepseek":  # every routed expert is a quantised linear in DeepSeek's model
            routed = ops.moe_experts_act_quant(x, ex.w13.weight, ex.w2.weight, ids, weights, cfg.swiglu_limit)
        else:
            routed = ops.moe_experts(x, ex.w13.weight, ex.w2.weight, ids, weights, cfg.swiglu_limit)
        if self.ep is not None:
            routed = self.ep.combine(routed, handle)
        shared = ops.swiglu(self.qlinear(h, moe.shared.w13), cfg.swiglu_limit)
        return routed + self.qlinear(shared, moe.shared.w2)

"""DeepSeek-V4.1 forward built only from resolved ops, over a flat varlen batch and a paged cache.

What differs from V4 (DeepSeek's ``inference/model.py``, README §3 of the release's reference folder):

* only KV-source layers compress (ratio 2: softmax-gated pooling in float32, no position bias, no
  overlap; ratio 1: ``norm(wkv(x))``), rotating the latent after compression at position ``j * ratio``;
  every other layer with ratio > 0 reads its source's pool;
* index keys are ``k_norm(wk(latent))`` of the source's latent; index sources score their own queries,
  the candidate source keeps the best ``candidate_topk_blocks`` blocks (newest pinned), later index
  sources rank only inside them, and the other layers reuse the top-k of the index source below;
* Q is not RMS-rescaled per head; single-pass mHC: each sublayer's ``pre`` collapses the streams for the
  next sublayer (block 0's attention takes stream 0), and the final collapse uses the last FFN's;
* the head runs in float32; no hash routing; Engram before its blocks.

``numerics="deepseek"`` adds the reference's quantisation steps: activations E4M3 per 32 with
power-of-two scales before every FP8 linear (routed experts included), window KV E4M3 per 32 over all
512 values, compressed KV FP4 per 16 with E4M3 scales, index keys and queries FP4 per 32 with E8M0
scales. ``"unquantised"`` leaves them out (the reference with its quantisation steps off).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from types import MappingProxyType
from typing import Any

import torch

from deepinfer_core.model.cache import ModelCache
from deepinfer_core.model.cache_layout import BranchSpec, cache_layout
from deepinfer_core.model.metadata import DEAD, ForwardBatch, compressed_candidates
from deepinfer_core.model.replay import LateBatch, late_batch
from deepinfer_core.models.deepseek_v4.weights import HyperConnection
from deepinfer_core.models.deepseek_v41.config import DeepseekV41Config
from deepinfer_core.models.deepseek_v41.dspark import DeepseekV41DSpark
from deepinfer_core.models.deepseek_v41.image_processor import ImageSpan, VisionConfig
from deepinfer_core.models.deepseek_v41.replay import replay_layers
from deepinfer_core.models.deepseek_v41.vision import VisionTower
from deepinfer_core.models.deepseek_v41.weights import Attention, Block, Compressor, Engram, ModelWeights, MoE
from deepinfer_core.ops import OpTable
from deepinfer_core.ops.native import acc_dtype, select_topk
from deepinfer_core.parallel.ep import dummy_moe
from deepinfer_core.platform import SideStream

NUMERICS = ("deepseek", "unquantised")
#: activations and window KV: E4M3 per this many values; index keys/queries FP4 per this many
ACT_BLOCK = 32
#: compressed KV: FP4 per this many values, E4M3 scales
COMPRESSED_BLOCK = 16


def inv_freq(rope_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    """RoPE frequencies as ``inference/model.py`` computes them: ``base^(-2i/d)``, with YaRN where
    ``scaling`` is given (wavelengths beyond the training context divided by ``factor``, a linear ramp
    between ``beta_fast`` and ``beta_slow`` rotations); no attention-scale factor."""
    freqs = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if not scaling:
        return freqs
    original = scaling["original_max_position_embeddings"]

    def corrected_dim(rotations: float) -> float:
        return rope_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corrected_dim(scaling["beta_fast"])), 0)
    high = min(math.ceil(corrected_dim(scaling["beta_slow"])), rope_dim - 1)
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    smooth = 1 - ramp
    return freqs / scaling["factor"] * (1 - smooth) + freqs * smooth


class RotaryTables:
    """cos/sin (float32 angles) of the window-only layers' RoPE (``"main"``: ``rope_theta``, no YaRN) and
    of every layer with compressed KV (``"compress"``: ``compress_rope_theta`` with YaRN)."""

    def __init__(self, cfg: DeepseekV41Config, device: torch.device | str):
        scaling = cfg.rope_scaling if cfg.rope_scaling and cfg.rope_scaling.get("rope_type", "yarn") == "yarn" else None
        self.inv_freq = {"main": inv_freq(cfg.rope_dim, cfg.rope_theta, None).to(device),
                         "compress": inv_freq(cfg.rope_dim, cfg.compress_rope_theta, scaling).to(device)}

    def __call__(self, kind: str, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.float().unsqueeze(-1) * self.inv_freq[kind]
        # as the reference's complex64 table (torch.polar rounds cos/sin its own way in the last bit)
        rotation = torch.polar(torch.ones_like(angles), angles)
        return rotation.real.to(dtype), rotation.imag.to(dtype)


class _Step:
    """What layers hand down the stack within one forward: the candidates per rate, the candidate-block
    mask of the candidate source, the top-k each index source chose."""

    def __init__(self) -> None:
        self.candidates: dict[int, torch.Tensor] = {}
        self.blocks: torch.Tensor | None = None
        self.topk: dict[int, torch.Tensor] = {}
        self.image_mask: torch.Tensor | None = None  # [T] rows inside an image span (None: none)

    def narrowed(self, late: LateBatch) -> _Step:
        """The same hand-offs for the late layers' rows (bounded replay)."""
        out = _Step()
        out.candidates = {rate: late.narrow(c) for rate, c in self.candidates.items()}
        out.blocks = None if self.blocks is None else late.narrow(self.blocks)
        out.topk = {layer: late.narrow(t) for layer, t in self.topk.items()}
        out.image_mask = None if self.image_mask is None else late.narrow(self.image_mask)
        return out


class DeepseekV41Model:
    """Runs the forward over ``weights`` through ``ops``."""

    def __init__(self, cfg: DeepseekV41Config, weights: ModelWeights, ops: OpTable, dtype: torch.dtype,
                 numerics: str = "deepseek", engram_hash=None):
        if numerics not in NUMERICS:
            raise ValueError(f"unknown numerics {numerics!r}; expected one of {NUMERICS}")
        self.cfg, self.weights, self.ops, self.dtype, self.numerics = cfg, weights, ops, dtype, numerics
        self.device = weights.device
        self.rope = RotaryTables(cfg, self.device)
        self.cache_layout = cache_layout(cfg)
        self.cache_specs = self.cache_layout.layers
        #: n-gram hashing of the Engram layers (None without Engram); see :meth:`engram`
        self.engram_hash = engram_hash
        #: tokens per n-gram the batch must carry (0: no Engram)
        self.ngram_size = cfg.engram_max_ngram_size if cfg.has_engram else 0
        #: the vision tower (:mod:`.vision`), None for a checkpoint without one
        self.vision = (VisionTower(VisionConfig.of(cfg.vision_config), weights.vision, ops, dtype)
                       if cfg.vision_config and weights.vision else None)
        #: the checkpoint's DSpark stages as a draft model (:mod:`.dspark`), None without them
        self.dspark = DeepseekV41DSpark(self, weights.mtp) if weights.mtp and cfg.dspark_block_size else None
        self.drafter = self.dspark

    #: bounded replay (:mod:`deepinfer_core.model.replay`): ``"mask"`` or ``"compact"`` runs the layers after
    #: the last KV source only on a prefill's tail (where the batch carries ``replay_floor``); None: every
    #: layer on every token. Set by the worker from the engine argument ``bounded_replay``.
    bounded_replay: str | None = None

    @property
    def has_mtp(self) -> bool:
        return False

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.weights.named_parameters()

    @property
    def p(self):
        return MappingProxyType(dict(self.named_parameters()))

    def compressor_specs(self) -> set[BranchSpec]:
        return self.cache_layout.branch_specs()

    def ops_in_use(self, mtp: bool = True, kv_fp8: bool | None = None) -> set[str]:
        """The ops :meth:`forward` calls; ``kv_fp8``: over a cache of packed entries (None: the layout the
        numerics store by default)."""
        used = {"embedding", "rms_norm", "rotary_emb", "linear", "grouped_linear", "swiglu", "sparse_attention",
                "hc_mixes", "hc_collapse", "hc_post", "moe_route"}
        if self.numerics == "deepseek":
            fp4 = self.weights.layers[0].moe.experts.is_fp4
            used |= {"act_quant_sim", "moe_experts_fp4_quant_act" if fp4 else "moe_experts_quant_act"}
        else:
            used.add("moe_experts")
        packed = self.numerics == "deepseek" if kv_fp8 is None else kv_fp8
        if packed:
            used |= {"kv_fp4_pack", "kv_fp4_unpack"}
        if any(r for r in self.cfg.compress_ratios[: self.cfg.num_hidden_layers]):
            used |= {"indexer_scores"} | ({"fp4_kv_sim"} if self.numerics == "deepseek" and not packed else set())
            if any(self.cfg.compress_rate(s) > 1 for s in self.cfg.kv_source_layer_ids):
                used.add("compress_windows")
        if self.cfg.candidate_source_layer_id >= 0:
            used.add("candidate_blocks")
        if self.cfg.has_engram:
            used |= {"engram_gate", "engram_hash", "engram_lookup"}
        if self.vision is not None:
            used.add("encoder_attention")
        return used

    # --- top level -------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: ModelCache) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits of ``batch.logits_indices`` rows, what the DSpark drafter reads: the mean over the streams
        of each ``dspark_target_layer_ids`` layer's input, concatenated [T, targets * D]; the last layer's
        streams [T, n, D] for a checkpoint without targets)."""
        ops, cfg, w = self.ops, self.cfg, self.weights
        x = ops.embedding(batch.input_ids, w.embed).to(self.dtype)
        image_mask = None
        if batch.mm is not None:  # an image span's positions read its embeddings, not the image token's
            mm = batch.mm.to(x.device)
            x = x.index_put((mm.positions,), mm.embeds.to(self.dtype))
            image_mask = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
            image_mask[mm.positions] = True
        streams = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        pre = torch.zeros(x.shape[0], cfg.hc_mult, dtype=acc_dtype(self.dtype), device=x.device)
        pre[:, 0] = 1.0  # block 0's attention takes stream 0
        rope = {kind: self.rope(kind, batch.positions, self.dtype) for kind in ("main", "compress")}
        hashes = self.engram_rows(batch, image_mask) if self.engram_hash is not None else None
        ahead = self.engram_ahead(hashes)
        step = _Step()
        step.image_mask = image_mask
        targets = []
        late = late_batch(batch, self.bounded_replay) if self.bounded_replay else None
        start = replay_layers(cfg).start if late is not None else len(w.layers)
        here, early = batch, None
        for layer, block in enumerate(w.layers):
            if layer == start:  # from here on the tail only; ``early``: the streams the other rows keep
                early = streams, pre
                here, streams, pre, step = late.batch, late.narrow(streams), late.narrow(pre), step.narrowed(late)
                rope = {kind: (late.narrow(cos), late.narrow(sin)) for kind, (cos, sin) in rope.items()}
            if block.engram is not None:
                looked_up = (self.side_stream.join(ahead[layer]) if layer in ahead else
                             self.look_up(block.engram, hashes[:, cfg.engram_layer_ids.index(layer)]))
                streams = self.engram(block.engram, streams, looked_up, image_mask)
            if layer in cfg.dspark_target_layer_ids:  # the drafter reads a target layer's input
                targets.append((streams if early is None else late.widen(streams, early[0])).mean(dim=1))
            if early is not None and late.empty:  # no tail token in this chunk: only expert parallel's collectives
                if self.ep is not None:
                    dummy_moe(self, block.moe)
                continue
            streams, pre = self.block(block, layer, streams, pre, here, cache, rope, step)
        if early is not None:
            streams, pre = late.widen(streams, early[0]), late.widen(pre, early[1])
        hidden = ops.rms_norm(ops.hc_collapse(streams[batch.logits_indices], pre[batch.logits_indices]), w.norm,
                              cfg.rms_norm_eps)
        return self.logits(hidden), torch.cat(targets, dim=-1) if targets else streams

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head in float32 (float64 stays float64), as the reference keeps it: the weight is loaded in
        that dtype (the manifest's ``fp32``), so no step converts it."""
        acc, head = acc_dtype(hidden.dtype), self.weights.head.weight
        return self.ops.linear(hidden.to(acc), head if head.dtype == acc else head.to(acc))

    def embed_image(self, image: ImageSpan) -> torch.Tensor:
        """[image.num_tokens, D]: what the positions of ``image``'s span read (:attr:`ForwardBatch.mm`)."""
        if self.vision is None:
            raise ValueError("this checkpoint has no vision tower: its prompts cannot carry images")
        return self.vision.span_embeddings(image)

    def linear(self, x: torch.Tensor, lin) -> torch.Tensor:
        return self.ops.linear(x, lin.weight)

    def qlinear(self, x: torch.Tensor, lin) -> torch.Tensor:
        """A linear the release stores in FP8: under deepseek numerics its input is first quantised as the
        reference's ``act_quant`` does (E4M3 per 32, power-of-two scales)."""
        if self.numerics == "deepseek":
            x = self.ops.act_quant_sim(x, ACT_BLOCK, "e4m3", False)
        return self.ops.linear(x, lin.weight)

    def quant(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        """Under deepseek numerics: ``"window"`` KV E4M3 per 32, ``"compressed"`` KV FP4 per 16 with E4M3
        scales, ``"index"`` keys and queries FP4 per 32 with E8M0 scales; otherwise ``x``."""
        if self.numerics != "deepseek":
            return x
        if kind == "window":
            return self.ops.act_quant_sim(x, ACT_BLOCK, "e4m3", False)
        if kind == "compressed":
            return self.ops.fp4_kv_sim(x, COMPRESSED_BLOCK)
        return self.ops.act_quant_sim(x, ACT_BLOCK, "e2m1", False)

    def store(self, pool: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, kind: str) -> None:
        """Write ``x`` [N, D] to rows ``slots`` of ``pool``: packed entries (``fp4_ds``: uint8 rows of
        :mod:`~deepinfer_core.quant.kv_fp4`, quantised as they are packed), else the values as the
        numerics quantise them, in the pool's dtype."""
        if pool.dtype == torch.uint8:
            pool[slots] = self.ops.kv_fp4_pack(x, kind)
        else:
            pool[slots] = self.quant(x, kind).to(pool.dtype)

    def load(self, pool: torch.Tensor, indices: torch.Tensor, kind: str, dim: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, indices into them) of the rows ``indices`` reads (-1: none): a dense pool as it is; a
        packed one decoded whole when that is less work, else the read rows gathered and decoded."""
        if pool.dtype != torch.uint8:
            return pool, indices
        if indices.numel() >= pool.shape[0]:
            return self.ops.kv_fp4_unpack(pool, kind, dim).to(self.dtype), indices
        flat = indices.reshape(-1)
        rows = self.ops.kv_fp4_unpack(pool[flat.clamp(min=0)], kind, dim).to(self.dtype)
        slots = torch.arange(flat.numel(), device=flat.device).view(indices.shape)
        return rows, torch.where(indices >= 0, slots, -1)

    # --- decoder block ---------------------------------------------------------------------------

    def mixes(self, hc: HyperConnection, streams: torch.Tensor):
        cfg = self.cfg
        return self.ops.hc_mixes(streams, hc.fn, hc.base, hc.scale, cfg.hc_sinkhorn_iters, cfg.hc_eps,
                                 cfg.rms_norm_eps)

    def block(self, w: Block, layer: int, streams, pre, batch, cache, rope, step: _Step):
        """One block of single-pass mHC: returns (streams, the ``pre`` for the next block's attention)."""
        ops, eps = self.ops, self.cfg.rms_norm_eps
        attn_pre, post, comb = self.mixes(w.attn_hc, streams)
        h = ops.rms_norm(ops.hc_collapse(streams, pre), w.attn_norm, eps)
        streams = ops.hc_post(self.attention(w.attn, layer, h, batch, cache, rope, step), streams, post, comb)
        ffn_pre, post, comb = self.mixes(w.ffn_hc, streams)
        h = ops.rms_norm(ops.hc_collapse(streams, attn_pre), w.ffn_norm, eps)
        return ops.hc_post(self.moe(w.moe, h, image_mask=step.image_mask), streams, post, comb), ffn_pre

    # --- attention -------------------------------------------------------------------------------

    def attention(self, a: Attention, layer: int, h, batch: ForwardBatch, cache: ModelCache, rope,
                  step: _Step) -> torch.Tensor:
        ops, cfg = self.ops, self.cfg
        eps, n_tok = cfg.rms_norm_eps, h.shape[0]
        rate = cfg.compress_rate(layer)
        cos, sin = rope["compress" if rate else "main"]

        q_res = ops.rms_norm(self.qlinear(h, a.wq_a), a.q_norm, eps)
        q = self.qlinear(q_res, a.wq_b).view(n_tok, cfg.num_attention_heads, cfg.head_dim)
        q = ops.rotary_emb(q, cos, sin, False)
        kv = ops.rms_norm(self.qlinear(h, a.wkv), a.kv_norm, eps)
        kv = ops.rotary_emb(kv.unsqueeze(1), cos, sin, False).squeeze(1)
        window_pool = cache.window_kv[layer]
        self.store(window_pool, batch.window_slots, kv, "window")

        extra_pool = extra_idx = None
        if rate:
            extra_pool = cache.comp_kv[layer]
            if a.compressor is not None:
                self.compress(a, layer, h, batch, cache)
            if a.indexer is not None:
                step.topk[layer] = self.indexer(a, layer, h, q_res, batch, cache, rope, step)
            extra_idx = step.topk[cfg.index_source(layer)]
        window_pool, window_idx = self.load(window_pool, batch.window_rows(), "window", cfg.head_dim)
        if extra_pool is not None:
            extra_pool, extra_idx = self.load(extra_pool, extra_idx, "compressed", cfg.head_dim)
        out = ops.sparse_attention(q, window_pool, window_idx, a.sinks, cfg.head_dim**-0.5, extra_pool, extra_idx)
        out = ops.rotary_emb(out, cos, sin, True)
        out = ops.grouped_linear(out.reshape(n_tok, cfg.o_groups, -1), a.wo_a)
        return self.qlinear(out.reshape(n_tok, -1), a.wo_b)

    def compress(self, a: Attention, layer: int, h, batch: ForwardBatch, cache: ModelCache) -> None:
        """A KV source: the latents of every group that closed this step, their index keys (from the latent
        before RoPE) and their entries (rotated at the group's first position), written to the pools."""
        ops, cfg = self.ops, self.cfg
        c: Compressor = a.compressor
        rate = cfg.compress_rate(layer)
        meta = batch.compressors[rate, False]
        if rate == 1:  # one token per group: no pooling, no gate, no state
            latent = ops.rms_norm(self.linear(h, c.wkv), c.norm, cfg.rms_norm_eps)
            latent = latent[meta.cur_idx[:, 0] - meta.ring_read.numel()]
        else:
            latent = self.pool(c, h, meta, cache.comp_state[layer])
        if latent is None:
            return
        cos, sin = self.rope("compress", meta.entry_positions, self.dtype)
        ix = a.indexer
        if ix is not None and ix.wk is not None:
            keys = ops.rms_norm(self.linear(latent, ix.wk), ix.k_norm, cfg.rms_norm_eps)
            keys = ops.rotary_emb(keys.unsqueeze(1), cos, sin, False).squeeze(1)
            self.store(cache.index_keys[layer], meta.entry_slots, keys, "index")
        entries = ops.rotary_emb(latent.unsqueeze(1), cos, sin, False).squeeze(1)
        self.store(cache.comp_kv[layer], meta.entry_slots, entries, "compressed")  # slot -1: the trash block

    def pool(self, c: Compressor, h, meta, state) -> torch.Tensor | None:
        """Ratio > 1: project this step's tokens (float32), softmax-pool every group that closed (its rows
        from the ring and this step), keep each sequence's last rows in the ring; the normed latents."""
        ring_kv, ring_gate = state
        acc = ring_kv.dtype
        kv = self.ops.linear(h.to(acc), c.wkv.weight.to(acc))
        gate = self.ops.linear(h.to(acc), c.wgate.weight.to(acc))
        latent = None
        if meta.entry_slots.numel():
            src_kv = torch.cat([ring_kv[meta.ring_read], kv, kv.new_zeros((1, kv.shape[1]))])
            src_gate = torch.cat([ring_gate[meta.ring_read], gate, gate.new_full((1, gate.shape[1]), float("-inf"))])
            pooled = self.ops.compress_windows(src_kv[meta.cur_idx], src_gate[meta.cur_idx])
            latent = self.ops.rms_norm(pooled.to(self.dtype), c.norm, self.cfg.rms_norm_eps)
        ring_kv[meta.ring_write] = kv[meta.ring_write_src]
        ring_gate[meta.ring_write] = gate[meta.ring_write_src]
        return latent

    #: the most [queries x candidates] elements one pass of the indexer holds: every step of it is per query,
    #: so a long prefill chunk is ranked a slice of queries at a time (a 128K-token context's ratio-1 lists
    #: for an 8K chunk would take 8 GiB as one int64 tensor)
    indexer_slice_elements = 1 << 25

    def indexer(self, a: Attention, layer: int, h, q_res, batch: ForwardBatch, cache: ModelCache, rope,
                step: _Step) -> torch.Tensor:
        """The pool rows this index source's queries attend: its scores over the compressed candidates,
        inside the candidate blocks where a candidate source precedes it, top ``index_topk``."""
        ops, cfg = self.ops, self.cfg
        ix, rate = a.indexer, cfg.compress_rate(layer)
        cos, sin = rope["compress"]
        heads, dim, n_tok = cfg.index_n_heads, cfg.index_head_dim, h.shape[0]
        q = self.qlinear(q_res, ix.wq_b).view(n_tok, heads, dim)
        q = self.quant(ops.rotary_emb(q, cos, sin, False), "index")
        weights = self.linear(h, ix.weights_proj) * (dim**-0.5 * heads**-0.5)
        per_slice = max(1, self.indexer_slice_elements // max(batch.entry_widths[rate], 1))
        if n_tok <= per_slice:
            if rate not in step.candidates:
                step.candidates[rate] = compressed_candidates(batch, rate, cache.block_size)
            candidates = step.candidates[rate]
            keys, rows = self.load(cache.index_keys[layer], candidates, "index", dim)
            blocks, topk = self.rank(layer, q, weights, keys, rows, candidates, step.blocks)
            step.blocks = step.blocks if blocks is None else blocks
            return topk
        keys = cache.index_keys[layer]
        if keys.dtype == torch.uint8:  # packed: decoded once for every slice
            keys = ops.kv_fp4_unpack(keys, "index", dim).to(self.dtype)
        blocks, topk = [], []
        for start in range(0, n_tok, per_slice):
            t = slice(start, start + per_slice)
            candidates = compressed_candidates(batch, rate, cache.block_size, t)
            part = self.rank(layer, q[t], weights[t], keys, candidates, candidates,
                             None if step.blocks is None else step.blocks[t])
            blocks.append(part[0])
            topk.append(part[1])
        if blocks[0] is not None:
            step.blocks = torch.cat(blocks)
        return torch.cat(topk)

    def rank(self, layer: int, q, weights, keys, rows, candidates: torch.Tensor, blocks: torch.Tensor | None
             ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """One slice of an index source's queries: (their candidate-block mask where ``layer`` is the
        candidate source, else None; their top-k). ``blocks``: the candidate source's mask of these rows."""
        ops, cfg = self.ops, self.cfg
        scores = ops.indexer_scores(q, weights, keys, rows, 1.0)
        valid = candidates >= 0
        kept = None
        if layer == cfg.candidate_source_layer_id:
            kept = ops.candidate_blocks(scores, valid, cfg.candidate_block_size, cfg.candidate_topk_blocks)
        elif cfg.uses_candidates(layer):
            valid = valid & blocks
            scores = scores.masked_fill(~valid, float("-inf"))
        return kept, select_topk(scores, valid, candidates, cfg.index_topk)

    # --- Engram ----------------------------------------------------------------------------------

    def engram_rows(self, batch: ForwardBatch, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[T, n_engram_layers, columns] table rows of every token (from its n-gram history). Image tokens
        are dead: an n-gram stops at one (the history carries earlier steps' as DEAD, ``image_mask``
        marks this step's)."""
        if batch.ngram_index is None:
            raise ValueError("this model has Engram layers: the batch must carry each token's n-gram history "
                             "(build_forward_batch(..., ngram=model.ngram_size) with SeqSpan.history)")
        # the history is already on the device: hashing there reads nothing back (graph-safe)
        history = batch.ngram_ids()
        if image_mask is not None:
            rest = image_mask.new_zeros(batch.ngram_tokens.numel() + 2)  # history tokens, BEFORE_START, DEAD
            history = history.masked_fill(torch.cat([image_mask, rest])[batch.ngram_index], DEAD)
        return self.ops.engram_hash(history, *self.engram_hash.op_args())

    def engram_ahead(self, hashes: torch.Tensor | None) -> dict[int, Any]:
        """Every Engram layer's table rows, started on :attr:`side_stream` at the start of the step, so the
        reads (host memory over unified addressing, a file mapping) overlap the layers before each Engram
        layer. A table sharded over the ranks is read in its layer: its lookup is a collective."""
        if hashes is None or self.engram_lookup is not None:
            return {}
        layers = self.weights.layers
        return {layer: self.side_stream.run(lambda e=layers[layer].engram, rows=hashes[:, i]: self.look_up(e, rows))
                for i, layer in enumerate(self.cfg.engram_layer_ids)}

    def look_up(self, e: Engram, rows: torch.Tensor) -> torch.Tensor:
        """[T, columns * head_dim] values of the table rows ``rows`` [T, columns] (dequantised)."""
        table = e.table
        if table.scale is None:
            looked_up = self.ops.embedding(rows.reshape(-1), table.weight).reshape(rows.shape[0], -1)
        elif self.engram_lookup is not None:  # a table sharded over the ranks
            looked_up = self.engram_lookup(e, rows)
        else:
            looked_up = self.ops.engram_lookup(rows, table.weight, table.scale, 0)
        return looked_up.to(self.dtype)

    def engram(self, e: Engram, streams: torch.Tensor, looked_up: torch.Tensor,
               image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``streams + gate * value`` per stream: the looked-up rows (:meth:`look_up`) projected to one key
        per stream and one shared value, each stream gated by its normalised match with its key; image
        tokens' streams pass through."""
        cfg, n, d = self.cfg, self.cfg.hc_mult, self.cfg.hidden_size
        kv = self.qlinear(looked_up, e.wkv)
        key, value = kv.split([n * d, d], dim=-1)
        out = self.ops.engram_gate(streams, key.reshape(-1, n, d), value, e.q_weight, e.k_weight,
                                   cfg.rms_norm_eps)
        return out if image_mask is None else torch.where(image_mask[:, None, None], streams, out)

    #: where :meth:`engram_ahead` starts the lookups (the model runner gives its platform's side stream)
    side_stream = SideStream()

    #: the lookup collective of a table sharded over the ranks (:mod:`.engram_placement`), None otherwise
    engram_lookup = None

    #: where the loader put the Engram tables (:mod:`.engram_placement`); None: no Engram, or built in memory
    engram_placement: str | None = None

    def host_waits(self) -> list[str]:
        """What a step of this model waits on the host for, whatever the ops: a device cannot address a file's
        pageable mapping, so ``engram_placement="file"`` tables are gathered on the host (no graph can hold
        that)."""
        if self.engram_placement == "file" and self.device.type != "cpu":
            return ["the Engram lookups of tables read from the checkpoint's file mapping"]
        return []

    # --- MoE -------------------------------------------------------------------------------------

    ep = None
    expert_load = None

    def route(self, gate, logits: torch.Tensor, top_k: int, image_mask: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """moe_route with the router's ``bias``, and ``bias_vl`` for the rows of ``image_mask``: moe_route
        is per row, so routing the image rows apart equals one call with a per-row bias."""
        cfg, route = self.cfg, self.ops.moe_route
        if image_mask is None or gate.bias_vl is None:
            return route(logits, cfg.scoring_func, top_k, gate.bias, None, cfg.routed_scaling_factor)
        weights = logits.new_empty(logits.shape[0], top_k)
        ids = torch.empty(logits.shape[0], top_k, dtype=torch.long, device=logits.device)
        for rows, bias in (~image_mask, gate.bias), (image_mask, gate.bias_vl):
            if rows.any():
                weights[rows], ids[rows] = route(logits[rows], cfg.scoring_func, top_k, bias, None,
                                                 cfg.routed_scaling_factor)
        return weights, ids

    def moe(self, moe: MoE, h, token_ids: torch.Tensor | None = None, top_k: int | None = None,
            image_mask: torch.Tensor | None = None, group: Any = None) -> torch.Tensor:
        """The routed experts (through the expert-parallel dispatcher when there is one) plus the shared
        expert; ``token_ids`` is unused (no hash routing in V4.1); ``top_k``: experts per token (default:
        the target's; the drafter's stages route fewer); ``image_mask``: rows routed with ``bias_vl``;
        ``group``: whose dispatcher (``ep``) and load recorder (``expert_load``) the layer's experts use,
        None for the target's (this model's): the DSpark drafter's experts are a group of their own."""
        ops, cfg, gate, ex = self.ops, self.cfg, moe.gate, moe.experts
        group = self if group is None else group
        ep, load = group.ep, group.expert_load
        acc = acc_dtype(h.dtype)
        logits = ops.linear(h.to(acc), gate.weight.weight.to(acc))
        weights, ids = self.route(gate, logits, top_k or cfg.num_experts_per_tok, image_mask)
        if load is not None:
            load.record(moe, ids)
        weights = weights.to(h.dtype)
        x = h
        if ep is not None:  # each (token, expert) pair goes to the expert's rank, one row per pair
            x, ids, weights, handle = ep.dispatch(h, ids, weights)
            ids, weights = ids.unsqueeze(1), weights.unsqueeze(1)
        if ex.is_fp4:  # kept packed under deepseek numerics
            routed = ops.moe_experts_fp4_quant_act(x, ex.w13.weight, ex.w13.scale, ex.w2.weight, ex.w2.scale, ids,
                                                   weights, cfg.swiglu_limit, ACT_BLOCK)
        elif self.numerics == "deepseek":
            routed = ops.moe_experts_quant_act(x, ex.w13.weight, ex.w2.weight, ids, weights, cfg.swiglu_limit,
                                               ACT_BLOCK)
        else:
            routed = ops.moe_experts(x, ex.w13.weight, ex.w2.weight, ids, weights, cfg.swiglu_limit)
        if ep is not None:
            routed = ep.combine(routed, handle)
        shared = ops.swiglu(self.qlinear(h, moe.shared.w13), cfg.swiglu_limit)
        return routed + self.qlinear(shared, moe.shared.w2)


__all__ = ["NUMERICS", "DeepseekV41Model", "RotaryTables", "inv_freq"]

"""DeepSeek-V4.1's checkpoint manifest: every tensor of the release, by DeepSeek's flat names
(``inference/model.py``'s module paths, as its ``convert.py`` reads them), with its shape and how the
release stores it.

Stored formats, by tensor role (the release's dtype counts are exactly these rules):

* FP8 e4m3 with one ``float8_e8m0fnu`` scale per 32x32 tile: the attention's ``wq_a``, ``wq_b``,
  ``wkv``, ``wo_a`` (``convert.py`` dequantises it), ``wo_b``; the shared experts; the indexer's ``wq_b``;
  Engram's ``wkv``; the drafter's ``main_proj``. Engram's tables: e4m3 rows with one scale per 32 values.
* Routed experts: FP4 e2m1 packed two a byte as int8 [out, in/2], one e8m0 scale per 32 inputs.
* float32: ``hc_*``, ``attn_sink``, the router's ``bias`` and ``bias_vl``; the head is bf16 in the files and
  kept in float32 on load, as the reference's ``ParallelHead``.
* bf16: everything else (embedding, head, norms, router weights, compressor and indexer key
  projections, Engram's ``q_weight``/``k_weight``, the drafter's heads, the vision tower and aligner).

The drafter's stages (``mtp.{0,1,2}``) share the backbone's embedding and head: the release has no
``mtp.N.embed`` / ``mtp.N.head``.
"""

from __future__ import annotations

import re

from deepinfer_core.model.manifest import CheckpointManifest, TensorSpec
from deepinfer_core.models.deepseek_v41.config import DeepseekV41Config

#: one scale per 32x32 tile of a linear, per 32 values of an Engram table row
FP8_TILE = (32, 32)
ENGRAM_TILE = (1, 32)

FP8_NAMES = re.compile(r"(\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)\.weight|\.attn\.indexer\.wq_b\.weight"
                       r"|\.shared_experts\.w[123]\.weight|\.engram\.(wkv|embed)\.weight|\.main_proj\.weight)$")
FP4_NAMES = re.compile(r"\.ffn\.experts\.(\d+\.w[123]\.weight|w13|w2)$")
FP32_NAMES = re.compile(r"(\.hc_(attn|ffn)_(fn|base|scale)|\.attn\.attn_sink|\.ffn\.gate\.bias(_vl)?)$")
#: entries some exports write that are not parameters (the drafter's tied embedding and head)
IGNORED = re.compile(r"(^mtp\.\d+\.(embed|head)\.weight$|\.rotary_emb\.inv_freq$)")
RENAMES = [(re.compile(r"^model\."), "")]


def stored_format(name: str) -> str:
    if FP4_NAMES.search(name):
        return "fp4"
    if FP8_NAMES.search(name):
        return "fp8"
    return "fp32" if FP32_NAMES.search(name) else "bf16"


def block_prefixes(cfg: DeepseekV41Config) -> list[tuple[str, int]]:
    """(prefix, layer id) of every block: the backbone's, then the drafter's stages (ids n_layers + j)."""
    n = cfg.num_hidden_layers
    return [(f"layers.{i}.", i) for i in range(n)] + [
        (f"mtp.{j}.", n + j) for j in range(cfg.num_layers_with_drafter - n)]


def manifest(cfg: DeepseekV41Config) -> CheckpointManifest:
    """Every tensor of ``cfg``'s release (the drafter's stages as the drafter's, the vision tower as
    ``group="vision"``)."""
    d, h, hd, n = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.hc_mult
    qr, g, olr, v = cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank, cfg.vocab_size
    inter = cfg.moe_intermediate_size
    mix = (2 + n) * n
    vision = cfg.vision_config
    rows: list[TensorSpec] = []

    def add(name: str, shape: tuple[int, ...], block: tuple[int, int] = FP8_TILE, **kw) -> None:
        stored = stored_format(name)
        fp32 = kw.pop("fp32", stored == "fp32")
        rows.append(TensorSpec(name, shape, stored, fp32=fp32, block=block, **kw))

    add("embed.weight", (v, d))
    add("norm.weight", (d,))
    add("head.weight", (v, d), fp32=True)  # bf16 in the files; the reference's head runs in float32
    for p, layer in block_prefixes(cfg):
        drafter = layer >= cfg.num_hidden_layers
        kw = {"drafter": drafter}
        for hc in ("attn", "ffn"):
            add(p + f"hc_{hc}_fn", (mix, n * d), **kw)
            add(p + f"hc_{hc}_base", (mix,), **kw)
            add(p + f"hc_{hc}_scale", (3,), **kw)
        add(p + "attn_norm.weight", (d,), **kw)
        add(p + "ffn_norm.weight", (d,), **kw)
        add(p + "attn.attn_sink", (h,), **kw)
        add(p + "attn.wq_a.weight", (qr, d), **kw)
        add(p + "attn.q_norm.weight", (qr,), **kw)
        add(p + "attn.wq_b.weight", (h * hd, qr), **kw)
        add(p + "attn.wkv.weight", (hd, d), **kw)
        add(p + "attn.kv_norm.weight", (hd,), **kw)
        add(p + "attn.wo_a.weight", (g * olr, h * hd // g), **kw)
        add(p + "attn.wo_b.weight", (d, g * olr), **kw)
        rate = cfg.compress_rate(layer)
        if rate and cfg.kv_source(layer) == layer:
            add(p + "attn.compressor.norm.weight", (hd,), **kw)
            add(p + "attn.compressor.wkv.weight", (hd, d), **kw)
            if rate > 1:
                add(p + "attn.compressor.wgate.weight", (hd, d), **kw)
        if rate and cfg.index_source(layer) == layer:
            ih, idim = cfg.index_n_heads, cfg.index_head_dim
            add(p + "attn.indexer.wq_b.weight", (ih * idim, qr), **kw)
            add(p + "attn.indexer.weights_proj.weight", (ih, d), **kw)
            if cfg.kv_source(layer) == layer:
                add(p + "attn.indexer.wk.weight", (idim, hd), **kw)
                add(p + "attn.indexer.k_norm.weight", (idim,), **kw)
        experts = cfg.drafter_moe_config()[0] if drafter else cfg.n_routed_experts
        add(p + "ffn.gate.weight", (experts, d), **kw)
        add(p + "ffn.gate.bias", (experts,), **kw)
        if vision:
            add(p + "ffn.gate.bias_vl", (experts,), **kw)
        add(p + "ffn.experts.w13", (experts, 2 * inter, d), experts=True, **kw)
        add(p + "ffn.experts.w2", (experts, d, inter), experts=True, **kw)
        # w1 and w3 are stacked on load into one [2I, D] projection, w13
        for w in ("w1", "w3"):
            add(p + f"ffn.shared_experts.{w}.weight", (inter, d), loaded=False, **kw)
        add(p + "ffn.shared_experts.w2.weight", (d, inter), **kw)
        add(p + "ffn.shared_experts.w13", (2 * inter, d), in_file=False, **kw)
        if not drafter and layer in cfg.engram_layer_ids:
            rows_n = cfg.engram_num_embeddings[cfg.engram_layer_ids.index(layer)]
            ehd, cols = cfg.engram_head_dim, (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
            add(p + "engram.embed.weight", (rows_n, ehd), block=ENGRAM_TILE, kept=True)
            add(p + "engram.wkv.weight", (d * (n + 1), cols * ehd))
            add(p + "engram.q_weight", (n, d))
            add(p + "engram.k_weight", (n, d))
        stage = layer - cfg.num_hidden_layers
        if drafter and stage == 0:
            add(p + "main_proj.weight", (d, d * len(cfg.dspark_target_layer_ids)), **kw)
            add(p + "main_norm.weight", (d,), **kw)
        if drafter and stage == cfg.num_nextn_predict_layers - 1:
            rank = cfg.dspark_markov_rank
            add(p + "norm.weight", (d,), **kw)
            add(p + "markov_head.embed.weight", (v, rank), **kw)
            add(p + "markov_head.head.weight", (v, rank), **kw)
            add(p + "confidence_head.proj.weight", (1, d + rank), **kw)
    if vision:
        _vision_rows(cfg, add)
    return CheckpointManifest.of(rows, renames=RENAMES, ignored=IGNORED, fp8_block=FP8_TILE)


def _vision_rows(cfg: DeepseekV41Config, add) -> None:
    """The vision tower (``inference/vision.py``: ViT, aligner) and the image-span delimiters."""
    vc, d = cfg.vision_config, cfg.hidden_size
    vd, vi, ps = vc["hidden_size"], vc["intermediate_size"], vc["patch_size"]
    r = vc["downsample_ratio"]
    kw = {"group": "vision"}
    for name in ("image_start", "image_end", "image_newline"):
        add(name, (d,), **kw)
    add("vision.patch_embed.proj.weight", (vd, 3 * ps * ps), **kw)
    add("vision.patch_embed.proj.bias", (vd,), **kw)
    for b in range(vc["num_hidden_layers"]):
        p = f"vision.blocks.{b}."
        add(p + "norm1.weight", (vd,), **kw)
        add(p + "norm2.weight", (vd,), **kw)
        add(p + "attn.wqkv.weight", (3 * vd, vd), **kw)
        add(p + "attn.wqkv.bias", (3 * vd,), **kw)
        add(p + "attn.wo.weight", (vd, vd), **kw)
        add(p + "attn.wo.bias", (vd,), **kw)
        add(p + "mlp.w1.weight", (2 * vi, vd), **kw)
        add(p + "mlp.w2.weight", (vd, vi), **kw)
    add("vision.norm.weight", (vd,), **kw)
    add("aligner.w1.weight", (d, vd * r * r), **kw)
    add("aligner.w1.bias", (d,), **kw)
    add("aligner.w2.weight", (d, d), **kw)
    add("aligner.w2.bias", (d,), **kw)

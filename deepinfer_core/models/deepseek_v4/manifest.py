"""DeepSeek-V4's checkpoint manifest: every parameter with its shape, how DeepSeek published it and how
the engine keeps it; the names other exports use and the entries the engine drops.

Published formats (``inference/model.py``'s dtypes): the linears it builds in FP8 are E4M3 with
``float8_e8m0fnu`` scales per 128x128 tile (``wo_a`` too); routed experts are FP4 e2m1 packed two a byte
with ``float8_e8m0fnu`` scales per 32 inputs; compressor and indexer-weight projections, router,
embedding and head are bf16; ``tid2eid`` is int32; everything else (norms, mHC, sinks, position and
router biases) float32.

FP8 mode keeps in E4M3: the attention's ``wq_a``, ``wq_b``, ``wkv``, ``wo_b``, the shared and routed
experts, and the compressor and indexer projections whose both dims are whole 128-tiles; not the
embedding, head, router, norms, ``hc_*``, ``ape``, sinks, ``tid2eid``, ``wo_a`` (its grouped projection
has no FP8 op) or the MTP ``e_proj`` / ``h_proj``. Under ``numerics="deepseek"`` only what DeepSeek's
model.py runs through its FP8 GEMM: not the compressors' float32 projections, the bf16 indexer
``weights_proj``, nor routed experts that are not packed FP4.

V4-Flash-0731 (a config with DSpark stages, :mod:`.dspark_config`) has, in place of the MTP layer, its
stages ``mtp.{0..S-1}``: window-only blocks with their own MoE (the stages' expert count), no
``e_proj``/``h_proj``/``enorm``/``hnorm``; the first stage holds ``main_proj`` (FP8, [D, D * targets]) and
``main_norm``, the last the output collapse ``hc_head_*`` and ``norm`` (as V4's MTP layer has them), the
Markov head (``markov_head.{embed,head}.weight`` [V, rank], bf16) and the confidence head
(``confidence_head.proj.weight`` [1, D + rank], bf16).
"""

from __future__ import annotations

import re

from deepinfer_core.model.manifest import CheckpointManifest, TensorSpec
from deepinfer_core.models.deepseek_v4.config import DeepseekV4Config
from deepinfer_core.models.deepseek_v4.names import RENAMES, canonical_name

__all__ = ["BF16_NAMES", "FP4_NAMES", "FP8_NAMES", "IGNORED", "RENAMES", "block_prefixes", "canonical_name",
           "fp8_numerics", "is_fp8_weight", "manifest", "stored_format"]
from deepinfer_core.quant.fp8 import FP8_BLOCK

#: the linears ``inference/model.py`` builds in the default (FP8) dtype; ``wo_a`` is FP8 in the file too
FP8_NAMES = re.compile(r"(\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)\.weight|\.attn\.indexer\.wq_b\.weight"
                       r"|\.shared_experts\.w[123]\.weight|^mtp\.\d+\.(e_proj|h_proj|main_proj)\.weight)$")
FP4_NAMES = re.compile(r"\.ffn\.experts\.(\d+\.w[123]\.weight|w13|w2)$")
BF16_NAMES = re.compile(r"(^embed\.weight|^head\.weight|\.compressor\.(wkv|wgate)\.weight"
                        r"|\.indexer\.weights_proj\.weight|\.ffn\.gate\.weight"
                        r"|^mtp\.\d+\.(markov_head\.(embed|head)|confidence_head\.proj)\.weight)$")

_ALWAYS_FP8 = re.compile(
    r"(\.attn\.(wq_a|wq_b|wkv|wo_b)\.weight|\.ffn\.shared_experts\.(w[123]\.weight|w13)|\.ffn\.experts\.w(13|2))$"
)
#: compressor and indexer projections: only where both dims are whole tiles (DeepSeek keeps e.g. the
#: 64-row indexer ``weights_proj`` in bf16)
_FP8_IF_WHOLE_TILES = re.compile(r"\.attn\.(compressor\.(wkv|wgate)|indexer\.(wq_b|weights_proj|"
                                 r"compressor\.(wkv|wgate)))\.weight$")
#: what DeepSeek's inference/model.py keeps in high precision and the engine's FP8 mode would quantise:
#: the compressors' float32 projections, the bf16 indexer ``weights_proj``, and the routed experts
#: when they are not packed FP4 (their FP8 op quantises activations with float scales, not ue8m0)
_NOT_FP8_IN_DEEPSEEK = re.compile(r"(\.compressor\.(wkv|wgate)\.weight|\.indexer\.weights_proj\.weight|"
                                  r"\.ffn\.experts\.w(13|2))$")


def stored_format(name: str) -> str:
    """"fp8" or "fp32": how tensor ``name`` (DeepSeek's name) is in the files."""
    if FP4_NAMES.search(name):
        return "fp4"
    if FP8_NAMES.search(name):
        return "fp8"
    if name.endswith("tid2eid"):
        return "int32"
    return "bf16" if BF16_NAMES.search(name) else "fp32"


def is_fp8_weight(name: str, shape: tuple[int, ...]) -> bool:
    """Does FP8 mode keep parameter ``name`` (of ``shape``) in E4M3 (transformers numerics)?"""
    if _ALWAYS_FP8.search(name):
        return True
    return bool(_FP8_IF_WHOLE_TILES.search(name)) and shape[-2] % FP8_BLOCK == 0 and shape[-1] % FP8_BLOCK == 0


def fp8_numerics(name: str, shape: tuple[int, ...]) -> frozenset[str]:
    """The numerics under which FP8 mode keeps ``name`` in E4M3."""
    if not is_fp8_weight(name, shape):
        return frozenset()
    return frozenset({"transformers"} if _NOT_FP8_IN_DEEPSEEK.search(name) else {"transformers", "deepseek"})


#: file entries that are not weights of the engine's model: rotary buffers some exports write, and the
#: MTP layer's own copies of the embedding and head (it shares the main model's)
IGNORED = re.compile(r"(\.rotary_emb\.inv_freq$|^mtp\.\d+\.(embed|embed_tokens|emb)\.weight$"
                     r"|^mtp\.\d+\.(head|lm_head)\.weight$)")
#: parameters transformers keeps in float32 under bf16/fp16
_FP32 = re.compile(r"(hc_|attn_sink|\.ape$|gate\.bias|norm\.weight$)")


def block_prefixes(cfg: DeepseekV4Config) -> list[tuple[str, int]]:
    """(prefix, attention-layer index) of every decoder block, MTP blocks (index -1) included."""
    blocks = [(f"layers.{i}.", i) for i in range(cfg.num_hidden_layers)]
    blocks += [(f"mtp.{j}.", -1) for j in range(cfg.num_nextn_predict_layers or 0)]
    return blocks


def manifest(cfg: DeepseekV4Config) -> CheckpointManifest:
    """Every parameter of ``cfg`` (MTP blocks as the drafter's)."""
    d, h, hd, n = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.hc_mult
    qr, g, olr = cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank
    e, inter, v = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.vocab_size
    mix = (2 + n) * n
    rows: list[TensorSpec] = []

    def add(name: str, shape: tuple[int, ...], **kw) -> None:
        rows.append(TensorSpec(name, shape, stored_format(name), fp8_numerics(name, shape),
                               fp32=bool(_FP32.search(name)), **kw))

    add("embed.weight", (v, d))
    add("head.weight", (v, d))
    add("norm.weight", (d,))
    add("hc_head_fn", (n, n * d))
    add("hc_head_base", (n,))
    add("hc_head_scale", (1,))
    for p, layer in block_prefixes(cfg):
        mtp = layer < 0
        kw = {"drafter": mtp}
        for hc in ("attn", "ffn"):
            add(p + f"hc_{hc}_fn", (mix, n * d), **kw)
            add(p + f"hc_{hc}_base", (mix,), **kw)
            add(p + f"hc_{hc}_scale", (3,), **kw)
        add(p + "attn_norm.weight", (d,), **kw)
        add(p + "ffn_norm.weight", (d,), **kw)
        add(p + "attn.wq_a.weight", (qr, d), **kw)
        add(p + "attn.q_norm.weight", (qr,), **kw)
        add(p + "attn.wq_b.weight", (h * hd, qr), **kw)
        add(p + "attn.wkv.weight", (hd, d), **kw)
        add(p + "attn.kv_norm.weight", (hd,), **kw)
        add(p + "attn.attn_sink", (h,), **kw)
        add(p + "attn.wo_a.weight", (g * olr, h * hd // g), **kw)
        add(p + "attn.wo_b.weight", (d, g * olr), **kw)
        ne = cfg.drafter_moe_config()[0] if mtp else e  # DSpark stages: their own expert count
        add(p + "ffn.gate.weight", (ne, d), **kw)
        add(p + "ffn.experts.w13", (ne, 2 * inter, d), experts=True, **kw)
        add(p + "ffn.experts.w2", (ne, d, inter), experts=True, **kw)
        # w1 and w3 are stacked on load into one [2I, D] projection, w13
        for w, shape in (("w1", (inter, d)), ("w3", (inter, d))):
            add(p + f"ffn.shared_experts.{w}.weight", shape, loaded=False, **kw)
        add(p + "ffn.shared_experts.w2.weight", (d, inter), **kw)
        add(p + "ffn.shared_experts.w13", (2 * inter, d), in_file=False, **kw)
        rate = 0 if mtp else cfg.compress_rate(layer)  # MTP blocks: plain sliding-window attention
        csa = not mtp and cfg.is_csa(layer)
        if rate:
            c = 2 if csa else 1
            for proj in ("wkv", "wgate"):
                add(p + f"attn.compressor.{proj}.weight", (c * hd, d), **kw)
            add(p + "attn.compressor.ape", (rate, c * hd), **kw)
            add(p + "attn.compressor.norm.weight", (hd,), **kw)
        if csa:
            ih, idim = cfg.index_n_heads, cfg.index_head_dim
            add(p + "attn.indexer.wq_b.weight", (ih * idim, qr), **kw)
            add(p + "attn.indexer.weights_proj.weight", (ih, d), **kw)
            for proj in ("wkv", "wgate"):
                add(p + f"attn.indexer.compressor.{proj}.weight", (2 * idim, d), **kw)
            add(p + "attn.indexer.compressor.ape", (rate, 2 * idim), **kw)
            add(p + "attn.indexer.compressor.norm.weight", (idim,), **kw)
        if not mtp and cfg.mlp_layer_types[layer] == "hash_moe":
            add(p + "ffn.gate.tid2eid", (v, cfg.num_experts_per_tok), integer=True, **kw)
        else:
            add(p + "ffn.gate.bias", (ne,), **kw)
        if mtp and cfg.dspark is not None:
            _dspark_rows(cfg, p, int(p.split(".")[1]), add, **kw)
        elif mtp:
            add(p + "e_proj.weight", (d, d), **kw)
            add(p + "h_proj.weight", (d, d), **kw)
            for norm in ("enorm", "hnorm", "norm"):
                add(p + f"{norm}.weight", (d,), **kw)
            add(p + "hc_head_fn", (n, n * d), **kw)
            add(p + "hc_head_base", (n,), **kw)
            add(p + "hc_head_scale", (1,), **kw)
    tied = {"head.weight": "embed.weight"} if cfg.tie_word_embeddings else {}
    return CheckpointManifest.of(rows, renames=RENAMES, ignored=IGNORED, tied=tied)


def _dspark_rows(cfg: DeepseekV4Config, p: str, stage: int, add, **kw) -> None:
    """A DSpark stage's own tensors beside its block: ``main_proj``/``main_norm`` on the first, the output
    collapse, norm, Markov and confidence heads on the last."""
    d, n, v = cfg.hidden_size, cfg.hc_mult, cfg.vocab_size
    spec = cfg.dspark
    if stage == 0:
        add(p + "main_proj.weight", (d, d * len(spec.target_layer_ids)), **kw)
        add(p + "main_norm.weight", (d,), **kw)
    if stage == spec.stages - 1:
        add(p + "hc_head_fn", (n, n * d), **kw)
        add(p + "hc_head_base", (n,), **kw)
        add(p + "hc_head_scale", (1,), **kw)
        add(p + "norm.weight", (d,), **kw)
        add(p + "markov_head.embed.weight", (v, spec.markov_rank), **kw)
        add(p + "markov_head.head.weight", (v, spec.markov_rank), **kw)
        add(p + "confidence_head.proj.weight", (1, d + spec.markov_rank), **kw)

"""DeepSeek-V4.1's config, from either published form, and its cache layout as data.

Two forms describe one model: the Hugging Face ``config.json`` (``architectures:
["DeepseekV41ForCausalLM"]``, ``model_type: "deepseek_v41"``, the text model under ``text_config``, the
vision tower under ``vision_config``, ``quantization_config`` at the top) and DeepSeek's flat
``inference/config.json`` (``ModelArgs`` field names: ``dim``, ``n_layers``, ``kv_source_layers``, ...).
Both parse to one :class:`DeepseekV41Config` whose attributes carry the Hugging Face names the engine
reads (``hidden_size``, ``num_hidden_layers``, ``sliding_window``, ...).

Layer roles (DeepSeek's ``inference/model.py``): every layer keeps a private sliding window; a layer
with ``compress_ratios[i] > 0`` also attends compressed KV, which only the ``kv_source_layer_ids`` write
(each reader reads the nearest source at or below it); ``index_source_layer_ids`` run an indexer (the
rest reuse the top-k of the nearest index source below), whose keys come from the KV source's latent;
index sources after ``candidate_source_layer_id`` rank only inside the candidate blocks it chose.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from deepinfer_core.config import ModelConfig
from deepinfer_core.model.cache_layout import BranchSpec, CacheLayout
from deepinfer_core.model.errors import UnsupportedModelError

#: DeepSeek's flat ``inference/config.json`` name -> the Hugging Face ``text_config`` name
FLAT_NAMES = {
    "vocab_size": "vocab_size", "dim": "hidden_size", "moe_inter_dim": "moe_intermediate_size",
    "n_layers": "num_hidden_layers", "n_mtp_layers": "num_nextn_predict_layers", "n_heads": "num_attention_heads",
    "n_routed_experts": "n_routed_experts", "n_shared_experts": "n_shared_experts",
    "n_activated_experts": "num_experts_per_tok", "score_func": "scoring_func", "route_scale": "routed_scaling_factor",
    "swiglu_limit": "swiglu_limit", "q_lora_rank": "q_lora_rank", "head_dim": "head_dim",
    "rope_head_dim": "qk_rope_head_dim", "norm_eps": "rms_norm_eps", "o_groups": "o_groups",
    "o_lora_rank": "o_lora_rank", "window_size": "sliding_window", "kv_source_layers": "kv_source_layer_ids",
    "index_source_layers": "index_source_layer_ids", "rope_theta": "rope_theta",
    "compress_rope_theta": "compress_rope_theta", "index_n_heads": "index_n_heads",
    "index_head_dim": "index_head_dim", "index_topk": "index_topk",
    "candidate_source_layer": "candidate_source_layer_id", "candidate_topk_blocks": "candidate_topk_blocks",
    "candidate_block_size": "candidate_block_size", "hc_mult": "hc_mult", "hc_sinkhorn_iters": "hc_sinkhorn_iters",
    "hc_eps": "hc_eps", "compress_ratios": "compress_ratios", "engram_layer_ids": "engram_layer_ids",
    "engram_vocab_size": "engram_vocab_size", "engram_num_embeddings": "engram_num_embeddings",
    "engram_max_ngram_size": "engram_max_ngram_size", "engram_pad_id": "engram_pad_token_id",
    "engram_compressed_vocab_size": "engram_compressed_vocab_size", "engram_n_heads": "engram_n_heads",
    "engram_head_dim": "engram_head_dim", "dspark_block_size": "dspark_block_size",
    "dspark_noise_token_id": "dspark_noise_token_id", "dspark_target_layer_ids": "dspark_target_layer_ids",
    "dspark_markov_rank": "dspark_markov_rank", "dspark_n_routed_experts": "dspark_n_routed_experts",
    "dspark_n_activated_experts": "dspark_n_activated_experts", "image_token_id": "image_token_id",
}
#: the flat form's YaRN fields -> ``rope_scaling`` keys
FLAT_ROPE = {"rope_factor": "factor", "beta_fast": "beta_fast", "beta_slow": "beta_slow",
             "original_seq_len": "original_max_position_embeddings"}
#: the flat form's vision fields -> ``vision_config`` keys
FLAT_VISION = {"vision_n_layers": "num_hidden_layers", "vision_dim": "hidden_size", "vision_n_heads": "num_heads",
               "vision_inter_dim": "intermediate_size", "vision_patch_size": "patch_size",
               "vision_rope_theta": "rope_theta", "vision_downsample_ratio": "downsample_ratio",
               "vision_max_n_token": "max_image_tokens", "vision_min_pixels": "min_pixels",
               "vision_max_wh_ratio": "max_wh_ratio"}
#: keys only the flat form has: how the registry recognises it (it names no architecture)
FLAT_KEYS = ("kv_source_layers", "index_source_layers", "compress_ratios", "n_layers")

#: defaults where a config omits a field (DeepSeek's ModelArgs values that are the release's too)
DEFAULTS: dict[str, Any] = {
    "n_shared_experts": 1, "scoring_func": "sqrtsoftplus", "norm_topk_prob": True, "routed_scaling_factor": 1.0,
    "swiglu_limit": 0.0, "rms_norm_eps": 1e-20, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "rope_theta": 10000.0, "compress_rope_theta": 160000.0, "rope_scaling": None,
    "candidate_source_layer_id": -1, "candidate_topk_blocks": 0, "candidate_block_size": 0,
    "engram_layer_ids": [], "engram_num_embeddings": [], "engram_max_ngram_size": 1, "engram_vocab_size": 0,
    "engram_n_heads": 0, "engram_head_dim": 0, "engram_pad_token_id": 2, "engram_compressed_vocab_size": 0,
    "num_nextn_predict_layers": 0, "dspark_block_size": 0, "dspark_noise_token_id": 0,
    "dspark_target_layer_ids": [], "dspark_markov_rank": 256, "dspark_n_routed_experts": 0,
    "dspark_n_activated_experts": 0, "image_token_id": 129264, "tie_word_embeddings": False,
    "max_position_embeddings": 1 << 20, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
    "num_key_value_heads": 1, "hidden_act": "silu", "topk_method": "noaux_tc",
}
REQUIRED = ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
            "head_dim", "qk_rope_head_dim", "q_lora_rank", "o_lora_rank", "o_groups", "n_routed_experts",
            "num_experts_per_tok", "sliding_window", "compress_ratios", "kv_source_layer_ids",
            "index_source_layer_ids", "index_n_heads", "index_head_dim", "index_topk")


def _from_flat(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any] | None]:
    """(text fields, quantization_config, vision_config) of DeepSeek's flat ``inference/config.json``."""
    text = {hf: raw[flat] for flat, hf in FLAT_NAMES.items() if flat in raw}
    if raw.get("original_seq_len", 0) > 0:
        text["rope_scaling"] = {"rope_type": "yarn", **{k: raw[f] for f, k in FLAT_ROPE.items() if f in raw}}
    quant = None
    if raw.get("dtype") == "fp8":
        quant = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
                 "scale_fmt": "ue8m0", **({"expert_dtype": raw["expert_dtype"]} if raw.get("expert_dtype") else {})}
    vision = None
    if raw.get("vision_n_layers", 0) > 0:
        vision = {hf: raw[flat] for flat, hf in FLAT_VISION.items() if flat in raw}
    return text, quant, vision


def _from_hf(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any] | None]:
    text = dict(raw.get("text_config") or {k: v for k, v in raw.items() if k not in ("vision_config",)})
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "image_token_id", "tie_word_embeddings"):
        if key in raw and key not in text:
            text[key] = raw[key]
    if "rope_scaling" not in text and isinstance(text.get("rope_parameters"), dict):
        text["rope_scaling"] = text["rope_parameters"]  # transformers 5 writes the same dict under this name
    vision = raw.get("vision_config")
    return text, raw.get("quantization_config"), vision if vision and vision.get("num_hidden_layers", 1) else None


@dataclass
class DeepseekV41Config(ModelConfig):
    """DeepSeek-V4.1 hyper-parameters (``hf_config``: a namespace of the text model's fields, Hugging Face
    names), checked for consistency when parsed."""

    @classmethod
    def parse(cls, path: Path, raw: dict[str, Any]) -> DeepseekV41Config:
        return cls.from_dict(raw, path)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], path: Path | None = None) -> DeepseekV41Config:
        where = str(path / "config.json") if path is not None else "the config"
        flat = "text_config" not in raw and all(k in raw for k in FLAT_KEYS)
        text, quant, vision = (_from_flat if flat else _from_hf)(raw)
        missing = [k for k in REQUIRED if k not in text]
        if missing:
            raise UnsupportedModelError(f"{where}: DeepSeek-V4.1 config lacks {missing}")
        fields = {**DEFAULTS, **text}
        for key in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids",
                    "engram_num_embeddings", "dspark_target_layer_ids"):
            fields[key] = [int(v) for v in fields[key] or []]
        fields.update(architectures=["DeepseekV41ForCausalLM"], model_type="deepseek_v41",
                      quantization_config=quant, vision_config=vision)
        cfg = cls(SimpleNamespace(**fields), path)
        cfg.validate(where)
        return cfg

    @property
    def architecture(self) -> Any:
        from deepinfer_core.models.registry import get_architecture

        return get_architecture("DeepseekV41ForCausalLM")

    def to_dict(self) -> dict[str, Any]:
        """The Hugging Face form of this config (``text_config`` nested), as :meth:`from_dict` reads it."""
        text = {k: v for k, v in vars(self.hf_config).items()
                if k not in ("architectures", "model_type", "quantization_config", "vision_config")}
        out: dict[str, Any] = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
                               "text_config": {"model_type": "deepseek_v41_text", **text}}
        for key in ("bos_token_id", "eos_token_id", "pad_token_id", "image_token_id", "tie_word_embeddings"):
            out[key] = text[key]
        if self.quantization_config:
            out["quantization_config"] = self.quantization_config
        if self.vision_config:
            out["vision_config"] = self.vision_config
        return out

    def to_flat(self) -> dict[str, Any]:
        """DeepSeek's flat ``inference/config.json`` form of this config (``ModelArgs`` field names)."""
        out = {flat: getattr(self.hf_config, hf) for flat, hf in FLAT_NAMES.items()}
        scaling = self.rope_scaling or {}
        out.update({flat: scaling[key] for flat, key in FLAT_ROPE.items() if key in scaling})
        out.setdefault("original_seq_len", 0)
        quant = self.quantization_config or {}
        out["dtype"] = "fp8" if quant.get("quant_method") == "fp8" else "bf16"
        out["expert_dtype"] = quant.get("expert_dtype")
        out["norm_topk_prob"] = self.norm_topk_prob
        if self.vision_config:
            vision = self.vision_config
            out.update({flat: vision[key] for flat, key in FLAT_VISION.items() if key in vision})
        else:
            out["vision_n_layers"] = 0
        return out

    # --- the questions the engine asks ----------------------------------------------------------------

    @property
    def rope_dim(self) -> int:
        return int(self.qk_rope_head_dim)

    @property
    def num_layers_with_drafter(self) -> int:
        return self.num_hidden_layers + (self.num_nextn_predict_layers if self.dspark_block_size else 0)

    def compress_rate(self, layer: int) -> int:
        """Compression ratio of ``layer`` (0: window only); the drafter's stages are window only."""
        return self.compress_ratios[layer] if layer < self.num_hidden_layers else 0

    def kv_source(self, layer: int) -> int | None:
        """The layer whose compressed KV ``layer`` reads (itself for a source), None for window-only."""
        if not self.compress_rate(layer):
            return None
        return max(s for s in self.kv_source_layer_ids if s <= layer)

    def index_source(self, layer: int) -> int | None:
        """The index source whose top-k ``layer`` uses (itself for one), None for window-only layers."""
        if not self.compress_rate(layer):
            return None
        return max(s for s in self.index_source_layer_ids if s <= layer)

    def uses_candidates(self, layer: int) -> bool:
        """Does index source ``layer`` rank only inside the candidate blocks?"""
        return 0 <= self.candidate_source_layer_id < layer and layer in self.index_source_layer_ids

    @property
    def has_engram(self) -> bool:
        return bool(self.engram_layer_ids)

    @property
    def moe_config(self) -> tuple[int, int]:
        return self.n_routed_experts, self.num_experts_per_tok

    def drafter_moe_config(self) -> tuple[int, int]:
        """(routed experts, activated) of the DSpark stages."""
        return (self.dspark_n_routed_experts or self.n_routed_experts,
                self.dspark_n_activated_experts or self.num_experts_per_tok)

    def validate(self, where: str = "the config") -> None:
        """An :class:`UnsupportedModelError` naming the first inconsistency between the layer lists."""
        n = self.num_hidden_layers
        ratios = self.compress_ratios
        drafter = self.num_nextn_predict_layers if self.dspark_block_size else 0

        def fail(msg: str) -> None:
            raise UnsupportedModelError(f"{where}: {msg}")

        if len(ratios) < n:
            fail(f"compress_ratios has {len(ratios)} entries for {n} layers")
        if any(r < 0 for r in ratios):
            fail(f"compress_ratios holds a negative ratio: {ratios}")
        if any(ratios[i] for i in range(n, len(ratios))):
            fail(f"compress_ratios gives the drafter's layers {ratios[n:]}; they are window-only (0)")
        for name in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids", "dspark_target_layer_ids"):
            ids = getattr(self, name)
            bad = [i for i in ids if not 0 <= i < n]
            if bad:
                fail(f"{name} {ids} holds ids outside the {n} layers: {bad}")
            if len(set(ids)) != len(ids) or ids != sorted(ids):
                fail(f"{name} {ids} must be strictly increasing")
        for name in ("kv_source_layer_ids", "index_source_layer_ids"):
            zero = [i for i in getattr(self, name) if not ratios[i]]
            if zero:
                fail(f"{name} names layers whose compress ratio is 0: {zero}")
        for layer in range(n):
            rate = ratios[layer]
            if not rate:
                continue
            kv = [s for s in self.kv_source_layer_ids if s <= layer]
            if not kv:
                fail(f"layer {layer} (ratio {rate}) has no KV source at or below it in {self.kv_source_layer_ids}")
            if ratios[kv[-1]] != rate:
                fail(f"layer {layer} (ratio {rate}) would read KV source {kv[-1]}, whose ratio is {ratios[kv[-1]]}")
            ix = [s for s in self.index_source_layer_ids if s <= layer]
            if not ix:
                fail(f"layer {layer} (ratio {rate}) has no index source at or below it")
            if ratios[ix[-1]] != rate:
                fail(f"layer {layer} (ratio {rate}) would reuse the top-k of index source {ix[-1]}, whose ratio "
                     f"is {ratios[ix[-1]]}")
            if self.kv_source(ix[-1]) != kv[-1]:
                fail(f"index source {ix[-1]} scores the keys of KV source {self.kv_source(ix[-1])}, but layer "
                     f"{layer} attends KV source {kv[-1]}")
        c = self.candidate_source_layer_id
        if c >= 0:
            if c >= n or c not in self.index_source_layer_ids:
                fail(f"candidate_source_layer_id {c} is not an index source {self.index_source_layer_ids}")
            if self.candidate_block_size <= 0 or self.candidate_topk_blocks <= 0:
                fail("a candidate source needs candidate_block_size and candidate_topk_blocks > 0")
            if self.candidate_block_size * self.candidate_topk_blocks < self.index_topk:
                fail(f"candidate_topk_blocks {self.candidate_topk_blocks} x candidate_block_size "
                     f"{self.candidate_block_size} cannot hold index_topk {self.index_topk}")
            later = [i for i in self.index_source_layer_ids if i > c and ratios[i] != ratios[c]]
            if later:
                fail(f"index sources {later} rank inside layer {c}'s candidates but their ratio differs")
        if self.engram_layer_ids:
            if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
                fail(f"engram_num_embeddings {self.engram_num_embeddings} needs one row count per Engram layer "
                     f"{self.engram_layer_ids}")
            if self.engram_max_ngram_size < 2 or self.engram_n_heads <= 0 or self.engram_head_dim % 32:
                fail("Engram needs engram_max_ngram_size >= 2, engram_n_heads > 0 and engram_head_dim a "
                     "multiple of 32")
        if drafter and len(self.dspark_target_layer_ids) == 0:
            fail("the DSpark drafter needs dspark_target_layer_ids")
        if self.num_experts_per_tok > self.n_routed_experts:
            fail(f"num_experts_per_tok {self.num_experts_per_tok} exceeds n_routed_experts {self.n_routed_experts}")


def layer_branches(cfg: DeepseekV41Config) -> list[dict[str, BranchSpec | int]]:
    """Per layer (the drafter's stages last): a KV source owns its compressed-KV branch (ratio 2: a
    stateful ring of the group's projected rows; ratio 1: stateless) and its index keys; every other
    layer with ratio > 0 reads its source's pools."""
    layers: list[dict[str, BranchSpec | int]] = []
    for layer in range(cfg.num_hidden_layers):
        rate = cfg.compress_rate(layer)
        if not rate:
            layers.append({})
            continue
        source = cfg.kv_source(layer)
        if source != layer:
            layers.append({"kv": source, "index": source})
            continue
        layers.append({
            "kv": BranchSpec(rate, cfg.head_dim, overlap=False, kind="kv", stateful=rate > 1),
            "index": BranchSpec(rate, cfg.index_head_dim, overlap=False, kind="index", stateful=False,
                                kv_entry=False),
        })
    layers += [{} for _ in range(cfg.num_layers_with_drafter - cfg.num_hidden_layers)]
    return layers


def cache_layout(cfg: DeepseekV41Config) -> CacheLayout:
    return CacheLayout.build(layer_branches(cfg))

"""DeepSeek-V4's config: transformers' ``DeepseekV4Config`` read through, with the per-layer questions
the engine asks of it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deepinfer_core.config import ModelConfig
from deepinfer_core.model.cache_layout import BranchSpec, CacheLayout
from deepinfer_core.model.errors import UnsupportedModelError
from deepinfer_core.models.deepseek_v4.dspark_config import DSparkSpec, dspark_spec, validate

#: keys a config.json must give: transformers' defaults for them are one model size's (they fix the
#: tensor shapes and the per-layer schedule), so a default could not match another checkpoint and would
#: only surface later as a tensor of the wrong shape. A tuple's names stand for one another (transformers
#: folds the older ones DeepSeek's configs ship into the first). Design constants every V4 shares
#: (hc_mult, compress_rates, n_shared_experts, ...) keep their defaults.
REQUIRED: tuple[str | tuple[str, ...], ...] = (
    "vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads", "head_dim",
    "q_lora_rank", "o_lora_rank", "o_groups", "n_routed_experts", "num_experts_per_tok", "sliding_window",
    "index_n_heads", "index_head_dim", "index_topk", ("layer_types", "compress_ratios"),
    ("mlp_layer_types", "num_hash_layers"), ("partial_rotary_factor", "qk_rope_head_dim"),
)


def missing_keys(raw: dict[str, Any]) -> list[str]:
    """The :data:`REQUIRED` keys ``raw`` lacks (null counts as missing), each as config.json would name it."""
    missing = []
    for key in REQUIRED:
        names = (key,) if isinstance(key, str) else key
        if all(raw.get(name) is None for name in names):
            missing.append(names[0] + "".join(f" (or {n})" for n in names[1:]))
    return missing


class DeepseekV4Config(ModelConfig):
    """DeepSeek-V4 hyper-parameters, read through transformers' ``DeepseekV4Config``."""

    @classmethod
    def parse(cls, path: Path, raw: dict[str, Any]) -> DeepseekV4Config:
        from transformers import DeepseekV4Config as HFConfig

        missing = missing_keys(raw)
        if missing:
            raise UnsupportedModelError(f"{path / 'config.json'}: DeepSeek-V4 config lacks {', '.join(missing)} "
                                        "(no default fits every checkpoint)")
        try:
            hf_config = HFConfig.from_pretrained(str(path))
        except Exception as exc:
            raise UnsupportedModelError(f"invalid DeepSeek-V4 config in {path / 'config.json'}: {exc}") from exc
        cfg = cls(hf_config, path)
        if cfg.dspark is not None:
            validate(cfg.dspark, hf_config, raw, str(path / "config.json"))
        return cfg

    @property
    def architecture(self) -> Any:
        from deepinfer_core.models.registry import get_architecture

        return get_architecture("DeepseekV4ForCausalLM")

    @property
    def rope_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    # --- the drafter: one MTP layer (V4-Flash) or DSpark stages (V4-Flash-0731, :mod:`.dspark_config`) ---

    @property
    def dspark(self) -> DSparkSpec | None:
        """The DSpark drafter this config declares, None for a plain V4 (MTP) config."""
        return dspark_spec(self.hf_config)

    @property
    def num_nextn_predict_layers(self) -> int:
        """The drafter's layers: the DSpark stages (0731's ``n_mtp_layers``, where the root config still says
        1), else the MTP layers."""
        spec = self.dspark
        return spec.stages if spec is not None else self.hf_config.num_nextn_predict_layers

    @property
    def drafter_methods(self) -> tuple[str, ...]:
        """The speculative methods this checkpoint's drafter serves: its mtp.* layers are DSpark stages or
        one MTP layer."""
        return ("dspark",) if self.dspark is not None else ("mtp",)

    @property
    def dspark_block_size(self) -> int:
        """Positions a DSpark draft holds; 0 without DSpark stages."""
        spec = self.dspark
        return spec.block_size if spec is not None else 0

    @property
    def dspark_noise_token_id(self) -> int:
        return self.dspark.noise_token_id

    @property
    def dspark_target_layer_ids(self) -> list[int]:
        """The layers whose outputs (hc-mean) the DSpark drafter reads; none without DSpark stages."""
        spec = self.dspark
        return list(spec.target_layer_ids) if spec is not None else []

    @property
    def dspark_markov_rank(self) -> int:
        return self.dspark.markov_rank

    def drafter_moe_config(self) -> tuple[int, int]:
        """(routed experts, activated) of the drafter's MoE: the DSpark stages', else the target's."""
        spec = self.dspark
        return (spec.num_experts, spec.top_k) if spec is not None else (self.n_routed_experts,
                                                                          self.num_experts_per_tok)

    def compress_rate(self, layer: int) -> int:
        layer_type = self.layer_types[layer]
        return 0 if layer_type == "sliding_attention" else int(self.compress_rates[layer_type])

    def is_csa(self, layer: int) -> bool:
        return self.layer_types[layer] == "compressed_sparse_attention"


def layer_branches(cfg: DeepseekV4Config) -> list[dict[str, BranchSpec | int]]:
    """Per layer (MTP blocks last), the branches it owns (:meth:`CacheLayout.build`'s form): CSA and HCA
    layers a compressed-KV branch (CSA: overlapping windows, plus indexer keys), sliding-window layers
    and MTP blocks none."""
    layers: list[dict[str, BranchSpec | int]] = []
    for layer in range(cfg.num_hidden_layers):
        rate = cfg.compress_rate(layer)
        if not rate:
            layers.append({})
            continue
        csa = cfg.is_csa(layer)
        branches: dict[str, BranchSpec | int] = {"kv": BranchSpec(rate, cfg.head_dim, overlap=csa, kind="kv")}
        if csa:
            branches["index"] = BranchSpec(rate, cfg.index_head_dim, overlap=True, kind="index", kv_entry=False)
        layers.append(branches)
    layers += [{} for _ in range(cfg.num_nextn_predict_layers or 0)]
    return layers


def cache_layout(cfg: DeepseekV4Config) -> CacheLayout:
    """Every layer owns its window pool and the branches of :func:`layer_branches`."""
    return CacheLayout.build(layer_branches(cfg))

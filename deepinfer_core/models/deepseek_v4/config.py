"""DeepSeek-V4's config: transformers' ``DeepseekV4Config`` read through, with the per-layer questions
the engine asks of it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deepinfer_core.config import ModelConfig
from deepinfer_core.model.cache_layout import BranchSpec, CacheLayout
from deepinfer_core.model.errors import UnsupportedModelError


class DeepseekV4Config(ModelConfig):
    """DeepSeek-V4 hyper-parameters, read through transformers' ``DeepseekV4Config``."""

    @classmethod
    def parse(cls, path: Path, raw: dict[str, Any]) -> DeepseekV4Config:
        from transformers import DeepseekV4Config as HFConfig

        try:
            hf_config = HFConfig.from_pretrained(str(path))
        except Exception as exc:
            raise UnsupportedModelError(f"invalid DeepSeek-V4 config in {path / 'config.json'}: {exc}") from exc
        return cls(hf_config, path)

    @property
    def architecture(self) -> Any:
        from deepinfer_core.models.registry import get_architecture

        return get_architecture("DeepseekV4ForCausalLM")

    @property
    def rope_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

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

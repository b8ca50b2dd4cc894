"""DeepSeek-V4's config: transformers' ``DeepseekV4Config`` read through, with the per-layer questions
the engine asks of it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deepinfer_core.config import ModelConfig
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
        from deepinfer_core.models.deepseek_v4 import ARCHITECTURE

        return ARCHITECTURE

    @property
    def rope_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def compress_rate(self, layer: int) -> int:
        layer_type = self.layer_types[layer]
        return 0 if layer_type == "sliding_attention" else int(self.compress_rates[layer_type])

    def is_csa(self, layer: int) -> bool:
        return self.layer_types[layer] == "compressed_sparse_attention"

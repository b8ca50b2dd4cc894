"""DeepSeek-V4(-Flash): config, checkpoint manifest, weight records, cache layout and forward."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from deepinfer_core.models.deepseek_v4.config import DeepseekV4Config, cache_layout
from deepinfer_core.models.deepseek_v4.dspark import DeepseekV4DSpark
from deepinfer_core.models.deepseek_v4.manifest import manifest
from deepinfer_core.models.deepseek_v4.model import NUMERICS, DeepseekV4Model
from deepinfer_core.models.deepseek_v4.mtp import DeepseekV4MTP
from deepinfer_core.models.deepseek_v4.weights import ModelWeights, build_weights, stack_shared_experts
from deepinfer_core.models.registry import Architecture


def default_numerics(cfg: DeepseekV4Config) -> str:
    """``"deepseek"`` where config.json carries ``quantization_config`` (the published checkpoint, which
    was trained with DeepSeek's quantisation steps), else ``"transformers"``."""
    return "deepseek" if getattr(cfg, "quantization_config", None) else "transformers"


def load_model(cfg: DeepseekV4Config, path: Path, ops: Any, dtype: torch.dtype, device: torch.device | str,
               hook: Any, quantization: str | None, numerics: str, experts: range | None,
               show_progress: bool) -> DeepseekV4Model:
    """The weights in ``path`` on ``device`` as a model running ``ops``; see
    :func:`deepinfer_core.models.load_model` for the options."""
    from deepinfer_core.model.loader import load_weights

    weights = load_weights(cfg, path, dtype, device, keep_fp8=quantization == "fp8", show_progress=show_progress,
                           hook=hook, experts=experts, keep_fp4=quantization == "fp8" or numerics == "deepseek",
                           numerics=numerics)
    return DeepseekV4Model(cfg, weights, ops, dtype, numerics=numerics)


ARCHITECTURE = Architecture(
    name="DeepseekV4ForCausalLM",
    model_types=("deepseek_v4",),
    config_class=DeepseekV4Config,
    manifest=manifest,
    cache_layout=cache_layout,
    load_model=load_model,
    default_numerics=default_numerics,
    numerics=NUMERICS,
    build_weights=build_weights,
    prepare_params=stack_shared_experts,
    # V4-Flash: one MTP layer; V4-Flash-0731: DSpark stages (a config has one or the other)
    drafters={"mtp": DeepseekV4MTP, "dspark": DeepseekV4DSpark},
    kv_layouts={"deepseek": "fp8_ds"},
)

__all__ = ["ARCHITECTURE", "NUMERICS", "DeepseekV4Config", "DeepseekV4Model", "ModelWeights", "default_numerics",
           "DeepseekV4DSpark", "DeepseekV4MTP", "load_model", "manifest"]

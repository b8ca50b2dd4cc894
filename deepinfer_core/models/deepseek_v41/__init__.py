"""DeepSeek-V4.1(-Flash): config, checkpoint manifest, weight records, cache layout and forward."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from deepinfer_core.model.errors import UnsupportedModelError
from deepinfer_core.models.deepseek_v41.config import DeepseekV41Config, cache_layout
from deepinfer_core.models.deepseek_v41.dspark import DeepseekV41DSpark
from deepinfer_core.models.deepseek_v41.manifest import manifest
from deepinfer_core.models.deepseek_v41.model import NUMERICS, DeepseekV41Model
from deepinfer_core.models.deepseek_v41.weights import ModelWeights, build_weights, stack_shared_experts
from deepinfer_core.models.registry import Architecture


def default_numerics(cfg: DeepseekV41Config) -> str:
    """``"deepseek"``: the release was trained with its quantisation steps."""
    return "deepseek"


def load_model(cfg: DeepseekV41Config, path: Path, ops: Any, dtype: torch.dtype, device: torch.device | str,
               hook: Any, quantization: str | None, numerics: str, experts: range | None,
               show_progress: bool) -> DeepseekV41Model:
    """The weights in ``path`` on ``device`` as a model running ``ops``: packed FP4 routed experts stay packed
    under deepseek numerics, everything else is dequantised to ``dtype``."""
    from deepinfer_core.model.loader import load_weights

    if quantization is not None:
        raise UnsupportedModelError(f"quantization={quantization!r} is not supported for DeepSeek-V4.1 yet: its "
                                    "weights are dequantised on load (quantization=None)")
    weights = load_weights(cfg, path, dtype, device, keep_fp8=False, show_progress=show_progress, hook=hook,
                           experts=experts, keep_fp4=numerics == "deepseek", numerics=numerics)
    engram_hash = None
    if cfg.has_engram:
        from deepinfer_core.models.deepseek_v41.engram import engram_hasher

        engram_hash = engram_hasher(cfg, path, device)
    return DeepseekV41Model(cfg, weights, ops, dtype, numerics=numerics, engram_hash=engram_hash)


ARCHITECTURE = Architecture(
    name="DeepseekV41ForCausalLM",
    model_types=("deepseek_v41",),
    config_class=DeepseekV41Config,
    manifest=manifest,
    cache_layout=cache_layout,
    load_model=load_model,
    default_numerics=default_numerics,
    numerics=NUMERICS,
    build_weights=build_weights,
    prepare_params=stack_shared_experts,
    kv_layouts={"deepseek": "fp4_ds"},
    drafters={"dspark": DeepseekV41DSpark},
)

__all__ = ["ARCHITECTURE", "NUMERICS", "DeepseekV41Config", "DeepseekV41Model", "ModelWeights", "load_model",
           "manifest"]

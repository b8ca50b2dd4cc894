"""DeepSeek-V4 built from resolved ops: loader, cache tensors, per-step metadata, forward."""

from __future__ import annotations

from pathlib import Path

import torch

from deepinfer_core.config import ModelConfig
from deepinfer_core.model.deepseek_v4 import DeepseekV4Model
from deepinfer_core.model.loader import load_weights
from deepinfer_core.model.weights import ModelWeights
from deepinfer_core.plugins import build_op_table


def load_model(
    path: str | Path,
    backend: str = "cpu_ref",
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    allow_reference_fallback: bool = False,
    show_progress: bool = False,
    batch_invariant: bool = False,
    quantization: str | None = None,
) -> DeepseekV4Model:
    """Read the config and weights in ``path`` and build the model on ``backend``'s ops (their
    batch-invariant implementations with ``batch_invariant``); ``quantization="fp8"`` keeps (or makes)
    the linear and expert weights E4M3 with 128x128 block scales."""
    from deepinfer_core.plugins import load_backend

    if quantization not in (None, "fp8"):
        raise ValueError(f"unknown quantization {quantization!r}; expected None or 'fp8'")
    path = Path(path)
    cfg = ModelConfig.from_pretrained(path)
    ops = build_op_table(backend, dtype=dtype, device=device, model_config=cfg,
                         allow_reference_fallback=allow_reference_fallback, batch_invariant=batch_invariant)
    weights = load_weights(cfg, path, dtype, device, keep_fp8=quantization == "fp8", show_progress=show_progress,
                           hook=load_backend(backend).hook)
    return DeepseekV4Model(cfg, weights, ops, dtype)


__all__ = ["DeepseekV4Model", "ModelConfig", "ModelWeights", "load_model"]

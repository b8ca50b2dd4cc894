"""DeepSeek-V4 built from resolved ops: loader, cache tensors, per-step metadata, forward."""

from __future__ import annotations

from pathlib import Path

import torch

from deepinfer_core.config import ModelConfig
from deepinfer_core.model.deepseek_v4 import NUMERICS, DeepseekV4Model
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
    numerics: str | None = None,
    experts: range | None = None,
) -> DeepseekV4Model:
    """Read the config and weights in ``path`` and build the model on ``backend``'s ops (their
    batch-invariant implementations with ``batch_invariant``). ``quantization="fp8"`` keeps (or makes)
    the linear and expert weights E4M3 with 128x128 block scales and keeps packed FP4 experts packed;
    None dequantises everything on the device (but packed FP4 experts under deepseek numerics); under
    deepseek numerics FP8 mode keeps only the projections DeepSeek's model.py runs in FP8, through
    ``linear_fp8_ue8m0`` (power-of-two activation scales). ``numerics``: ``"transformers"`` or ``"deepseek"``
    (:data:`~deepinfer_core.model.deepseek_v4.NUMERICS`); by default ``"deepseek"`` for a checkpoint
    whose config.json carries ``quantization_config``, ``"transformers"`` otherwise. ``experts``: load only
    these routed experts (a contiguous range of ids; expert parallelism)."""
    from deepinfer_core.plugins import load_backend

    if quantization not in (None, "fp8"):
        raise ValueError(f"unknown quantization {quantization!r}; expected None or 'fp8'")
    path = Path(path)
    cfg = ModelConfig.from_pretrained(path)
    if numerics is None:
        numerics = default_numerics(cfg)
    if numerics not in NUMERICS:
        raise ValueError(f"unknown numerics {numerics!r}; expected one of {NUMERICS}")
    ops = build_op_table(backend, dtype=dtype, device=device, model_config=cfg,
                         allow_reference_fallback=allow_reference_fallback, batch_invariant=batch_invariant)
    weights = load_weights(cfg, path, dtype, device, keep_fp8=quantization == "fp8", show_progress=show_progress,
                           hook=load_backend(backend).hook, experts=experts,
                           keep_fp4=quantization == "fp8" or numerics == "deepseek", numerics=numerics)
    return DeepseekV4Model(cfg, weights, ops, dtype, numerics=numerics)


def default_numerics(cfg: ModelConfig) -> str:
    """``"deepseek"`` where config.json carries ``quantization_config`` (the published checkpoint, which
    was trained with DeepSeek's quantisation steps), else ``"transformers"``."""
    return "deepseek" if getattr(cfg, "quantization_config", None) else "transformers"


__all__ = ["NUMERICS", "DeepseekV4Model", "ModelConfig", "ModelWeights", "default_numerics", "load_model"]

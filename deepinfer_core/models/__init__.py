"""Every architecture deepinfer serves, behind one registry (:mod:`deepinfer_core.models.registry`), and
:func:`load_model`, which reads a checkpoint folder with the architecture its config.json names."""

from __future__ import annotations

from pathlib import Path

import torch

from deepinfer_core.config import ModelConfig
from deepinfer_core.models.interface import Model
from deepinfer_core.models.registry import Architecture, register_architecture, resolve_architecture


def default_numerics(cfg: ModelConfig) -> str:
    """The numerics a checkpoint of ``cfg`` runs in by default (its architecture decides)."""
    return cfg.architecture.default_numerics(cfg)


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
    engram_placement: str | None = None,
    engram_shard: bool = False,
    drafter_experts: range | None = None,
) -> Model:
    """Read the config and weights in ``path`` and build the model its config.json names on ``backend``'s
    ops (their batch-invariant implementations with ``batch_invariant``). ``quantization="fp8"`` keeps
    (or makes) the linear and expert weights E4M3 with 128x128 block scales and keeps packed FP4 experts
    packed; None dequantises everything on the device (but packed FP4 experts under deepseek numerics);
    under deepseek numerics FP8 mode keeps only the projections DeepSeek's model.py runs in FP8, through
    ``linear_fp8_ue8m0`` (power-of-two activation scales). ``numerics``: one of the architecture's (V4:
    ``"transformers"`` or ``"deepseek"``); by default ``"deepseek"`` for a checkpoint whose config.json
    carries ``quantization_config``, ``"transformers"`` otherwise. ``experts``: load only these routed
    experts (a contiguous range of ids; expert parallelism). ``engram_placement`` (``"device"``, ``"host"``,
    ``"file"``; None: the memory plan's) and ``engram_shard``: where a model with Engram tables keeps them.
    ``drafter_experts``: load only these of a drafter's own routed experts (DSpark's stages)."""
    from deepinfer_core.plugins import build_op_table, load_backend

    if quantization not in (None, "fp8"):
        raise ValueError(f"unknown quantization {quantization!r}; expected None or 'fp8'")
    path = Path(path)
    cfg = ModelConfig.from_pretrained(path)
    arch = cfg.architecture
    if numerics is None:
        numerics = arch.default_numerics(cfg)
    if numerics not in arch.numerics:
        raise ValueError(f"unknown numerics {numerics!r}; expected one of {arch.numerics}")
    ops = build_op_table(backend, dtype=dtype, device=device, model_config=cfg,
                         allow_reference_fallback=allow_reference_fallback, batch_invariant=batch_invariant)
    extra = {}
    if engram_placement is not None or engram_shard:
        if not getattr(cfg, "has_engram", False):
            raise ValueError(f"engram_placement / engram_shard: {arch.name} at {path} has no Engram tables")
        extra = {"engram_placement": engram_placement, "engram_shard": engram_shard}
    if drafter_experts is not None:
        extra["drafter_experts"] = drafter_experts  # only architectures whose drafter has experts of its own
    return arch.load_model(cfg, path, ops, dtype, device, hook=load_backend(backend).hook,
                           quantization=quantization, numerics=numerics, experts=experts,
                           show_progress=show_progress, **extra)


__all__ = ["Architecture", "Model", "ModelConfig", "default_numerics", "load_model", "register_architecture",
           "resolve_architecture"]

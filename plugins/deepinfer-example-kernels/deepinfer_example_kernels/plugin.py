"""Hook implementations of the example kernel pack (entry point ``example_fused_rms_norm``)."""

from __future__ import annotations

import torch

from deepinfer_core.hookspecs import hookimpl
from deepinfer_example_kernels.ops import fused_rms_norm

TARGET_BACKEND = "cpu_ref"
PRIORITY = 10  # above cpu_ref's reference implementations (priority 0)
SUPPORTED_DTYPES = (None, torch.float32, torch.float64, torch.bfloat16)


def supports(ctx) -> bool:
    """Claim the op only for the model dtypes this kernel was checked on (``None`` = unspecified)."""
    return ctx.dtype in SUPPORTED_DTYPES


@hookimpl
def deepinfer_register_ops(registry, backend):
    if backend.name != TARGET_BACKEND:
        return
    registry.register("rms_norm", fused_rms_norm, priority=PRIORITY, predicate=supports)

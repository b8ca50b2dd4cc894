"""What this machine can run: device, compute capability, Triton and the official kernel libraries.

Everything here is a probe that never raises and imports nothing heavy at module import. Op selection
asks these probes (capability and importable features), never the device name.

Two environment switches exist for tests only:

* ``DEEPINFER_NVIDIA_ALLOW_CPU=1`` makes the backend available on a machine without CUDA and makes
  ``deepinfer_init_device`` return the CPU, so the conformance suite can run this backend's code there.
* with it, ``TRITON_INTERPRET=1`` (Triton's own interpreter) lets the Triton kernels serve on CPU
  tensors; without it the plain-torch implementations serve on the CPU.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from typing import Any

ALLOW_CPU_ENV = "DEEPINFER_NVIDIA_ALLOW_CPU"
INTERPRET_ENV = "TRITON_INTERPRET"
#: Triton's bf16/fp16 tensor-core dots need Ampere or newer; the backend itself needs 9.0
TRITON_MIN_CAPABILITY = (8, 0)

_TRUE = {"1", "true", "yes", "on"}


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


def cpu_allowed() -> bool:
    """The test-only switch that lets this backend run on the CPU."""
    return _flag(ALLOW_CPU_ENV)


def interpreting() -> bool:
    """Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1``)."""
    return _flag(INTERPRET_ENV)


def _torch() -> Any:
    import torch

    return torch


def default_device() -> Any:
    """The device this backend computes on when none is given (CUDA, or the CPU under the switch)."""
    torch = _torch()
    if cpu_allowed():
        return torch.device("cpu")
    try:
        if torch.version.cuda is not None and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
    except Exception:
        pass
    return torch.device("cpu")


def as_device(device: Any) -> Any:
    torch = _torch()
    if device is None:
        return default_device()
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        try:
            return torch.device("cuda", torch.cuda.current_device())
        except Exception:
            return device
    return device


def device_capability(device: Any) -> tuple[int, int] | None:
    """``(major, minor)`` of a CUDA device, ``None`` for other devices or when the probe fails."""
    device = as_device(device)
    if device.type != "cuda":
        return None
    try:
        return tuple(_torch().cuda.get_device_capability(device))  # type: ignore[return-value]
    except Exception:
        return None


@functools.cache
def _import_error(module: str) -> str:
    """``""`` when ``module`` imports, else why not (cached: a module imports once per process)."""
    try:
        importlib.import_module(module)
    except (Exception, SystemExit) as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def module_importable(module: str) -> bool:
    try:
        if importlib.util.find_spec(module.split(".")[0]) is None:
            return False
    except Exception:
        return False
    return _import_error(module) == ""


def triton_usable(device: Any = None) -> tuple[bool, str]:
    """Can this backend's Triton kernels run on ``device``? ``(ok, reason when not)``."""
    device = as_device(device)
    if device.type == "cpu":
        if not cpu_allowed():
            return False, "the CPU is not this backend's device"
        if not interpreting():
            return False, f"Triton kernels run on the CPU only under {INTERPRET_ENV}=1"
    elif device.type == "cuda":
        cap = device_capability(device)
        if cap is None:
            return False, "CUDA compute capability unknown"
        if cap < TRITON_MIN_CAPABILITY:
            return False, f"compute capability {cap[0]}.{cap[1]} is below {TRITON_MIN_CAPABILITY}"
    else:
        return False, f"device type {device.type!r} is not supported"
    if not module_importable("triton"):
        try:
            spec = importlib.util.find_spec("triton")
        except Exception:
            spec = None
        return False, "triton is not installed" if spec is None else f"triton: {_import_error('triton')}"
    return True, ""


def library_feature(module: str, attribute: str) -> bool:
    """``module`` imports and has ``attribute`` (e.g. FlashMLA's ``flash_mla_sparse_fwd``)."""
    if not module_importable(module):
        return False
    mod = importlib.import_module(module)
    return callable(getattr(mod, attribute, None))

"""Hook implementations of the nvidia_sm100 backend: registration and an availability probe only.

No ops are registered yet. The kernel libraries (FlashMLA, DeepGEMM, DeepEP, Triton) are probed
lazily, inside ``is_available``/``details``, never when this module is imported: importing them can
initialise CUDA or JIT-compile, and a broken build must not stop ``deepinfer backends`` from listing
the other backends.
"""

from __future__ import annotations

import importlib
import importlib.util
from importlib.metadata import PackageNotFoundError, version

from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.plugins import BackendInfo

NAME = "nvidia_sm100"
DISTRIBUTION = "deepinfer-nvidia-sm100"
MIN_CAPABILITY = (9, 0)

# module name -> distribution names that may carry its version when the module has no __version__
KERNEL_LIBRARIES: dict[str, tuple[str, ...]] = {
    "flash_mla": ("flash_mla", "flash-mla"),
    "deep_gemm": ("deep_gemm", "deep-gemm"),
    "deep_ep": ("deep_ep", "deep-ep"),
    "triton": ("triton",),
}


def _version() -> str:
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return "0+unknown"


def probe_library(module: str, dists: tuple[str, ...] = ()) -> str:
    """``"<version>"`` when ``module`` imports, else ``"missing: <reason>"``; never raises."""
    try:
        if importlib.util.find_spec(module) is None:
            return "missing: not installed"
    except Exception as exc:  # a broken parent package or finder
        return f"missing: {type(exc).__name__}: {exc}"
    try:
        mod = importlib.import_module(module)
    except (Exception, SystemExit) as exc:  # a broken extension build may even call sys.exit
        return f"missing: import failed: {type(exc).__name__}: {exc}"
    found = getattr(mod, "__version__", None)
    for dist in dists:
        if found:
            break
        try:
            found = version(dist)
        except PackageNotFoundError:
            continue
    return str(found) if found else "installed (version unknown)"


def _torch():
    try:
        import torch
    except Exception as exc:
        return None, f"cannot import torch: {type(exc).__name__}: {exc}"
    return torch, ""


def is_available() -> tuple[bool, str]:
    """``(True, "")`` on a CUDA device of compute capability >= 9.0, else ``(False, exact reason)``."""
    try:
        torch, error = _torch()
        if torch is None:
            return False, error
        if getattr(torch.version, "cuda", None) is None:
            build = f"ROCm {torch.version.hip}" if getattr(torch.version, "hip", None) else "CPU-only"
            return False, f"torch {torch.__version__} is built without CUDA ({build} build)"
        if not torch.cuda.is_available():
            return False, (
                f"no CUDA device visible (torch {torch.__version__}, CUDA {torch.version.cuda}; "
                "check the driver, nvidia-smi and CUDA_VISIBLE_DEVICES)"
            )
        device = torch.cuda.current_device()
        capability = torch.cuda.get_device_capability(device)
        if tuple(capability) < MIN_CAPABILITY:
            name = torch.cuda.get_device_name(device)
            need = ".".join(map(str, MIN_CAPABILITY))
            return False, (
                f"CUDA device {device} ({name}) has compute capability {capability[0]}.{capability[1]}, "
                f"below the {need} this backend needs (Hopper sm90 or Blackwell sm100)"
            )
        return True, ""
    except Exception as exc:  # the probe must never raise
        return False, f"CUDA probe failed: {type(exc).__name__}: {exc}"


def details() -> dict[str, str]:
    """Versions of the kernel libraries (or why they are missing) and the CUDA device, if any."""
    out: dict[str, str] = {}
    torch, error = _torch()
    if torch is None:
        out["torch"] = f"missing: {error}"
    else:
        out["torch"] = torch.__version__
        out["torch_cuda"] = str(getattr(torch.version, "cuda", None) or "none (built without CUDA)")
        try:
            if torch.version.cuda is not None and torch.cuda.is_available():
                device = torch.cuda.current_device()
                major, minor = torch.cuda.get_device_capability(device)
                out["cuda_device"] = f"{device}: {torch.cuda.get_device_name(device)}"
                out["compute_capability"] = f"{major}.{minor}"
                out["cuda_device_count"] = str(torch.cuda.device_count())
        except Exception as exc:
            out["cuda_device"] = f"probe failed: {type(exc).__name__}: {exc}"
    for module, dists in KERNEL_LIBRARIES.items():
        out[module] = probe_library(module, dists)
    return out


@hookimpl
def deepinfer_backend_info():
    return BackendInfo(
        name=NAME,
        device_type="cuda",
        version=_version(),
        is_available=is_available,
        details=details,
    )


@hookimpl
def deepinfer_collect_env():
    return details()

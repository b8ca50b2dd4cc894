"""Hook implementations of the ascend_950 backend: registration and an availability probe only.

No ops are registered yet. Nothing NPU-specific is imported at module import: ``torch_npu``,
``tilelang`` and Triton-Ascend are imported only inside ``is_available()``/``details()``, after the
probe has checked that the CANN toolkit is there (importing ``torch_npu`` without CANN fails, and
importing it at all initialises the NPU runtime).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.plugins import BackendInfo, probe_library

NAME = "ascend_950"
DISTRIBUTION = "deepinfer-ascend-950"
SOC_MARKER = "950"  # torch.npu.get_device_name() of a supported chip contains this
CANN_ENV_VARS = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME")  # set by ascend-toolkit/set_env.sh
CANN_DEFAULT = "/usr/local/Ascend/ascend-toolkit/latest"

# module name -> distribution names that may carry its version when the module has no __version__
KERNEL_LIBRARIES: dict[str, tuple[str, ...]] = {
    "tilelang": ("tilelang",),
    "triton": ("triton-ascend", "triton"),
}


def _version() -> str:
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return "0+unknown"


def find_cann() -> Path | None:
    """The CANN toolkit directory (from ``set_env.sh``'s variables or the default path), or ``None``."""
    for var in CANN_ENV_VARS:
        value = os.environ.get(var)
        if value and Path(value).is_dir():
            return Path(value)
    default = Path(CANN_DEFAULT)
    return default if default.is_dir() else None


def cann_version(home: Path) -> str:
    for rel in ("compiler/version.info", "version.info", "runtime/version.info"):
        try:
            for line in (home / rel).read_text().splitlines():
                key, _, value = line.partition("=")
                if key.strip().lower() == "version" and value.strip():
                    return value.strip()
        except OSError:
            continue
    return "unknown version"


def _import_torch_npu():
    """``(torch, None)`` with torch_npu imported, or ``(None, reason)``; checks CANN first."""
    try:
        spec = importlib.util.find_spec("torch_npu")
    except Exception as exc:
        return None, f"torch_npu cannot be located: {type(exc).__name__}: {exc}"
    if spec is None:
        return (
            None,
            "torch_npu not installed (install the torch-npu matching your torch and CANN; see README)",
        )
    if find_cann() is None:
        return None, (
            "CANN toolkit not found (ASCEND_HOME_PATH/ASCEND_TOOLKIT_HOME unset and "
            f"{CANN_DEFAULT} missing; source <Ascend>/ascend-toolkit/set_env.sh)"
        )
    try:
        import torch
        import torch_npu  # noqa: F401  (registers torch.npu)
    except (Exception, SystemExit) as exc:
        return None, f"torch_npu failed to import: {type(exc).__name__}: {exc}"
    return torch, None


def is_available() -> tuple[bool, str]:
    """``(True, "")`` with an Ascend 950 NPU visible, else ``(False, exact reason)``; never raises."""
    try:
        torch, reason = _import_torch_npu()
        if torch is None:
            return False, reason
        npu = getattr(torch, "npu", None)
        if npu is None or not npu.is_available() or npu.device_count() == 0:
            return False, (
                "no NPU device (torch.npu.is_available() is False; "
                "check npu-smi and ASCEND_RT_VISIBLE_DEVICES)"
            )
        device = npu.current_device()
        name = npu.get_device_name(device)
        if SOC_MARKER not in str(name):
            return False, f"NPU {device} is {name}; this backend needs an Ascend 950"
        return True, ""
    except Exception as exc:
        return False, f"NPU probe failed: {type(exc).__name__}: {exc}"


def details() -> dict[str, str]:
    """CANN, torch_npu, TileLang and Triton-Ascend versions (or why missing) and the NPU, if any."""
    out: dict[str, str] = {}
    home = find_cann()
    out["cann"] = f"{cann_version(home)} at {home}" if home else "missing: toolkit not found"
    torch, reason = _import_torch_npu()
    if torch is None:
        out["torch_npu"] = f"missing: {reason}"
    else:
        out["torch_npu"] = probe_library("torch_npu", ("torch-npu", "torch_npu"))
        try:
            if torch.npu.is_available():
                device = torch.npu.current_device()
                out["npu_device"] = f"{device}: {torch.npu.get_device_name(device)}"
                out["npu_device_count"] = str(torch.npu.device_count())
        except Exception as exc:
            out["npu_device"] = f"probe failed: {type(exc).__name__}: {exc}"
    for module, dists in KERNEL_LIBRARIES.items():
        out[module] = probe_library(module, dists)
    return out


@hookimpl
def deepinfer_backend_info():
    return BackendInfo(
        name=NAME,
        device_type="npu",
        version=_version(),
        is_available=is_available,
        details=details,
    )


@hookimpl
def deepinfer_collect_env():
    return details()

"""What this process has of an Ascend 950, probed cheaply: the CANN toolkit, ``torch_npu`` and an NPU of
the right chip (:func:`is_available`, the backend's availability probe), and what the Ascend ops need:
which ``torch_npu`` fused operators exist, TileLang and CANN's ``bisheng`` compiler.

Predicates read :func:`environment` (cached); ``deepinfer_ascend_950.dry_run`` and the tests substitute
an assumed one with :func:`assume`. Nothing here imports ``torch_npu`` before CANN has been found
(importing it without CANN fails and importing it at all initialises the NPU runtime).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NPU = "npu"
SOC_MARKER = "950"  # torch.npu.get_device_name() of a supported chip contains this
CANN_ENV_VARS = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME")  # set by ascend-toolkit/set_env.sh
CANN_DEFAULT = "/usr/local/Ascend/ascend-toolkit/latest"

#: test-only switch: TileLang kernels serve a CPU engine through :mod:`.emulator` (nothing is compiled)
EMULATE_ENV = "DEEPINFER_ASCEND_EMULATE"


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


def import_torch_npu():
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
        torch, reason = import_torch_npu()
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


@dataclass(frozen=True)
class Environment:
    torch_npu: Any = None  # the imported module, or None
    torch_npu_reason: str = ""  # why it is None
    tilelang: bool = False
    bisheng: str | None = None  # path of CANN's bisheng compiler
    fused_ops: frozenset[str] = field(default_factory=frozenset)  # torch_npu.<name> that exist

    def has(self, name: str) -> bool:
        return name in self.fused_ops


def find_bisheng() -> str | None:
    """CANN's ``bisheng``, where TileLang looks for it: ``BISHENG_HOME/bin``, then ``PATH``."""
    home = os.environ.get("BISHENG_HOME", "")
    if home and os.path.isfile(os.path.join(home, "bin", "bisheng")):
        return os.path.join(home, "bin", "bisheng")
    return shutil.which("bisheng")


def _tilelang_installed() -> bool:
    try:
        return importlib.util.find_spec("tilelang") is not None
    except Exception:
        return False


#: torch_npu fused operators the backend has adapters for
FUSED_OPS = ("npu_rms_norm", "npu_rotary_mul", "npu_swiglu", "npu_moe_gating_top_k", "npu_grouped_matmul")


@functools.cache
def _probe() -> Environment:
    torch, reason = import_torch_npu()
    module = sys.modules.get("torch_npu") if torch is not None else None
    ops = frozenset(name for name in FUSED_OPS if module is not None and hasattr(module, name))
    return Environment(module, reason, _tilelang_installed(), find_bisheng(), ops)


_ASSUMED: list[Environment] = []


def environment() -> Environment:
    return _ASSUMED[-1] if _ASSUMED else _probe()


@contextlib.contextmanager
def assume(env: Environment) -> Iterator[Environment]:
    """Judge predicates as if this process had ``env`` (dry runs, tests)."""
    _ASSUMED.append(env)
    try:
        yield env
    finally:
        _ASSUMED.pop()


def emulating() -> bool:
    """``DEEPINFER_ASCEND_EMULATE=1``: the TileLang kernels run in the CPU emulator, for tests."""
    return os.environ.get(EMULATE_ENV, "") not in ("", "0")


def is_npu(device: Any) -> bool:
    return getattr(device, "type", None) == NPU or (isinstance(device, str) and device.split(":")[0] == NPU)

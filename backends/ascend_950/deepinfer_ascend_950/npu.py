"""What the Ascend ops need of this process, probed once and cheaply: an NPU device, ``torch_npu`` and
which of its fused operators exist, TileLang and CANN's ``bisheng`` compiler.

Predicates read :func:`environment` (cached); ``deepinfer_ascend_950.dry_run`` and the tests substitute
an assumed one with :func:`assume`. Nothing here imports ``torch_npu`` before the plugin's probe has
found CANN (importing it without CANN fails and importing it at all initialises the NPU runtime).
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
from typing import Any

NPU = "npu"
#: test-only switch: TileLang kernels serve a CPU engine through :mod:`.emulator` (nothing is compiled)
EMULATE_ENV = "DEEPINFER_ASCEND_EMULATE"


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
    from deepinfer_ascend_950.plugin import _import_torch_npu

    torch, reason = _import_torch_npu()
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

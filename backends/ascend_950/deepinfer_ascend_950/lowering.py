"""Lower a TileLang-Ascend kernel to AscendC source without the CANN toolkit, and measure it.

:func:`lower` runs TileLang's ``ascend`` pass pipeline and AscendC code generation (the step before the
``bisheng`` compiler). :func:`capture_compile` goes the way ``tilelang.compile(target="ascend")`` goes
at run time and stops exactly where TileLang hands the AscendC source to ``bisheng.compile_ascend``,
returning what it handed over. :func:`footprint` reads the lowered device program: the bytes each
on-chip buffer holds (TileLang merges a kernel's buffers into one allocation per scope) plus the L0A/L0B
stages of every Cube GEMM, to be checked against :mod:`.limits`.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from deepinfer_ascend_950 import limits

TARGET = {"kind": "ascend"}
_GEMM = re.compile(r"ascend_gemm_l1<\s*(\d+),\s*(\d+),\s*(\d+),\s*(\d+),\s*(true|false),\s*(\w+)\s*>")
_ELEM_BYTES = {"bfloat16_t": 2, "half": 2, "half_t": 2, "float": 4, "int8_t": 1, "float8_e4m3_t": 1}


@dataclass(frozen=True)
class Gemm:
    """One ``ascend_gemm_l1<M, K, N, TILE_K, TRANS_B, T>`` call: L0A/L0B hold two stages of
    ``M x TILE_K`` / ``N x TILE_K`` elements (the template's ping-pong)."""

    m: int
    k: int
    n: int
    tile_k: int
    elem_bytes: int

    @property
    def l0a_bytes(self) -> int:
        return 2 * self.m * self.tile_k * self.elem_bytes

    @property
    def l0b_bytes(self) -> int:
        return 2 * self.n * self.tile_k * self.elem_bytes


@dataclass
class Lowered:
    source: str  # AscendC, as handed to bisheng
    device_mod: Any  # the lowered device IRModule (TIR)
    buffers: dict[str, int] = field(default_factory=dict)  # "UB" / "L1" / "L0C" / ... -> bytes
    gemms: list[Gemm] = field(default_factory=list)
    simt_vf: bool = False

    @property
    def script(self) -> str:
        return self.device_mod.script()

    def usage(self) -> dict[str, int]:
        """Bytes per on-chip buffer, L0A/L0B from the largest GEMM stage pair."""
        out = dict(self.buffers)
        if self.gemms:
            out["L0A"] = max(out.get("L0A", 0), max(g.l0a_bytes for g in self.gemms))
            out["L0B"] = max(out.get("L0B", 0), max(g.l0b_bytes for g in self.gemms))
        return out

    def over_limits(self) -> dict[str, tuple[int, int]]:
        """``buffer -> (used, capacity)`` for every buffer over its Ascend 950 capacity (empty: fits)."""
        return {buf: (used, limits.capacity(buf, self.simt_vf)) for buf, used in self.usage().items()
                if used > limits.capacity(buf, self.simt_vf)}


def _collect(device_mod: Any) -> tuple[dict[str, int], bool]:
    from tvm import tirx

    buffers: dict[str, int] = {}
    simt = False

    def visit(node: Any) -> None:
        nonlocal simt
        kind = type(node).__name__
        if kind == "AllocBuffer":
            buf = node.buffer
            where = limits.BUFFER_OF_SCOPE.get(buf.scope())
            if where is not None:
                elems = 1
                for dim in buf.shape:
                    elems *= int(dim)
                nbytes = elems * ((buf.dtype.bits * buf.dtype.lanes + 7) // 8)
                buffers[where] = buffers.get(where, 0) + nbytes
        elif kind == "SBlock" and node.name_hint == "SIMT_VF":
            simt = True

    for _, fn in device_mod.functions.items():
        tirx.stmt_functor.post_order_visit(fn.body, visit)
    return buffers, simt


def gemms(source: str) -> list[Gemm]:
    return [Gemm(int(m), int(k), int(n), int(tk), _ELEM_BYTES.get(t, 2))
            for m, k, n, tk, _, t in _GEMM.findall(source)]


def lower(prim_func: Any) -> Lowered:
    """TileLang's ascend pipeline and AscendC codegen on this machine (no CANN needed)."""
    import tilelang
    from tvm.target import Target

    with Target(TARGET):
        artifact = tilelang.lower(prim_func, target="ascend")
    buffers, simt = _collect(artifact.device_mod)
    return Lowered(artifact.kernel_source, artifact.device_mod, buffers, gemms(artifact.kernel_source), simt)


@contextlib.contextmanager
def _no_kernel_cache() -> Iterator[None]:
    old = os.environ.get("TILELANG_DISABLE_CACHE")
    os.environ["TILELANG_DISABLE_CACHE"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TILELANG_DISABLE_CACHE", None)
        else:
            os.environ["TILELANG_DISABLE_CACHE"] = old


def capture_compile(prim_func: Any) -> tuple[str, dict[str, Any]]:
    """``tilelang.compile(prim_func, target="ascend")`` up to the call of the CANN compiler: the AscendC
    source and the keyword arguments (``npu_arch``, ``target_format``, ``options``) TileLang passes to
    ``bisheng.compile_ascend``, which is not run."""
    import tilelang
    from tilelang.contrib import bisheng

    captured: list[tuple[str, dict[str, Any]]] = []

    def capture(code: str, **kwargs: Any) -> bytes:
        captured.append((code, kwargs))
        raise RuntimeError("deepinfer: stopped at bisheng.compile_ascend (source captured)")

    original = bisheng.compile_ascend
    bisheng.compile_ascend = capture
    try:
        with _no_kernel_cache():
            tilelang.compile(prim_func, target="ascend")
    except Exception:
        if not captured:  # a failure before the compiler call is the kernel's
            raise
    finally:
        bisheng.compile_ascend = original
    if not captured:
        raise RuntimeError("tilelang.compile returned without calling bisheng.compile_ascend")
    return captured[0]

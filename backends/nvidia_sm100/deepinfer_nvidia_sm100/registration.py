"""What this backend registers for each op, at which priority, under which predicate.

Every op is served at the bottom (:data:`TORCH`) by the core's native body
(:mod:`deepinfer_core.ops.native`); the ops with a kernel of their own add a Triton one (:data:`TRITON`)
whose predicate checks that Triton runs on the engine's device and that the model dtype is one the
kernels take; where an official DeepSeek library is importable and passes a self-check on the device,
an adapter to it (:data:`LIBRARY`, :mod:`.external`). Every predicate decides once, when the engine is
built; the core's resolution picks the highest priority that applies. Kernel packs override any of
them with a priority above :data:`LIBRARY` (e.g. 10).

Batch-invariant mode (``BuildContext.batch_invariant``) resolves the ops the catalogue does not mark
invariant only to implementations declared invariant: :mod:`.invariant_ops` registers them at
:data:`INVARIANT` (above the libraries, whose kernels make no such promise), and the default Triton
kernels and native bodies that are invariant as they are keep serving, declared so.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

from deepinfer_core.ops import native
from deepinfer_core.ops.catalogue import CATALOGUE
from deepinfer_core.ops.registry import CHOSEN, SHADOWED, BuildContext, OpImpl, OpRegistry
from deepinfer_nvidia_sm100 import capability

TORCH, TRITON, LIBRARY, INVARIANT = 1, 2, 3, 4
FP8_TRITON_ENV = "DEEPINFER_NVIDIA_FP8_TRITON"
FP4_TRITON_ENV = "DEEPINFER_NVIDIA_FP4_TRITON"
FP8_KV_TRITON_ENV = "DEEPINFER_NVIDIA_FP8_KV_TRITON"


def _kernel_dtype(dtype: Any) -> tuple[bool, str]:
    from deepinfer_nvidia_sm100.triton_ops import KERNEL_DTYPES

    if dtype is not None and dtype not in KERNEL_DTYPES:
        return False, f"the Triton kernels do not take {dtype}"
    return True, ""


def triton_applies(ctx: BuildContext) -> bool:
    """The Triton kernels serve: the model dtype is one they take and Triton runs on the device."""
    return _kernel_dtype(ctx.dtype)[0] and capability.triton_usable(ctx.device)[0]


def triton_fp8_applies(ctx: BuildContext) -> bool:
    """The Triton FP8 GEMM and grouped MoE serve unless ``DEEPINFER_NVIDIA_FP8_TRITON=0``: called directly,
    both passed ``backends/nvidia_sm100/tests/gpu/test_fp8_gpu.py`` at V4-Flash shapes on an H200 (bfloat16
    and float32, CUDA graph capture included) once the quantisation sign bit and the float32 models on FP8
    tensor cores were fixed."""
    return os.environ.get(FP8_TRITON_ENV, "") != "0" and triton_applies(ctx)


def unless_switched_off(env: str) -> Callable[[BuildContext], bool]:
    """:func:`triton_applies`, unless ``env`` is "0" (read whenever a table is built): the switch of a kernel
    that serves by default, for comparing it with the native body."""

    def applies(ctx: BuildContext) -> bool:
        return os.environ.get(env, "") != "0" and triton_applies(ctx)

    applies.__qualname__ = f"triton_applies[{env}!=0]"
    return applies


def invariant_applies(ctx: BuildContext) -> bool:
    """Batch-invariant mode, with the Triton kernels serving."""
    return bool(ctx.batch_invariant) and triton_applies(ctx)


def _adapter_applies(adapter: Any) -> Callable[[BuildContext], bool]:
    def applies(ctx: BuildContext) -> bool:
        return adapter.usable(ctx.device, ctx.dtype, ctx.model_config, not ctx.probe_only)[0]

    def reason(ctx: BuildContext) -> str:
        return adapter.usable(ctx.device, ctx.dtype, ctx.model_config, not ctx.probe_only)[1]

    applies.__qualname__ = f"{adapter.library}_applies[{adapter.op}]"
    applies.reason = reason  # what listings print beside "declined"
    return applies


def register_all(registry: OpRegistry) -> None:
    from deepinfer_nvidia_sm100 import engram_ops, external, fp8_ops, hc_ops, invariant_ops, triton_ops

    native.register(registry, priority=TORCH, skip=invariant_ops.NATIVE_BY_CONSTRUCTION)
    for op in sorted(invariant_ops.NATIVE_BY_CONSTRUCTION):  # per-row bodies: declared invariant
        registry.register(op, native.NATIVE_OPS[op], priority=TORCH, batch_invariant=True,
                          syncs_host=op in native.SYNCS_HOST)
    for op, fn in {**triton_ops.ALL_OPS, **hc_ops.ALL_OPS}.items():
        registry.register(op, fn, priority=TRITON, predicate=triton_applies,
                          batch_invariant=op in invariant_ops.INVARIANT_BY_CONSTRUCTION)
    for op, fn in invariant_ops.DEFAULT_OPS.items():
        registry.register(op, fn, priority=TRITON, predicate=triton_applies, batch_invariant=True)
    for op, fn in fp8_ops.ALL_OPS.items():
        registry.register(op, fn, priority=TRITON, predicate=triton_fp8_applies)
    # the FP4 MoE's kernels serve DeepSeek's numerics on float experts too: one switch for both
    for ops, env in ((triton_ops.FP4_OPS, FP4_TRITON_ENV), (triton_ops.QUANT_ACT_OPS, FP4_TRITON_ENV),
                     (triton_ops.FP8_KV_OPS, FP8_KV_TRITON_ENV)):
        for op, fn in ops.items():
            registry.register(op, fn, priority=TRITON, predicate=unless_switched_off(env))
    for op, fn in engram_ops.ALL_OPS.items():  # host tables read in place over unified addressing
        registry.register(op, fn, priority=TRITON, predicate=triton_applies, batch_invariant=True)
    for adapter in external.ADAPTERS:
        registry.register(adapter.op, adapter.fn, priority=LIBRARY, predicate=_adapter_applies(adapter))
    for op, fn in invariant_ops.ALL_OPS.items():
        registry.register(op, fn, priority=INVARIANT, predicate=invariant_applies, batch_invariant=True,
                          syncs_host=op in invariant_ops.SYNCS_HOST)


@functools.cache
def _names() -> dict[Callable, str]:
    from deepinfer_nvidia_sm100 import engram_ops, external, fp8_ops, hc_ops, invariant_ops, triton_ops

    names = {fn: "torch" for fn in native.NATIVE_OPS.values()}
    names.update({fn: "triton" for fn in engram_ops.ALL_OPS.values()})
    names.update({fn: "triton" for fn in (*triton_ops.ALL_OPS.values(), *hc_ops.ALL_OPS.values(),
                                          *fp8_ops.ALL_OPS.values(), *triton_ops.FP4_OPS.values(),
                                          *triton_ops.QUANT_ACT_OPS.values(), *triton_ops.FP8_KV_OPS.values())})
    names.update({fn: "triton (batch-invariant)" for fn in invariant_ops.ALL_OPS.values()})
    names.update({fn: "triton" for fn in invariant_ops.DEFAULT_OPS.values()})  # the default mode's kernel too
    names.update({a.fn: a.library for a in external.ADAPTERS})
    return names


def implementation_name(impl: OpImpl) -> str:
    """``"torch"`` (the core's native body), ``"triton"``, or the library an adapter calls; an
    implementation another plugin registered goes by its plugin's name."""
    return _names().get(impl.fn) or impl.provider.partition(":")[2] or impl.provider


def op_labels(registry: OpRegistry, ctx: BuildContext) -> dict[str, str]:
    """op -> the name of the implementation the core's resolution picks under ``ctx`` (``"none"``).

    Under ``ctx.probe_only`` no adapter has run its self-check: its entry then reads
    ``"<library> (if its self-check passes, else <next>)"``."""
    from deepinfer_nvidia_sm100 import external

    adapters = {a.fn for a in external.ADAPTERS}
    out = {}
    for op in CATALOGUE:
        serving = [impl for impl, verdict in registry.explain(op, ctx) if verdict in (CHOSEN, SHADOWED)]
        if not serving:
            out[op] = "none"
            continue
        name = implementation_name(serving[0])
        if ctx.probe_only and serving[0].fn in adapters and len(serving) > 1:
            name = f"{name} (if its self-check passes, else {implementation_name(serving[1])})"
        out[op] = name
    return out

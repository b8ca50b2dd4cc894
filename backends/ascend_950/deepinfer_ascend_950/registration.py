"""What the ascend_950 backend registers for each op, at which priority, under which predicate.

Every catalogued op is served at the bottom (:data:`NATIVE`) by the core's native body (plain torch, which
runs on the NPU through torch_npu's aten kernels); three ops add a ``torch_npu`` fused operator
(:data:`TORCH_NPU`, :mod:`.npu_ops`) and two a TileLang-Ascend kernel (:data:`TILELANG`,
:mod:`.tilelang_ops`). Predicates decide once, when the engine is built: the fused operators need an NPU
device and torch_npu with that operator; the TileLang kernels also need TileLang, CANN's ``bisheng``, a
dtype the kernel takes and, outside ``probe_only`` listings, a one-off self-check on the device against
the native body. Kernel packs override any of them with a higher priority (e.g. 10).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from deepinfer_ascend_950 import npu
from deepinfer_core.ops import native
from deepinfer_core.ops.catalogue import CATALOGUE
from deepinfer_core.ops.registry import CHOSEN, SHADOWED, BuildContext, OpImpl, OpRegistry

logger = logging.getLogger(__name__)

NATIVE, TORCH_NPU, TILELANG = 1, 2, 3
TILELANG_DTYPES = {"sparse_attention": (torch.bfloat16, torch.float16),
                   "hc_pre": (torch.bfloat16, torch.float16, torch.float32),
                   "compress_windows": (torch.bfloat16, torch.float16, torch.float32),
                   "indexer_topk": (torch.bfloat16, torch.float16),
                   "hc_post": (torch.bfloat16, torch.float16, torch.float32),
                   "hc_head": (torch.bfloat16, torch.float16, torch.float32),
                   "linear_fp8": (torch.bfloat16, torch.float16, torch.float32),
                   "moe_experts_fp8": (torch.bfloat16, torch.float16, torch.float32),
                   "moe_experts_fp4": (torch.bfloat16, torch.float16, torch.float32),
                   "act_quant_sim": (torch.bfloat16, torch.float16, torch.float32),
                   "moe_route": (torch.bfloat16, torch.float16, torch.float32),
                   "kv_fp8_pack": (torch.bfloat16, torch.float16, torch.float32),
                   "sparse_attention_fp8": (torch.bfloat16, torch.float16)}


def npu_op_applies(operator: str) -> Callable[[BuildContext], bool]:
    def applies(ctx: BuildContext) -> bool:
        return npu.is_npu(ctx.device) and npu.environment().has(operator)

    applies.__qualname__ = f"torch_npu_applies[{operator}]"
    return applies


def tilelang_verdict(op: str, ctx: BuildContext) -> tuple[bool, str]:
    env = npu.environment()
    if npu.emulating() and getattr(ctx.device, "type", ctx.device) == "cpu":
        if ctx.dtype is not None and ctx.dtype not in TILELANG_DTYPES[op]:
            return False, f"the kernel does not take {ctx.dtype}"
        return True, ""
    if not npu.is_npu(ctx.device):
        return False, "the engine's device is not an NPU"
    if env.torch_npu is None:
        return False, "torch_npu is not importable"
    if not env.tilelang:
        return False, "tilelang is not installed"
    if env.bisheng is None:
        return False, "CANN's bisheng compiler not found (BISHENG_HOME/bin, PATH)"
    if ctx.dtype is not None and ctx.dtype not in TILELANG_DTYPES[op]:
        return False, f"the kernel does not take {ctx.dtype}"
    if not ctx.probe_only:
        return self_check(op, str(ctx.device), ctx.dtype or torch.bfloat16)
    return True, ""


def tilelang_applies(op: str) -> Callable[[BuildContext], bool]:
    def applies(ctx: BuildContext) -> bool:
        return tilelang_verdict(op, ctx)[0]

    applies.__qualname__ = f"tilelang_applies[{op}]"
    return applies


def sqrtsoftplus_route_applies(ctx: BuildContext) -> bool:
    """The TileLang ``moe_route``: for a model that routes by ``sqrtsoftplus``, where the kernels run."""
    return getattr(ctx.model_config, "scoring_func", None) == "sqrtsoftplus" and tilelang_verdict("moe_route", ctx)[0]


def tilelang_kernel_ops() -> dict[str, Callable]:
    """op -> its TileLang wrapper, for every op a kernel serves whatever the model."""
    from deepinfer_ascend_950 import tilelang_kv_fp8, tilelang_moe, tilelang_ops

    return {**tilelang_ops.ALL_OPS, **tilelang_moe.ALL_OPS, **tilelang_kv_fp8.ALL_OPS}


def kernel_ops() -> dict[str, Callable]:
    """op -> its TileLang wrapper, the model-gated ones included."""
    from deepinfer_ascend_950 import tilelang_ops

    return {**tilelang_kernel_ops(), **tilelang_ops.ROUTE_OPS}


def _self_check_case(op: str, device: Any, dtype: torch.dtype) -> tuple[tuple, dict]:
    """The first case the conformance suite generates for ``op`` at its ``tiny`` preset, on ``device``."""
    from deepinfer_core.testing.conformance import make_cases

    case = make_cases(op, "tiny", dtype)[0]
    move = lambda a: a.to(device) if isinstance(a, torch.Tensor) else a  # noqa: E731
    return tuple(move(a) for a in case.args), {k: move(v) for k, v in case.kwargs.items()}


@functools.cache
def self_check(op: str, device: str, dtype: torch.dtype) -> tuple[bool, str]:
    """Compile and run the TileLang kernel of ``op`` once on ``device`` against the native body; a
    failure declines the kernel (with a warning) instead of failing the engine."""
    from deepinfer_core.testing.compare import assert_close

    try:
        args, kwargs = _self_check_case(op, device, dtype)
        got = kernel_ops()[op](*args, **kwargs)
        want = native.NATIVE_OPS[op](*args, **kwargs)
        for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            if not b.dtype.is_floating_point:
                if not torch.equal(a.cpu(), b.cpu()):
                    raise AssertionError(f"{op} self-check: the kernel's indices differ from the native body's")
                continue
            assert_close(a.float().cpu(), b.float().cpu(), dtype=dtype, name=f"{op} self-check")
    except Exception as exc:
        logger.warning("ascend_950: TileLang %s declined: self-check failed: %s: %s", op, type(exc).__name__, exc)
        return False, f"self-check failed: {type(exc).__name__}: {exc}"
    return True, ""


def register_all(registry: OpRegistry) -> None:
    from deepinfer_ascend_950 import npu_ops, tilelang_ops

    native.register(registry, priority=NATIVE)
    for op, (fn, operator) in npu_ops.ALL_OPS.items():
        registry.register(op, fn, priority=TORCH_NPU, predicate=npu_op_applies(operator))
    for op, fn in tilelang_kernel_ops().items():
        registry.register(op, fn, priority=TILELANG, predicate=tilelang_applies(op),
                          syncs_host=op in tilelang_ops.SYNCS_HOST)
    for op, fn in tilelang_ops.ROUTE_OPS.items():
        registry.register(op, fn, priority=TILELANG, predicate=sqrtsoftplus_route_applies)


def _names() -> dict[Callable, str]:
    from deepinfer_ascend_950 import npu_ops

    names = {fn: "native" for fn in native.NATIVE_OPS.values()}
    names.update({fn: f"torch_npu.{operator}" for fn, operator in npu_ops.ALL_OPS.values()})
    names.update({fn: "tilelang" for fn in kernel_ops().values()})
    if npu.emulating():
        names.update({fn: "tilelang (emulated on the CPU)" for fn in kernel_ops().values()})
    return names


def implementation_name(impl: OpImpl) -> str:
    """``"native"``, ``"torch_npu.<operator>"``, ``"tilelang"``, or the registering plugin's name."""
    return _names().get(impl.fn) or impl.provider.partition(":")[2] or impl.provider


def op_labels(registry: OpRegistry, ctx: BuildContext) -> dict[str, str]:
    """op -> the implementation the core's resolution picks under ``ctx`` (``"none"``); under
    ``probe_only`` a TileLang kernel reads ``"tilelang (if its self-check passes, else <next>)"``."""

    kernels = set(kernel_ops().values())
    out = {}
    for op in CATALOGUE:
        serving = [impl for impl, verdict in registry.explain(op, ctx) if verdict in (CHOSEN, SHADOWED)]
        if not serving:
            out[op] = "none"
            continue
        name = implementation_name(serving[0])
        if ctx.probe_only and serving[0].fn in kernels and len(serving) > 1 and not npu.emulating():
            name = f"{name} (if its self-check passes, else {implementation_name(serving[1])})"
        out[op] = name
    return out

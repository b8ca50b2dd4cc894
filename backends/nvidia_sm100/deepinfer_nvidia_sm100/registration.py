"""Which implementation serves each op, chosen by capability, and its registration.

Every op gets a plain-torch implementation (priority :data:`TORCH`); the ops with a kernel of their own
add a Triton one (:data:`TRITON`) whose predicate checks that Triton can run on the engine's device,
and, where an official DeepSeek library is importable and passes a self-check on the device, an
adapter to it (:data:`LIBRARY`). Kernel packs override any of them with a priority above
:data:`LIBRARY` (e.g. 10).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from deepinfer_nvidia_sm100 import capability

TORCH, TRITON, LIBRARY = 1, 2, 3
FP8_TRITON_ENV = "DEEPINFER_NVIDIA_FP8_TRITON"

TRITON_OPS = ("rms_norm", "rotary_emb", "sparse_attention", "compress_windows", "indexer_topk", "moe_experts",
              "hc_pre", "hc_post", "hc_head")


@dataclass(frozen=True)
class Impl:
    op: str
    name: str  # "torch", "triton", "flash_mla", "deep_gemm"
    priority: int
    load: Callable[[], Callable]  # the function (imported on demand)
    #: (device, dtype, model_config, self_check) -> (usable, reason when not)
    usable: Callable[[Any, Any, Any, bool], tuple[bool, str]]


def _always(device, dtype, model_config, self_check) -> tuple[bool, str]:
    return True, ""


def _triton(device, dtype, model_config, self_check) -> tuple[bool, str]:
    import torch

    if dtype is not None and dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False, f"dtype {dtype} runs on the torch path"
    return capability.triton_usable(device)


def _triton_fp8(device, dtype, model_config, self_check) -> tuple[bool, str]:
    """The Triton FP8 kernels are opt-in: they fail the conformance suite at V4-Flash widths on an H200."""
    import os

    if os.environ.get(FP8_TRITON_ENV, "") != "1":
        return False, f"experimental: set {FP8_TRITON_ENV}=1 to use the Triton FP8 kernels"
    return _triton(device, dtype, model_config, self_check)


def _torch_fn(op: str) -> Callable[[], Callable]:
    def load() -> Callable:
        from deepinfer_nvidia_sm100 import torch_ops

        return torch_ops.ALL_OPS[op]

    return load


def _triton_fn(op: str) -> Callable[[], Callable]:
    def load() -> Callable:
        from deepinfer_nvidia_sm100 import hc_ops, triton_ops

        return {**triton_ops.ALL_OPS, **hc_ops.ALL_OPS}[op]

    return load


#: the block-FP8 ops, served from :mod:`.fp8_ops` (a torch and a Triton implementation each)
FP8_OPS = ("linear_fp8", "moe_experts_fp8")


def _fp8_fn(op: str, kind: str) -> Callable[[], Callable]:
    def load() -> Callable:
        from deepinfer_nvidia_sm100 import fp8_ops

        return (fp8_ops.TRITON_OPS if kind == "triton" else fp8_ops.TORCH_OPS)[op]

    return load


def implementations() -> list[Impl]:
    from deepinfer_core.ops.catalogue import CATALOGUE
    from deepinfer_nvidia_sm100 import external

    impls = [Impl(op, "torch", TORCH, _torch_fn(op), _always) for op in CATALOGUE if op not in FP8_OPS]
    impls += [Impl(op, "torch", TORCH, _fp8_fn(op, "torch"), _always) for op in FP8_OPS]
    impls += [Impl(op, "triton", TRITON, _fp8_fn(op, "triton"), _triton_fp8) for op in FP8_OPS]
    impls += [Impl(op, "triton", TRITON, _triton_fn(op), _triton) for op in TRITON_OPS]
    impls += [
        Impl(a.op, a.library, LIBRARY, a.load, a.usable) for a in external.ADAPTERS
    ]
    return impls


def register_all(registry: Any) -> None:
    for impl in implementations():
        registry.register(impl.op, impl.load(), priority=impl.priority, predicate=_predicate(impl))


def _predicate(impl: Impl) -> Callable[[Any], bool]:
    def applies(ctx: Any) -> bool:
        return impl.usable(ctx.device, ctx.dtype, ctx.model_config, True)[0]

    applies.__qualname__ = f"{impl.name}_applies[{impl.op}]"
    return applies


def plan(device: Any = None, dtype: Any = None, model_config: Any = None,
         self_check: bool = True) -> dict[str, str]:
    """op -> name of the implementation that serves it (highest priority that is usable).

    Without ``self_check`` the official-library adapters are judged on their probes alone (no kernel
    runs): their entry then reads ``"<library> (if its self-check passes, else <next>)"``.
    """
    by_op: dict[str, list[Impl]] = {}
    for impl in implementations():
        by_op.setdefault(impl.op, []).append(impl)
    out = {}
    for op, impls in by_op.items():
        chosen = []
        for impl in sorted(impls, key=lambda i: -i.priority):
            try:
                ok = impl.usable(device, dtype, model_config, self_check)[0]
            except Exception:
                ok = False
            if ok:
                chosen.append(impl.name)
                if impl.priority != LIBRARY or self_check:
                    break
        if len(chosen) > 1:
            out[op] = f"{chosen[0]} (if its self-check passes, else {chosen[1]})"
        else:
            out[op] = chosen[0] if chosen else "none"
    return out

"""TileLang-Ascend kernels of the DeepSeek-V4-specific ops, written in ``tilelang.ascend.language``.

Each module builds a ``T.prim_func`` for TileLang's ``ascend`` target (Ascend 950, ``dav-3510``) from
compile-time parameters. Importing a module here imports ``tilelang``: the backend does so only when a
kernel is lowered, compiled or emulated, never when the plugin is imported.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

#: kernel name -> "module:builder" (imported on first use)
KERNELS = {
    "hc_split_sinkhorn": "hc_sinkhorn:hc_split_sinkhorn",
    "sparse_attention_sinks": "sparse_attention:sparse_attention_sinks",
    "compress_windows": "compress_windows:compress_windows",
    "indexer_scores": "indexer_scores:indexer_scores",
    "hc_post": "hc_mix:hc_post",
    "act_quant_fp8": "fp8_gemm:act_quant_fp8",
    "fp8_gemm": "fp8_gemm:fp8_gemm",
    "hc_head_collapse": "hc_mix:hc_head_collapse",
    "fp4_expert_gemm": "fp4_experts:fp4_expert_gemm",
    "fp8_expert_gemm": "fp8_experts:fp8_expert_gemm",
    "act_quant_sim": "act_quant_sim:act_quant_sim",
    "sqrt_softplus": "route_scores:sqrt_softplus",
    "kv_fp8_quant": "kv_fp8:kv_fp8_quant",
    "kv_fp8_dequant": "kv_fp8:kv_fp8_dequant",
}


def builder(name: str) -> Callable[..., Any]:
    module, _, fn = KERNELS[name].partition(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), fn)

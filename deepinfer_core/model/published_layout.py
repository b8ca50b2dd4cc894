"""How DeepSeek published each tensor of DeepSeek-V4 (``inference/model.py``'s dtypes): the linears it
builds in FP8 are E4M3 with ``float8_e8m0fnu`` scales per 128x128 tile; routed experts are FP4 e2m1 packed
two a byte with ``float8_e8m0fnu`` scales per 32 inputs; compressor and indexer-weight projections,
router, embedding and head are bf16; ``tid2eid`` is int32; everything else (norms, mHC, sinks, position
and router biases) float32."""

from __future__ import annotations

import math
import re

#: the linears ``inference/model.py`` builds in the default (FP8) dtype; ``wo_a`` is FP8 in the file too
FP8_NAMES = re.compile(r"(\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)\.weight|\.attn\.indexer\.wq_b\.weight"
                       r"|\.shared_experts\.w[123]\.weight|^mtp\.\d+\.(e_proj|h_proj)\.weight)$")
FP4_NAMES = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
BF16_NAMES = re.compile(r"(^embed\.weight|^head\.weight|\.compressor\.(wkv|wgate)\.weight"
                        r"|\.indexer\.weights_proj\.weight|\.ffn\.gate\.weight)$")


def stored_format(name: str) -> str:
    """"fp8", "fp4", "bf16", "int32" or "fp32": how tensor ``name`` (DeepSeek's name) is in the files."""
    if FP4_NAMES.search(name):
        return "fp4"
    if FP8_NAMES.search(name):
        return "fp8"
    if name.endswith("tid2eid"):
        return "int32"
    return "bf16" if BF16_NAMES.search(name) else "fp32"


def stored_bytes(name: str, shape: tuple[int, ...]) -> int:
    """Bytes of tensor ``name`` of logical ``shape`` [.., out, in] in the files, its block scale included."""
    n = math.prod(shape)
    fmt = stored_format(name)
    if fmt == "fp4":
        return n // 2 + n // 32
    if fmt == "fp8":
        return n + math.ceil(shape[-2] / 128) * math.ceil(shape[-1] / 128)
    return n * (2 if fmt == "bf16" else 4)

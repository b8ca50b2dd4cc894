"""The inputs of ``test_nvidia_fp4_moe.py``, and the script that runs the Triton FP4 grouped MoE on them in a
fresh process on the CPU under Triton's interpreter (the switches must be set before triton is first
imported).

``python nvidia_fp4_moe_worker.py OUT``: saves to ``OUT`` (``torch.save``) the kernel's output for every
case of :data:`CASES` and of :data:`QUANT_ACT_CASES`, the activation quantisation of :func:`act_rows`, and
what the backend's op table resolves each op of :data:`TABLE_OPS` to with ``DEEPINFER_NVIDIA_FP4_TRITON=1``,
with its conformance results.
"""

from __future__ import annotations

import sys

import torch
from nvidia_interpreter import op_table_record

from deepinfer_core.quant.fp4 import e8m0_from_float, pack_fp4

SWIGLU_LIMIT = 10.0


def fp4_weights(g: torch.Generator, experts: int, n: int, k: int, base: int, row_spread: int, group_spread: int,
                scale_dtype: torch.dtype = torch.float8_e8m0fnu, packed_dtype: torch.dtype = torch.uint8):
    """Every e2m1 code equally likely in both nibbles; per row a power of two from 2^-row_spread to
    2^row_spread times 2^base, and per 32-input group another within 2^+-group_spread."""
    codes = torch.randint(0, 16, (experts, n, k), generator=g)
    row = torch.randint(-row_spread, row_spread + 1, (experts, n, 1), generator=g)
    group = torch.randint(-group_spread, group_spread + 1, (experts, n, k // 32), generator=g)
    scale = torch.exp2((base + row + group).float())
    scale = e8m0_from_float(scale) if scale_dtype == torch.float8_e8m0fnu else scale.to(scale_dtype)
    return pack_fp4(codes).view(packed_dtype), scale


def routing(g: torch.Generator, tokens: int, experts: int, k: int, unused: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token, never ``unused``; token 0 routed nowhere (-1: another rank's experts),
    every third token with one -1 slot."""
    pool = torch.tensor([e for e in range(experts) if e != unused])
    ids = torch.stack([pool[torch.randperm(pool.numel(), generator=g)[:k]] for _ in range(tokens)])
    ids[0] = -1
    ids[1::3, k - 1] = -1
    weights = torch.rand(tokens, k, generator=g) + 0.2
    return ids, weights


def moe_case(name: str, dtype: torch.dtype, quant_act: bool) -> tuple:
    """``moe_experts_fp4``'s arguments for the case ``name`` in ``dtype``.

    * ``ragged``: 5 tokens x top-3 of 5 experts (15 pairs: 16-row blocks, each expert's run partial),
      expert 2 with no token; hidden 96 and intermediate 160 (partial K tiles, a partial 128-channel group);
      ue8m0 scales from 2^-15 to 2^5, the down rows spread over 2^16 (output columns of very different
      sizes: their largest values span 0.45 .. 1.2e4).
    * ``big_blocks``: 24 tokens x top-3 of 4 experts (72 pairs: 64-row blocks); int8 packed weights (as
      published) with float32 scales.
    * ``exact``: inputs whose products and sums are exact in float32 (x in multiples of 1/8, weights of
      2^-9 .. 2^-6): with DeepSeek's roundings the kernel gives the native body's bits.
    """
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    if name == "ragged":
        tokens, experts, k, d, inter = 5, 5, 3, 96, 160
        w13, s13 = fp4_weights(g, experts, 2 * inter, d, -5, 2, 2)
        w2, s2 = fp4_weights(g, experts, d, inter, -5, 8, 2)
        x = torch.randn(tokens, d, generator=g)
    elif name == "big_blocks":
        tokens, experts, k, d, inter = 24, 4, 3, 64, 64
        w13, s13 = fp4_weights(g, experts, 2 * inter, d, -4, 1, 1, torch.float32, torch.int8)
        w2, s2 = fp4_weights(g, experts, d, inter, -4, 1, 1, torch.float32, torch.int8)
        x = torch.randn(tokens, d, generator=g)
    elif name == "exact":
        tokens, experts, k, d, inter = 9, 4, 2, 64, 128
        w13, s13 = fp4_weights(g, experts, 2 * inter, d, -8, 0, 1)
        w2, s2 = fp4_weights(g, experts, d, inter, -8, 0, 1)
        x = torch.randint(-8, 9, (tokens, d), generator=g) * 0.125
    else:
        raise KeyError(name)
    ids, weights = routing(g, tokens, experts, k, unused=2)
    if name == "exact":
        weights = torch.randint(1, 8, (tokens, k), generator=g) * 0.125
    return x.to(dtype), w13, s13, w2, s2, ids, weights, SWIGLU_LIMIT, quant_act


#: (case, dtype, quant_act) the kernel runs
CASES = [(name, dtype, quant) for name in ("ragged", "big_blocks") for quant in (False, True)
         for dtype in (torch.float32, torch.bfloat16, torch.float16)]
CASES += [("exact", dtype, True) for dtype in (torch.float32, torch.bfloat16)]


#: DeepSeek's numerics at other activation groups (V4.1: 32), on the ``ragged`` case: (op, block, dtype);
#: the float-weight ops take its FP4 experts dequantised to the dtype (exact)
QUANT_ACT_CASES = [(op, block, dtype) for op, block in (("moe_experts_fp4_quant_act", 32),
                                                       ("moe_experts_quant_act", 32), ("moe_experts_act_quant", 128))
                   for dtype in (torch.float32, torch.bfloat16)]
#: launch shapes other than the default (``triton_ops.Fp4Tiles`` fields) the ``ragged`` case also runs with, in
#: W4A16 float32 and with DeepSeek's numerics in bfloat16: K steps past the rows' ends, narrower columns
TILE_VARIANTS = ({"block_k": 128}, {"block_k": 256, "down_n": 32}, {"up_n": 32, "up_warps": 8, "up_stages": 2})
TILE_CASES = [(tiles, dtype, quant) for tiles in range(len(TILE_VARIANTS))
              for dtype, quant in ((torch.float32, False), (torch.bfloat16, True))]


def tile_case_id(tiles: int, dtype: torch.dtype, quant_act: bool) -> str:
    label = ",".join(f"{k}={v}" for k, v in TILE_VARIANTS[tiles].items())
    return f"{label}-{case_id('ragged', dtype, quant_act)}"


#: the ops the worker records the op table's choice of
TABLE_OPS = ("moe_experts_fp4", "moe_experts_fp4_quant_act", "moe_experts_quant_act", "moe_experts_act_quant")


def quant_act_case(op: str, block: int, dtype: torch.dtype) -> tuple:
    """``op``'s arguments on the ``ragged`` case's tokens, experts and routing."""
    from deepinfer_core.quant.fp4 import dequantize_fp4_block

    x, w13, s13, w2, s2, ids, weights, limit, _ = moe_case("ragged", dtype, True)
    if op == "moe_experts_fp4_quant_act":
        return x, w13, s13, w2, s2, ids, weights, limit, block
    w13f, w2f = (dequantize_fp4_block(w.view(torch.uint8), s.float(), dtype) for w, s in ((w13, s13), (w2, s2)))
    return (x, w13f, w2f, ids, weights, limit) + ((block,) if op == "moe_experts_quant_act" else ())


def quant_act_id(op: str, block: int, dtype: torch.dtype) -> str:
    return f"{op}-{block}-{str(dtype).removeprefix('torch.')}"


def case_id(name: str, dtype: torch.dtype, quant_act: bool) -> str:
    return f"{name}-{str(dtype).removeprefix('torch.')}-{'w4a8_deepseek' if quant_act else 'w4a16'}"


def act_rows(dtype: torch.dtype) -> torch.Tensor:
    """Rows of very different ranges (1e-9 .. 1e4), an all-zero row, E4M3 ties and subnormals, a partial
    last 128-channel group."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(40, 300, generator=g) * torch.logspace(-9, 4, 40).unsqueeze(1)
    x[3] = 0.0
    x[4, :6] = torch.tensor([448.0, 1.0625, 1.1875, -3 * 2.0**-10, 5 * 2.0**-10, 2.0**-7]) * 2.0**-5
    return x.to(dtype)


def main(out_path: str) -> None:
    from deepinfer_nvidia_sm100 import triton_ops

    torch.set_num_threads(1)
    out: dict = {"moe": {}, "act": {}, "tables": {}}
    for name, dtype, quant in CASES:
        out["moe"][case_id(name, dtype, quant)] = triton_ops.moe_experts_fp4(*moe_case(name, dtype, quant))
    out["tiles"] = {}
    for tiles, dtype, quant in TILE_CASES:
        x, w13, s13, w2, s2, ids, weights, limit, _ = moe_case("ragged", dtype, quant)
        slots, lay = triton_ops.grouped_moe_slots(x, w13, s13, w2, s2, ids, weights, limit, quant, 128, True,
                                                  tiles=triton_ops.Fp4Tiles(**TILE_VARIANTS[tiles]))
        out["tiles"][tile_case_id(tiles, dtype, quant)] = lay.combine(slots, dtype)
    out["quant_act"] = {quant_act_id(*c): getattr(triton_ops, c[0])(*quant_act_case(*c)) for c in QUANT_ACT_CASES}
    for dtype in (torch.float32, torch.bfloat16):
        out["act"][str(dtype)] = triton_ops.quantize_act_ue8m0(act_rows(dtype))
        out["act"][f"{dtype}/32"] = triton_ops.quantize_act_ue8m0(act_rows(dtype), 32, dtype)
    for dtype in (torch.float32, torch.bfloat16):
        for op in TABLE_OPS:
            out["tables"][f"{op}/{dtype}"] = op_table_record(op, dtype)
    torch.save(out, out_path)


if __name__ == "__main__":
    main(sys.argv[1])

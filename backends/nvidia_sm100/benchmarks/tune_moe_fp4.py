"""Launch shapes of the Triton FP4 grouped MoE (``triton_ops.grouped_moe_slots``), against its floor.

Random experts quantised as DeepSeek publishes them (FP4 e2m1, ue8m0 scales per 32 inputs), routed top-k
at random. For each token count the MoE runs in W4A16 with the default tiles (``Fp4Tiles()``), then with
one field changed at a time (inputs per step, then the gate/up kernel's, then the down kernel's
columns/warps/stages), each timed to device completion by CUDA-graph replays
(``kernel_timing.cuda_time_ms``) and compared with the default's output. The floor is half the time of
copying the touched experts' FP4 bytes and scales (a copy reads and writes each byte once); the bf16 Triton
MoE of the same experts is the peer. V4.1 widths: ``--experts 384 --hidden 4096 --inter 2048``; V4-Flash:
the defaults. Prints a table per token count and writes JSON:

  python backends/nvidia_sm100/benchmarks/tune_moe_fp4.py --tokens 1,16,64,128 --out tune_moe_fp4.json
"""

from __future__ import annotations

import dataclasses
import json
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

#: one field of Fp4Tiles changed at a time from the default
VARIANTS = (
    {"block_k": 128}, {"block_k": 256},
    {"up_n": 32}, {"up_n": 128, "up_warps": 8}, {"up_warps": 8}, {"up_stages": 4}, {"up_stages": 2},
    {"down_n": 32}, {"down_n": 128, "down_warps": 8}, {"down_warps": 8}, {"down_stages": 4},
)


def main(argv=None) -> list[dict]:
    from deepinfer_nvidia_sm100 import triton_ops
    from kernel_timing import cuda_time_ms
    from moe_problem import moe_arguments, random_experts, token_batches

    from deepinfer_core.quant.fp4 import quantize_fp4_block

    a = moe_arguments(__doc__, "1,16,64,128", "tune_moe_fp4.json").parse_args(argv)
    device, g = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(0)
    w13, w2, q13, s13, q2, s2 = random_experts(a, quantize_fp4_block, g, device)
    per_expert = sum(t[0].numel() * t.element_size() for t in (q13, s13, q2, s2))
    rows = []
    for m, x, ids, weights in token_batches(a, g, device):
        touched = int(ids.unique().numel())
        src = torch.empty(touched * per_expert, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        floor_ms = cuda_time_ms(partial(dst.copy_, src), 2, a.iters) / 2
        bf16_ms = cuda_time_ms(partial(triton_ops.moe_experts, x, w13, w2, ids, weights, 10.0), 2, a.iters)

        def call(tiles, x=x, ids=ids, weights=weights):
            return triton_ops.grouped_moe_slots(x, q13, s13, q2, s2, ids, weights, 10.0, False, 128, True,
                                                tiles=tiles)[0]

        default = triton_ops.Fp4Tiles()
        want = call(default)
        print(f"\n== {m} tokens, {touched} experts: floor {floor_ms:.3f} ms, bf16 Triton MoE {bf16_ms:.3f} ms")
        print(f"{'tiles':<40} {'ms':>8} {'/floor':>7} {'/bf16':>7} {'max err':>9}")
        for change in ({}, *VARIANTS):
            tiles = dataclasses.replace(default, **change)
            row = {"tokens": m, "experts_touched": touched, "tiles": dataclasses.asdict(tiles),
                   "floor_ms": floor_ms, "bf16_ms": bf16_ms}
            label = ", ".join(f"{k}={v}" for k, v in change.items()) or "default"
            try:
                row["max_err"] = ((call(tiles) - want).abs().max() / want.abs().max()).item()
                row["ms"] = cuda_time_ms(partial(call, tiles), 2, a.iters)
            except Exception as exc:  # a tile set past the SM's shared memory or registers
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                print(f"{label:<40} {row['error']}")
                rows.append(row)
                continue
            rows.append(row)
            print(f"{label:<40} {row['ms']:8.3f} {row['ms'] / floor_ms:6.2f}x {row['ms'] / bf16_ms:6.2f}x "
                  f"{row['max_err']:9.2e}")
        timed = [r for r in rows if r["tokens"] == m and "ms" in r]
        best = min(timed, key=lambda r: r["ms"])
        print(f"best: {best['tiles']} {best['ms']:.3f} ms ({best['ms'] / floor_ms:.2f}x the floor)")
    Path(a.out).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()

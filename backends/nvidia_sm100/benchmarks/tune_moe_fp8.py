"""Launch shapes of the Triton FP8 grouped MoE (``fp8_ops.moe_experts_fp8_tiled``) at V4-Flash widths.

For each token count, every tile set of the grid runs the MoE of 256 experts (top 6, hidden 4096,
expert width 2048, random block-FP8 weights) and is timed to device completion by CUDA-graph replays
(``kernel_timing.cuda_time_ms``); its output is compared with the default tiles' (``moe_tiles``). The bf16
Triton MoE of the same inputs is the row each time is divided by. Prints a table per token count and
writes JSON:

  python backends/nvidia_sm100/benchmarks/tune_moe_fp8.py --tokens 512,4096 --out tune_moe_fp8.json
"""

from __future__ import annotations

import itertools
import json
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

BLOCK_M = (64, 128)
UP = ((4, 3), (8, 3), (8, 4), (4, 4))  # (warps, stages)
DOWN = ((64, 4, 3), (128, 4, 3), (128, 8, 3), (128, 8, 4), (256, 8, 3))  # (columns, warps, stages)


def main(argv=None) -> list[dict]:
    from deepinfer_nvidia_sm100 import fp8_ops, triton_ops
    from kernel_timing import cuda_time_ms
    from moe_problem import moe_arguments, random_experts, token_batches

    from deepinfer_core.quant.fp8 import quantize_fp8_block

    ap = moe_arguments(__doc__, "512,4096", "tune_moe_fp8.json")
    ap.add_argument("--profile", action="store_true", help="print the kernels of one call instead of tuning")
    a = ap.parse_args(argv)
    device, g = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(0)
    w13, w2, q13, s13, q2, s2 = random_experts(a, quantize_fp8_block, g, device)
    rows = []
    for m, x, ids, weights in token_batches(a, g, device):
        args = (x, q13, s13, q2, s2, ids, weights, 10.0)
        if a.profile:
            profile_call(m, args)
            continue
        bf16_ms = cuda_time_ms(partial(triton_ops.moe_experts, x, w13, w2, ids, weights, 10.0), 2, a.iters)
        default = fp8_ops.moe_tiles(ids.numel())
        want = fp8_ops.moe_experts_fp8_tiled(*args, tiles=default).float()
        print(f"\n== {m} tokens: bf16 Triton MoE {bf16_ms:.3f} ms; default tiles {default}")
        print(f"{'block_m':>7} {'up w/s':>7} {'down n/w/s':>11} {'ms':>8} {'vs bf16':>8} {'max err':>9}")
        for block_m, (uw, us), (dn, dw, ds) in itertools.product(BLOCK_M, UP, DOWN):
            tiles = fp8_ops.MoeTiles(block_m, uw, us, dn, dw, ds)
            row = {"tokens": m, "tiles": tiles.__dict__, "default": tiles == default, "bf16_ms": bf16_ms}
            try:
                got = fp8_ops.moe_experts_fp8_tiled(*args, tiles=tiles).float()
                row["max_err"] = (got - want).abs().max().item() / want.abs().max().item()
                row["ms"] = cuda_time_ms(partial(fp8_ops.moe_experts_fp8_tiled, *args, tiles=tiles), 2, a.iters)
            except Exception as exc:  # a tile set past the SM's shared memory or registers
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                print(f"{block_m:>7} {uw:>4}/{us} {dn:>6}/{dw}/{ds}  {row['error']}")
                rows.append(row)
                continue
            rows.append(row)
            print(f"{block_m:>7} {uw:>4}/{us} {dn:>6}/{dw}/{ds} {row['ms']:8.3f} {bf16_ms / row['ms']:7.2f}x "
                  f"{row['max_err']:9.2e}{'  (default)' * row['default']}")
        timed = [r for r in rows if r["tokens"] == m and "ms" in r]
        best = min(timed, key=lambda r: r["ms"])
        print(f"best: {best['tiles']} {best['ms']:.3f} ms ({bf16_ms / best['ms']:.2f}x bf16)")
    Path(a.out).write_text(json.dumps(rows, indent=1))
    return rows


def profile_call(tokens: int, args: tuple) -> None:
    """Device time per kernel of one call (after a warm-up call) of each MoE implementation, and the call's
    time by ``cuda_time_ms``."""
    from deepinfer_nvidia_sm100 import external, fp8_ops
    from kernel_timing import cuda_time_ms
    from torch.profiler import ProfilerActivity, profile

    impls = {"triton": fp8_ops.moe_experts_fp8}
    try:
        gemm = external._library("deep_gemm").m_grouped_fp8_gemm_nt_contiguous
        impls["deep_gemm contiguous"] = partial(external.deep_gemm_moe_fp8_with, gemm, external._deep_gemm_alignment())
    except Exception as exc:  # not importable here
        print(f"DeepGEMM: {type(exc).__name__}: {exc}")
    for name, fn in impls.items():
        fn(*args)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn(*args)
            torch.cuda.synchronize()
        kernels = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)
        total = sum(e.self_device_time_total for e in kernels) / 1e3
        ms = cuda_time_ms(partial(fn, *args), 1, 10)
        print(f"\n== {tokens} tokens, {name}: {ms:.3f} ms per call, {total:.3f} ms of kernels")
        for e in kernels[:15]:
            print(f"{e.self_device_time_total / 1e3:9.3f} ms  {e.count:4d}x  {e.key[:100]}")


if __name__ == "__main__":
    main()

"""Sparse-attention decode kernel at DeepSeek-V4-Flash shapes vs FlashMLA's published FP8 times.

Shape per request: 2 query tokens (MTP), 64 heads, head_dim 512, 128 window rows + 512 indexer picks
from a paged bf16 pool, attention sink per head. The FlashMLA figures are its FP8 sparse-decode kernel
on an H200 (bf16 KV moves twice the bytes). ``--configs`` also times other launch configurations of
the Triton kernel, to choose the default.

  python benchmarks/bench_attention.py --out OUT [--configs]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fp8 import cuda_time_ms  # noqa: E402

FLASH_MLA_US = {2: 14.7, 64: 49.0, 128: 93.0, 256: 177.0}
HEADS, DIM, WINDOW, TOPK = 64, 512, 128, 512
CONFIGS = [  # BLOCK_H, BLOCK_K, BLOCK_DV, num_warps, num_stages
    (32, 32, 256, 8, None), (64, 32, 256, 8, None), (64, 32, 512, 8, None), (64, 64, 256, 8, None),
    (16, 32, 512, 4, None), (64, 32, 256, 8, 2), (64, 16, 512, 8, 2), (32, 64, 256, 8, 2),
]


def time_us(fn, iters: int = 50) -> float:
    return 1e3 * cuda_time_ms(fn, warmup=5, iters=iters)


def inputs(batch: int, device: str = "cuda"):
    gen = torch.Generator(device="cpu").manual_seed(batch)
    tokens = 2 * batch
    rows = max(batch * 1024, 4096)
    q = torch.randn(tokens, HEADS, DIM, generator=gen).to(device, torch.bfloat16)
    window_pool = torch.randn(rows, DIM, generator=gen).to(device, torch.bfloat16)
    comp_pool = torch.randn(rows, DIM, generator=gen).to(device, torch.bfloat16)
    win = torch.randint(0, rows, (tokens, WINDOW), generator=gen).to(device)
    extra = torch.randint(0, rows, (tokens, TOPK), generator=gen).to(device)
    sinks = torch.randn(HEADS, generator=gen).to(device, torch.float32)
    return q, window_pool, win, sinks, DIM**-0.5, comp_pool, extra


def launch(args, block_h, block_k, block_dv, warps, stages):
    from deepinfer_nvidia_sm100.triton_ops import _k, _prec

    q, kv, idx, sinks, scale, ekv, eidx = args
    tokens = q.shape[0]
    out = torch.empty_like(q)
    extra = {} if stages is None else {"num_stages": stages}

    def run():
        _k().sparse_attention_kernel[(tokens, HEADS // block_h, DIM // block_dv)](
            q, q.stride(0), q.stride(1), kv, kv.stride(0), kv.shape[0], idx, idx.stride(0), idx.shape[1],
            ekv, ekv.stride(0), ekv.shape[0], eidx, eidx.stride(0), eidx.shape[1], sinks, out, out.stride(0),
            out.stride(1), HEADS, DIM, scale, HAS_EXTRA=True, BLOCK_H=block_h, BLOCK_K=block_k,
            BLOCK_DK=128, BLOCK_DV=block_dv, DOT_PREC=_prec(q.dtype), num_warps=warps, **extra,
        )
        return out

    return run


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="2,64,128,256")
    ap.add_argument("--configs", action="store_true", help="also time other launch configurations")
    ap.add_argument("--out", default="bench_results")
    a = ap.parse_args(argv)
    from deepinfer_core.plugins import build_op_table

    ops = build_op_table("nvidia_sm100", dtype=torch.bfloat16, device=torch.device("cuda"))
    rows = []
    for batch in [int(b) for b in a.batches.split(",")]:
        args = inputs(batch)
        ref = ops.sparse_attention(*args)
        us = time_us(lambda args=args: ops.sparse_attention(*args))
        kv_bytes = 2 * batch * (WINDOW + TOPK) * DIM * 2
        row = {"batch": batch, "tokens": 2 * batch, "provider": ops.provider("sparse_attention"), "us": us,
               "kv_gb_s": kv_bytes / us / 1e3, "flash_mla_fp8_us": FLASH_MLA_US.get(batch)}
        if row["flash_mla_fp8_us"]:
            row["vs_flash_mla"] = us / row["flash_mla_fp8_us"]
        if a.configs:
            row["configs"] = {}
            for cfg in CONFIGS:
                try:
                    run = launch(args, *cfg)
                    err = float((run().float() - ref.float()).abs().max())
                    row["configs"][str(cfg)] = {"us": time_us(run), "max_err": err}
                except Exception as exc:  # a configuration the compiler refuses (registers, shared memory)
                    row["configs"][str(cfg)] = {"error": f"{type(exc).__name__}: {str(exc)[:120]}"}
        rows.append(row)
        print(json.dumps(row))
    print(f"\n{'batch':>5} {'us':>9} {'FlashMLA fp8 us':>15} {'ratio':>6} {'KV GB/s':>8}")
    for r in rows:
        print(f"{r['batch']:>5} {r['us']:>9.1f} {r['flash_mla_fp8_us'] or 0:>15.1f} {r.get('vs_flash_mla', 0):>6.2f} "
              f"{r['kv_gb_s']:>8.0f}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

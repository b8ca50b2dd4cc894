"""The mHC pre-mix (``hc_pre``) at DeepSeek-V4-Flash widths (4 streams x 4096, 24 mixes) on a GPU: the
backend's float32 mixing GEMM + Triton program against DeepGEMM's ``tf32_hc_prenorm_gemm`` + the same
program (the adapter behind ``DEEPINFER_NVIDIA_DEEPGEMM_HC=1``), per token count, timed with CUDA events
after a warm-up; the two outputs' largest difference beside. DeepGEMM's column says why it is missing
where the library is not installed or fails its self-check.

    python backends/nvidia_sm100/benchmarks/bench_hc.py --out hc.json
"""

from __future__ import annotations

import argparse
import json
import os
from functools import partial
from types import SimpleNamespace

import torch
from kernel_timing import cuda_time_ms

TOKENS = (1, 8, 64, 256, 1024, 4096)
HC, HIDDEN, ITERS = 4, 4096, 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from deepinfer_nvidia_sm100 import external, hc_ops

    device = torch.device("cuda")
    os.environ[external.DEEPGEMM_HC_ENV] = "1"
    adapter = next(a for a in external.ADAPTERS if a.fn is external.deep_gemm_hc_pre)
    usable, why = adapter.usable(device, torch.bfloat16, SimpleNamespace(hc_mult=HC, hidden_size=HIDDEN), True)
    g = torch.Generator(device=device).manual_seed(0)
    mixes = (2 + HC) * HC
    fn = torch.randn(mixes, HC * HIDDEN, device=device, generator=g) * 0.01
    base = torch.randn(mixes, device=device, generator=g) * 0.1
    scale = torch.rand(3, device=device, generator=g) + 0.5
    rows = []
    for m in (int(t) for t in args.tokens.split(",")):
        streams = torch.randn(m, HC, HIDDEN, device=device, generator=g).bfloat16()
        call = (streams, fn, base, scale, ITERS, 1e-6, 1e-6)
        row = {"tokens": m, "triton_us": 1e3 * cuda_time_ms(partial(hc_ops.hc_pre, *call), args.warmup, args.iters)}
        if usable:
            row["deep_gemm_us"] = 1e3 * cuda_time_ms(partial(external.deep_gemm_hc_pre, *call), args.warmup,
                                                     args.iters)
            row["max_diff"] = max((a.float() - b.float()).abs().max().item()
                                  for a, b in zip(hc_ops.hc_pre(*call), external.deep_gemm_hc_pre(*call)))
        rows.append(row)
    print(f"{'tokens':>6} {'triton us':>10} {'deep_gemm us':>12} {'ratio':>6} {'max diff':>9}")
    for r in rows:
        lib = r.get("deep_gemm_us")
        cols = f"{lib:12.1f} {lib / r['triton_us']:6.2f} {r['max_diff']:9.2e}" if lib else f"{why[:60]}"
        print(f"{r['tokens']:>6} {r['triton_us']:10.1f} {cols}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "deep_gemm": usable or why, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

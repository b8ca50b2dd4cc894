"""Block-FP8 GEMM and grouped-MoE kernel times against the bf16 ones at DeepSeek-V4-Flash decode shapes, on
a CUDA device: each projection of the model (N, K) and the routed experts (256 experts, top-6, hidden 4096,
moe_intermediate 2048) for M = 1..256 tokens (``--batches``; 4096 for a prefill chunk), device time through
a CUDA graph: the bf16 kernel, the block-FP8 Triton kernel, and DeepGEMM's adapter (``fp8_gemm_nt``; the
masked grouped MoE up to 64 tokens, the contiguous one above) where the library is importable and passes
its self-check. FP8's accuracy against bf16 is ``benchmarks/bench_fp8.py``'s.

    python backends/nvidia_sm100/benchmarks/bench_fp8_kernels.py --out fp8.json
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from types import SimpleNamespace

import torch
from kernel_timing import cuda_time_ms

from deepinfer_core.quant.fp8 import quantize_fp8_block

#: V4-Flash projections (N, K): wq_a, wq_b, wkv, wo_b, shared experts w13 and w2, compressor wkv
LINEAR_SHAPES = {"wq_a": (1024, 4096), "wq_b": (32768, 1024), "wkv": (512, 4096), "wo_b": (4096, 8192),
                 "shared_w13": (4096, 4096), "shared_w2": (4096, 2048), "compressor_wkv": (1024, 4096)}
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: the widths DeepGEMM's adapters are judged on (as for an engine built on V4-Flash)
V4_FLASH_WIDTHS = SimpleNamespace(hidden_size=4096, moe_intermediate_size=2048, q_lora_rank=1024, o_groups=8,
                                  o_lora_rank=1024)


def deep_gemm_impls(device: torch.device) -> dict[str, object]:
    """op -> DeepGEMM's FP8 adapter, for the ops whose adapter is usable here (importable, self-check passed);
    ``moe_experts_fp8_contiguous``: its contiguous grouped GEMM, which the adapter takes above
    ``MASKED_MAX_TOKENS`` tokens only when opted in, when that passes its self-check."""
    from deepinfer_nvidia_sm100 import external

    impls = {a.op: a.fn for a in external.ADAPTERS
             if a.library == "deep_gemm" and a.op in ("linear_fp8", "moe_experts_fp8")
             and a.usable(device, torch.bfloat16, V4_FLASH_WIDTHS, True)[0]}
    if "moe_experts_fp8" in impls and external._self_check("deep_gemm_moe_fp8_contiguous", str(device))[0]:
        impls["moe_experts_fp8_contiguous"] = partial(
            external.deep_gemm_moe_fp8_with, external._library("deep_gemm").m_grouped_fp8_gemm_nt_contiguous,
            external._deep_gemm_alignment())
    return impls


HEADER = (f"{'kernel':22s} {'N':>6s} {'K':>6s} {'M':>5s} {'bf16 us':>9s} {'fp8 us':>9s} {'speedup':>8s} "
          f"{'deep_gemm us':>12s} {'speedup':>8s}")


def print_row(r: dict) -> None:
    lib = r["deep_gemm_ms"]
    lib_cols = f"{1e3 * lib:12.1f} {r['bf16_ms'] / lib:8.2f}" if lib else f"{'-':>12s} {'-':>8s}"
    print(f"{r['kernel']:22s} {r['N']:6d} {r['K']:6d} {r['M']:5d} {1e3 * r['bf16_ms']:9.1f} "
          f"{1e3 * r['fp8_ms']:9.1f} {r['bf16_ms'] / r['fp8_ms']:8.2f} {lib_cols}", flush=True)


def kernels(device: torch.device, batches: tuple[int, ...], warmup: int, iters: int) -> list[dict]:
    """Rows of kernel times, each printed as it is measured."""
    from deepinfer_nvidia_sm100 import external, fp8_ops, triton_ops

    from deepinfer_core.ops import native

    library = deep_gemm_impls(device)
    g = torch.Generator(device=device).manual_seed(0)
    rows = []
    for name, (n, k) in LINEAR_SHAPES.items():
        w = torch.randn(n, k, device=device, generator=g, dtype=torch.bfloat16) * k**-0.5
        q, s = quantize_fp8_block(w)
        for m in batches:
            x = torch.randn(m, k, device=device, generator=g, dtype=torch.bfloat16)
            bf16 = cuda_time_ms(partial(native.linear, x, w), warmup, iters)
            fp8 = cuda_time_ms(partial(fp8_ops.linear_fp8, x, q, s), warmup, iters)
            lib = library.get("linear_fp8")
            rows.append({"kernel": f"linear {name}", "N": n, "K": k, "M": m, "bf16_ms": bf16, "fp8_ms": fp8,
                         "deep_gemm_ms": cuda_time_ms(partial(lib, x, q, s), warmup, iters) if lib else None})
            print_row(rows[-1])
    experts, top_k, d, inter = 256, 6, 4096, 2048
    w13 = torch.randn(experts, 2 * inter, d, device=device, generator=g, dtype=torch.bfloat16) * d**-0.5
    q13, s13 = torch.empty_like(w13, dtype=torch.float8_e4m3fn), torch.empty(experts, 32, 32, device=device)
    for e in range(experts):
        q13[e], s13[e] = quantize_fp8_block(w13[e])
    w2 = torch.randn(experts, d, inter, device=device, generator=g, dtype=torch.bfloat16) * inter**-0.5
    q2, s2 = torch.empty_like(w2, dtype=torch.float8_e4m3fn), torch.empty(experts, 32, 16, device=device)
    for e in range(experts):
        q2[e], s2[e] = quantize_fp8_block(w2[e])
    for m in batches:
        x = torch.randn(m, d, device=device, generator=g, dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(experts, device=device, generator=g)[:top_k] for _ in range(m)])
        weights = torch.rand(m, top_k, device=device, generator=g) + 0.2
        bf16 = cuda_time_ms(partial(triton_ops.moe_experts, x, w13, w2, ids, weights, 10.0), warmup, iters)
        fp8_args = (x, q13, s13, q2, s2, ids, weights, 10.0)
        fp8 = cuda_time_ms(partial(fp8_ops.moe_experts_fp8, *fp8_args), warmup, iters)
        contiguous = m > external.MASKED_MAX_TOKENS
        lib = library.get("moe_experts_fp8_contiguous" if contiguous else "moe_experts_fp8")
        rows.append({"kernel": "moe 256x top6", "N": 2 * inter, "K": d, "M": m, "bf16_ms": bf16, "fp8_ms": fp8,
                     "deep_gemm_ms": cuda_time_ms(partial(lib, *fp8_args), warmup, iters) if lib else None,
                     "deep_gemm_gemm": "contiguous" if contiguous else "masked"})
        print_row(rows[-1])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)), help="M values, comma-separated")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("the FP8 kernels are timed on a CUDA device, and none is visible")
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    batches = tuple(int(b) for b in args.batches.split(","))
    print(HEADER, flush=True)
    result["kernels"] = kernels(torch.device("cuda"), batches, args.warmup, args.iters)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

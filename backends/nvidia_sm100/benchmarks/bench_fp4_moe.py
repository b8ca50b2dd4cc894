"""FP4 routed experts vs bf16 ones, in one run: the grouped MoE op and the decode step at V4-Flash widths.

The model is bench_long_context's (4 layers at V4-Flash widths, random weights, 256 experts top-6). It is
timed with its experts in bf16, then with the same experts quantised to FP4 e2m1 with ue8m0 scales per 32
inputs (as DeepSeek publishes them; ``quantize_fp4_block``), each through a freshly captured decode graph
at ``--context`` tokens for every batch of ``--batches``; the op rows time ``moe_experts`` against
``moe_experts_fp4`` of the backend's op table on one layer's experts (CUDA events), W4A16 and with
DeepSeek's numerics (V4: activations per 128, V4.1's ``moe_experts_fp4_quant_act``: per 32), each against
the floor of reading the touched experts' FP4 bytes, measured in the same run. Step figures: the
median wall time of build + load + replay + sync (``Harness.graph``) and the device time of load + replay
(``Harness.graph_phases``).

  python backends/nvidia_sm100/benchmarks/bench_fp4_moe.py --out fp4_moe.json                     (an H200)

(``DEEPINFER_NVIDIA_FP4_TRITON=0`` times the torch body, which dequantises each expert, instead of the
Triton FP4 grouped MoE)
  python backends/nvidia_sm100/benchmarks/bench_fp4_moe.py --small --device cpu --backend cpu_ref (a CPU smoke test)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from functools import partial
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
# this folder (bench_attention) and the repository's benchmarks (bench_long_context's model and harness)
for _path in (HERE.parents[2] / "benchmarks", HERE):
    sys.path.insert(0, str(_path))
import bench_long_context as blc  # noqa: E402
from bench_attention import timer  # noqa: E402

from deepinfer_core.models.deepseek_v4.weights import Linear  # noqa: E402
from deepinfer_core.quant.fp4 import quantize_fp4_block  # noqa: E402


def to_fp4(linear: Linear, chunk: int = 16) -> Linear:
    """Stacked experts [E, N, K] -> packed e2m1 [E, N, K/2] + ue8m0 scales [E, N, K/32], ``chunk`` experts at
    a time (the quantisation's float32 temporaries stay below a few GB)."""
    w = linear.weight
    packed = torch.empty((*w.shape[:-1], w.shape[-1] // 2), dtype=torch.uint8, device=w.device)
    scale = torch.empty((*w.shape[:-1], w.shape[-1] // 32), dtype=torch.float8_e8m0fnu, device=w.device)
    for e in range(0, w.shape[0], chunk):
        packed[e:e + chunk], scale[e:e + chunk] = quantize_fp4_block(w[e:e + chunk])
    return Linear(packed, scale)


def op_rows(model, batches: list[int], warmup: int, iters: int) -> list[dict]:
    """On layer 1's experts, ``batches`` tokens each: ``moe_experts`` (bf16) against ``moe_experts_fp4`` in W4A16,
    with DeepSeek-V4's activation quantisation (per 128) and ``moe_experts_fp4_quant_act`` with V4.1's (per
    32); the floor is half the time of copying the FP4 bytes and scales of the experts the tokens touch
    (a copy reads and writes each byte once), measured in the same run."""
    ex, ops, device = model.weights.layers[1].moe.experts, model.ops, model.device
    fp4 = (to_fp4(ex.w13), to_fp4(ex.w2))
    experts, top_k, d = ex.w13.weight.shape[0], model.cfg.num_experts_per_tok, model.cfg.hidden_size
    per_expert = sum(t.numel() * t.element_size() // experts
                     for lin in fp4 for t in (lin.weight, lin.scale))
    g = torch.Generator(device=device).manual_seed(0)
    rows = []
    for m in batches:
        x = torch.randn(m, d, device=device, generator=g, dtype=model.dtype)
        ids = torch.stack([torch.randperm(experts, device=device, generator=g)[:top_k] for _ in range(m)])
        weights = torch.rand(m, top_k, device=device, generator=g) + 0.2
        packed = (fp4[0].weight, fp4[0].scale, fp4[1].weight, fp4[1].scale, ids, weights, 10.0)
        calls = {
            "bf16_ms": partial(ops.moe_experts, x, ex.w13.weight, ex.w2.weight, ids, weights, 10.0),
            "fp4_ms": partial(ops.moe_experts_fp4, x, *packed, False),
            "fp4_v4_numerics_ms": partial(ops.moe_experts_fp4, x, *packed, True),
            "fp4_v41_numerics_ms": partial(ops.moe_experts_fp4_quant_act, x, *packed, 32),
        }
        row = {"tokens": m, "experts_touched": int(ids.unique().numel())}
        row.update({name: time_ms(fn, device, warmup, iters) for name, fn in calls.items()})
        src = torch.empty(row["experts_touched"] * per_expert, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        row["floor_ms"] = time_ms(partial(dst.copy_, src), device, warmup, iters) / 2
        rows.append(row)
    return rows


def time_ms(fn, device: torch.device, warmup: int, iters: int) -> float:
    """Median milliseconds of one call (``bench_attention.timer``: CUDA events on a GPU, the host clock on
    the CPU)."""
    return timer(device, warmup, iters)(fn) / 1e3


def step_rows(model, platform, la, context: int, experts: str) -> list[dict]:
    """Decode steps of every batch at ``context`` through a graph captured now (over the model's experts)."""
    h = blc.Harness(model, platform, la)
    rows = []
    for batch in la.batches:
        _, _, step = blc.measure(lambda b=batch: h.graph(context, b), la.warmup, la.reps)
        phases = [h.graph_phases(context, batch) for _ in range(la.reps)]
        rows.append({"experts": experts, "batch": batch, "context": context, "step_ms": step * 1e3,
                     "device_ms": statistics.median(p.get("device", float("nan")) for p in phases)})
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--backend", default="nvidia_sm100")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="bench_gpu_decode's small widths (CPU smoke test)")
    ap.add_argument("--out", default=None, help="JSON file to write")
    a = ap.parse_args(argv)
    la = blc.parse_args(["--gpu", "--contexts", str(a.context), "--batches", a.batches, "--chunk", "0",
                         "--max-model-len", str(a.context + 1), "--reps", str(a.reps), "--backend", a.backend,
                         "--device", a.device] + ["--small"] * a.small)
    if a.device == "cpu":
        la.dtype = "float32"
    dtype, device, platform = blc.setup(la)
    result: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "backend": a.backend, "dtype": str(dtype).split(".")[-1], "context": a.context,
                    "model": "bench_gpu_decode-small" if a.small else "v4-flash-4-layers", "commit": blc.git_commit()}
    with torch.inference_mode():
        model = blc.flash_model(la, dtype)
        la.block_size = la.block_size or 128
        result["ops"] = op_rows(model, la.batches, 3, a.reps)
        rows = step_rows(model, platform, la, a.context, "bf16")
        for block in model.weights.layers:
            ex = block.moe.experts
            ex.w13, ex.w2 = to_fp4(ex.w13), to_fp4(ex.w2)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        rows += step_rows(model, platform, la, a.context, "fp4")
    bf16 = {r["batch"]: r for r in rows if r["experts"] == "bf16"}
    for r in rows:
        r["vs_bf16"] = r["step_ms"] / bf16[r["batch"]]["step_ms"]
    result["steps"] = rows
    print(f"{'op: tokens':>12} {'experts':>7} {'bf16 ms':>9} {'fp4 ms':>9} {'V4 num.':>9} {'V4.1 num.':>9} "
          f"{'floor ms':>9} {'fp4/bf16':>8} {'fp4/floor':>9} {'V4.1/floor':>10}")
    for r in result["ops"]:
        print(f"{r['tokens']:>12} {r['experts_touched']:>7} {r['bf16_ms']:>9.3f} {r['fp4_ms']:>9.3f} "
              f"{r['fp4_v4_numerics_ms']:>9.3f} {r['fp4_v41_numerics_ms']:>9.3f} {r['floor_ms']:>9.4f} "
              f"{r['fp4_ms'] / r['bf16_ms']:>8.2f} {r['fp4_ms'] / r['floor_ms']:>9.2f} "
              f"{r['fp4_v41_numerics_ms'] / r['floor_ms']:>10.2f}")
    print(f"{'step: experts':>14} {'batch':>5} {'step ms':>9} {'device ms':>9} {'vs bf16':>8}")
    for r in rows:
        print(f"{r['experts']:>14} {r['batch']:>5} {r['step_ms']:>9.3f} {r['device_ms']:>9.3f} {r['vs_bf16']:>8.2f}")
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()

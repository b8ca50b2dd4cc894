"""What batch-invariant mode costs: the decode step with the default ops against the batch-invariant ones.

Random weights at V4-Flash widths (``bench_gpu_decode.py``'s model and options: layers, widths, batch
sizes, prompt and generation lengths), one engine per mode on the same tensors; per batch size the
median decode step of each mode and their ratio. Prints a table and writes JSON.

GPU:  python benchmarks/bench_batch_invariance.py --backend nvidia_sm100 --device cuda --batch-sizes 1,16,64
CPU smoke test (cpu_ref has batch-invariant variants too):
      python benchmarks/bench_batch_invariance.py --small --backend cpu_ref --device cpu --batch-sizes 1,2 \
             --gen-len 4 --prompt-len 16 --json-out bench_results/batch_invariance_cpu.json
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_gpu_decode as decode  # noqa: E402

MODES = {"default": False, "batch_invariant": True}
DEFAULT_JSON = "bench_results/batch_invariance.json"


def build_model(rm: decode.RandomModel, batch_invariant: bool):
    """The deepinfer model on ``rm``'s tensors, its ops resolved in the given mode."""
    from deepinfer_core.models.deepseek_v4.model import DeepseekV4Model
    from deepinfer_core.models.deepseek_v4.weights import build_weights
    from deepinfer_core.plugins import build_op_table, load_backend

    a = rm.a
    ops = build_op_table(a.backend, dtype=rm.dtype, device=rm.device, model_config=rm.cfg,
                         batch_invariant=batch_invariant)
    params = decode.convert_params(rm.hf_model, rm.cfg, rm.dtype)
    return DeepseekV4Model(rm.cfg, build_weights(rm.cfg, params, load_backend(a.backend).hook), ops, rm.dtype)


def decode_steps(model, rm: decode.RandomModel, batch: int, prompts: list[list[int]],
                 batch_invariant: bool) -> list[float]:
    """Seconds of every step in which all ``batch`` requests decode one token."""
    from deepinfer_core.sampling.params import SamplingParams

    a = rm.a
    engine = decode.make_engine(model, rm.cfg_dir, backend=a.backend, batch_invariant=batch_invariant,
                                max_model_len=a.prompt_len + a.gen_len + 8, max_num_seqs=max(batch, 1),
                                max_num_batched_tokens=max(2048, a.prompt_len), seed=a.seed)
    scheduled_tokens: list[int] = []
    orig_run = engine._run

    def run(scheduled, prev=None):
        scheduled_tokens[:] = [n for _, n in scheduled]
        return orig_run(scheduled, prev)

    engine._run = run
    params = SamplingParams(temperature=0.0, max_tokens=a.gen_len, min_tokens=a.gen_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    steps = []
    try:
        while engine.has_unfinished_requests():
            scheduled_tokens.clear()
            decode.sync(rm.device)
            t0 = time.perf_counter()
            engine.step()
            decode.sync(rm.device)
            if len(scheduled_tokens) == batch and all(n == 1 for n in scheduled_tokens):
                steps.append(time.perf_counter() - t0)
    finally:
        del engine
    return steps


def summarise(steps: list[float]) -> dict:
    warm = steps[1:] if len(steps) > 2 else steps
    if not warm:
        return {}
    return {"decode_steps": len(steps), "step_ms_median": statistics.median(warm) * 1e3,
            "step_ms_min": min(warm) * 1e3, "step_ms_all": [s * 1e3 for s in steps]}


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(arg.startswith("--json-out") for arg in argv):
        argv += ["--json-out", DEFAULT_JSON]
    a = decode.parse_args(argv)
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    batches = [int(b) for b in a.batch_sizes.split(",") if b.strip()]
    rm = decode.RandomModel(a, device, dtype)
    gen = torch.Generator().manual_seed(a.seed)
    prompts = {b: torch.randint(2, rm.cfg.vocab_size, (b, a.prompt_len), generator=gen).tolist() for b in batches}
    rows = {b: {"batch": b} for b in batches}
    providers = {}
    for mode, invariant in MODES.items():
        model = build_model(rm, invariant)
        providers[mode] = {op: model.ops.provider(op) + (" (batch-invariant)" if impl.batch_invariant else "")
                           for op, impl in model.ops.chosen.items()}
        for b in batches:
            rows[b][mode] = summarise(decode_steps(model, rm, b, prompts[b], invariant))
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for row in rows.values():
        base, inv = row["default"].get("step_ms_median"), row["batch_invariant"].get("step_ms_median")
        row["invariant_over_default"] = inv / base if base and inv else None
    result = {"config": decode.model_summary(a, rm) | {"prompt_len": a.prompt_len, "gen_len": a.gen_len},
              **decode.environment(device), "providers": providers, "rows": [rows[b] for b in batches]}
    rm.cleanup()

    print(f"\ndevice {result['device']}  torch {result['torch']}  triton {result['triton']}  dtype {a.dtype}")
    header = f"{'batch':>5} {'default ms':>10} {'invariant ms':>12} {'ratio':>6} {'default tok/s':>13} " \
             f"{'invariant tok/s':>15}"
    print(header)
    print("-" * len(header))
    for r in result["rows"]:
        base, inv = r["default"].get("step_ms_median"), r["batch_invariant"].get("step_ms_median")

        def fmt(v, spec):
            return format(v, spec) if isinstance(v, (int, float)) else "-"

        print(f"{r['batch']:>5} {fmt(base, '10.3f')} {fmt(inv, '12.3f')} {fmt(r['invariant_over_default'], '6.2f')} "
              f"{fmt(base and r['batch'] * 1e3 / base, '13.1f')} {fmt(inv and r['batch'] * 1e3 / inv, '15.1f')}")
    out = Path(a.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()

"""Host time of one confidence-scheduling plan (``ConfidenceScheduler.plan``), the work the engine does
before every speculative step, per batch size: priced by graph replay times (``StepProfile``, as on a
GPU) and by the learnt step-time curves (eager engines). Synthetic confidences (seeded), k drafts a
sequence; the plan's admitted drafts are printed beside its time. For scale: a plain decode step of the
trained model on the H200 took 1.3 ms at batch 1 and 2.8 ms at batch 64.

    python benchmarks/bench_confidence_plan.py --batch-sizes 1,8,64,256 --json-out plan.json
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from deepinfer_core.spec_decode.confidence import (
    AcceptanceCalibrator,
    Candidate,
    ConfidenceScheduler,
    StepProfile,
    StepTimeModel,
)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _scheduler(pricing: str, k: int, sizes: list[int]) -> ConfidenceScheduler:
    """A calibrated scheduler whose step cost grows with sequences and, less, with tokens."""
    calibrator = AcceptanceCalibrator(min_tests=0)
    if pricing == "graphs":
        seconds = {(n, q): 1e-3 * (1 + 0.02 * n * q) for n in sizes for q in range(1, k + 2)}
        return ConfidenceScheduler(calibrator, profile=StepProfile(seconds))
    step_time = StepTimeModel()
    for n in sizes:
        for q in range(1, k + 2):
            step_time.observe(n * q, 1e-3 * (1 + 0.03 * n + 0.005 * n * q), n)
    return ConfidenceScheduler(calibrator, step_time)


def run(args) -> dict:
    rng = random.Random(0)
    rows = []
    for pricing in ("graphs", "eager"):
        scheduler = _scheduler(pricing, args.k, args.batch_sizes)
        for batch in args.batch_sizes:
            cands = [Candidate(i, [rng.random() for _ in range(args.k)], args.k) for i in range(batch)]
            scheduler.plan(cands, batch, batch, num_seqs=batch, batch=batch)  # warm
            begin = time.perf_counter()
            for _ in range(args.repeats):
                admitted = scheduler.plan(cands, batch, batch, num_seqs=batch, batch=batch)
            ms = (time.perf_counter() - begin) / args.repeats * 1e3
            rows.append({"pricing": pricing, "batch": batch, "plan_ms": ms, "drafts_admitted": sum(admitted.values())})
    print(f"{'pricing':>8} {'batch':>5} {'plan ms':>8} {'admitted':>8}")
    for r in rows:
        print(f"{r['pricing']:>8} {r['batch']:>5} {r['plan_ms']:>8.3f} {r['drafts_admitted']:>8}")
    return {"benchmark": "confidence_plan", "k": args.k, "repeats": args.repeats, "rows": rows}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=_ints, default=[1, 8, 64, 256], metavar="B,B,...")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--json-out", default=None, metavar="FILE")
    args = ap.parse_args(argv)
    report = run(args)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()

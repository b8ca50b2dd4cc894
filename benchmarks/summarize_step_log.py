"""Where the runs of a speculative decoding benchmark spent their time, from its step log
(``bench_spec_decode.py --step-log``): per mode and batch size, a run's mean milliseconds in steps that
admit prompts (they have prompt chunks and launch eagerly) and in all-decode steps, by whether they
speculated and by bucket of sequences (the next power of two).

A step's time runs from its launch or the previous step's output, whichever is later, to its output
(from the run's start for a step launched before it). The engine reads step N's output after launching
N+1, so the eager launch of a step with prompt chunks lands in the time of the step read after it: that
step is charged to the admission too.

    python benchmarks/summarize_step_log.py RESULT.json [RESULT.json ...] [--json-out OUT.json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import defaultdict


def _bucket(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _decode_only(step: list, k: int) -> bool:
    """A log entry's decode-only flag; logs written before it was logged: no more tokens than its
    sequences' spans hold (``k`` drafts each)."""
    if len(step) > 6:
        return bool(step[6])
    return step[3] <= step[2] * (1 + (k if step[4] else 0))


def split_run(steps: list[list], run_seconds: float, k: int = 0) -> dict[str, list[float]]:
    """Milliseconds of each step of one run by kind: "admit" (a step with prompt chunks, with the step read
    after its launch), "spec B" / "plain B" (all-decode steps of B sequences at most)."""
    if not steps:
        return {}
    start = steps[-1][0] - 1e3 * run_seconds
    kinds, ms, prev = [], [], None
    for step in steps:
        finish, launch = step[0], step[1]
        begin = max(launch, start) if prev is None else max(launch, prev)
        ms.append(max(0.0, finish - begin))
        prev = finish
        spec = step[4] and (k or len(step) > 6)  # older logs flag an engine without speculation's steps too
        kinds.append(f"{'spec' if spec else 'plain'} {_bucket(step[2])}" if _decode_only(step, k) else "admit")
    for i in range(1, len(steps)):
        if kinds[i] == "admit" and kinds[i - 1] != "admit":
            kinds[i - 1] = "admit"
    out: dict[str, list[float]] = defaultdict(list)
    for kind, t in zip(kinds, ms):
        out[kind].append(t)
    return dict(out)


def summarize(report: dict) -> list[dict]:
    rows = []
    for row in report.get("rows", []):
        runs = row.get("step_log")
        if not runs:
            continue
        match = re.search(r"k=(\d+)", row["mode"])
        k = int(match.group(1)) if match else 0
        seconds = row.get("run_seconds") or [row["seconds"]] * len(runs)
        kinds: dict[str, list[list[float]]] = defaultdict(list)
        for steps, s in zip(runs, seconds[-len(runs):]):
            for kind, ms in split_run(steps, s, k).items():
                kinds[kind].append(ms)
        total = sum(sum(ms) for per_run in kinds.values() for ms in per_run) / len(runs)
        parts = {}
        for kind, per_run in sorted(kinds.items(), key=lambda kv: (kv[0] != "admit", kv[0].split()[0],
                                                                   int(kv[0].split()[-1]) if " " in kv[0] else 0)):
            every = [t for ms in per_run for t in ms]
            run_ms = sum(every) / len(runs)
            parts[kind] = {"steps_per_run": len(every) / len(runs), "ms_per_run": run_ms,
                           "share": run_ms / total if total else 0.0, "median_ms": statistics.median(every)}
        rows.append({"mode": row["mode"], "batch": row["batch"], "runs": len(runs), "ms_per_run": total,
                     "steps_per_run": sum(len(s) for s in runs) / len(runs), "parts": parts})
    return rows


def _print(rows: list[dict]) -> None:
    for r in rows:
        print(f"\n{r['mode']} batch {r['batch']}: {r['ms_per_run']:.0f} ms a run in {r['steps_per_run']:.0f} steps "
              f"(mean of {r['runs']} runs)")
        print(f"  {'steps':<10} {'per run':>8} {'ms/run':>8} {'share':>6} {'median ms':>9}")
        for kind, p in r["parts"].items():
            print(f"  {kind:<10} {p['steps_per_run']:>8.1f} {p['ms_per_run']:>8.1f} {p['share']:>6.1%} "
                  f"{p['median_ms']:>9.2f}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="JSON written by bench_spec_decode.py --step-log")
    ap.add_argument("--json-out", default=None, metavar="FILE")
    args = ap.parse_args(argv)
    out = {"benchmark": "step_log_summary", "files": {}}
    for path in args.results:
        with open(path) as f:
            rows = summarize(json.load(f))
        if not rows:
            print(f"{path}: no step log (run the benchmark with --step-log)", file=sys.stderr)
        print(f"# {path}")
        _print(rows)
        out["files"][path] = rows
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()

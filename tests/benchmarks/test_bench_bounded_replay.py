"""benchmarks/bench_bounded_replay.py at small sizes on the CPU: every mode is timed, the report carries the
speed-up, the FLOPs estimate (compact below the full prefill, mask equal to it) and the quality columns,
and the table and JSON are written."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_tiny_run_reports_every_mode(tmp_path):
    sys.path.insert(0, str(BENCHMARKS))
    import bench_bounded_replay as bbr

    threads = torch.get_num_threads()
    out = tmp_path / "replay.json"
    try:
        report = bbr.main(["--lengths", "40", "--chunk", "16", "--reps", "1", "--threads", "1", "--quality",
                           "--quality-tokens", "4", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert json.loads(out.read_text())["rows"] == report["rows"]
    rows = {r["mode"]: r for r in report["rows"]}
    assert set(rows) == {"full", "mask", "compact"} and report["keep"] == 8 and report["late_layers"] == [5, 6, 7]
    assert all(r["ttft_s"] > 0 and r["speedup"] > 0 for r in rows.values())
    assert rows["compact"]["gflops_per_token"] < rows["full"]["gflops_per_token"] == rows["mask"]["gflops_per_token"]
    # the two implementations cut the same: the same difference to the full prefill
    assert rows["mask"]["max_logprob_diff"] == rows["compact"]["max_logprob_diff"] or \
        abs(rows["mask"]["max_logprob_diff"] - rows["compact"]["max_logprob_diff"]) < 1e-6
    assert rows["compact"]["max_logprob_diff"] > 0 and 0 <= rows["compact"]["greedy_agreement"] <= 1

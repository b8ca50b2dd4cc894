"""benchmarks/bench_long_context.py on the tiny CPU model: ``--kv-fp8`` times the steps on DeepSeek's FP8 KV
entries, and the report says which cache layout it measured."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_kv_fp8_measures_the_fp8_entries(tmp_path):
    sys.path.insert(0, str(BENCHMARKS))
    import bench_long_context as blc

    threads = torch.get_num_threads()
    try:
        reports = [blc.main(["--contexts", "256", "--batches", "1", "--max-model-len", "1024", "--chunk", "0",
                             "--reps", "1", "--warmup", "0", *extra, "--out", str(tmp_path / f"{i}.json")])
                   for i, extra in enumerate(([], ["--kv-fp8"]))]
    finally:
        torch.set_num_threads(threads)  # the benchmark's setup sets the CPU's thread count
    plain, fp8 = reports
    assert fp8["kv_layout"] == "fp8_ds" and plain["kv_layout"] != "fp8_ds"
    for report in reports:
        (row,) = report["rows"]
        assert row["context"] == 256 and row["eager_step_ms"] > 0 and row["graph_step_ms"] > 0

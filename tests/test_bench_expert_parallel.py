"""benchmarks/bench_expert_parallel.py at a small scale: one process against two expert-parallel ranks, one
EPLB run on a skewed load; the figures come out, tokens match one process, weight bytes match the plan."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import engine_fixtures

one_torch_thread = engine_fixtures.one_torch_thread
BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_expert_parallel.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_expert_parallel", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_expert_parallel_smoke(tmp_path, capsys):
    out = tmp_path / "ep.json"
    report = _bench().main(["--ranks", "1,2", "--dp-only-ranks=", "--eplb-ranks", "2", "--repeats", "1",
                            "--scale", "0.1", "--eplb-steps", "5", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "## Step-time overhead" in printed and "## EPLB, 2 ranks" in printed and "deepinfer plan" in printed
    assert json.loads(out.read_text())["commit"] == report["commit"]
    one, two = report["overhead"]
    assert (one["ranks"], two["ranks"], two["expert_parallel"]) == (1, 2, True)
    assert two["tokens_equal_baseline"] and two["decode_step_ms_mean"] > 0 and two["decode_steps_per_run"] > 0
    (run,) = report["eplb"]
    assert run["tokens_equal_1_rank"] and run["window_pairs"] == run["pairs_before"] > 0
    assert run["engine_stats"]["after"]["balancedness"] > run["engine_stats"]["before"]["balancedness"]
    for entry in (one, two, run):
        keys = ("weight_bytes", "expert_bytes", "kv_bytes")
        assert [{k: r[k] for k in keys} for r in entry["measured"]] == [{k: r[k] for k in keys} for r in entry["plan"]]

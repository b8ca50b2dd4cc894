"""benchmarks/bench_expert_parallel.py at a small scale (one process timed, one two-rank EPLB run on a skewed
load): the tables and the JSON come out, tokens match one process, the rearrangement balances, and the
measured weight bytes are the plan's."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import engine_fixtures
import pytest

one_torch_thread = engine_fixtures.one_torch_thread
BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_expert_parallel.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_expert_parallel", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_bench_expert_parallel_smoke(tmp_path, capsys):
    out = tmp_path / "ep.json"
    report = _bench().main(["--ranks", "1", "--dp-only-ranks=", "--eplb-ranks", "2", "--repeats", "1",
                            "--scale", "0.1", "--eplb-steps", "5", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "## Step-time overhead" in printed and "## EPLB, 2 ranks" in printed and "deepinfer plan" in printed
    assert json.loads(out.read_text())["commit"] == report["commit"]
    (one,) = report["overhead"]
    assert one["ranks"] == 1 and one["decode_step_ms_mean"] > 0 and one["decode_steps_per_run"] > 0
    (run,) = report["eplb"]
    assert run["tokens_equal_1_rank"] and run["window_pairs"] == run["pairs_before"] > 0
    assert run["engine_stats"]["after"]["balancedness"] > run["engine_stats"]["before"]["balancedness"]
    for entry in (one, run):
        keys = ("weight_bytes", "expert_bytes", "kv_bytes")
        assert [{k: r[k] for k in keys} for r in entry["measured"]] == [{k: r[k] for k in keys} for r in entry["plan"]]

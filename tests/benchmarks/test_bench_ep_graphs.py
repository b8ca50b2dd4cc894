"""benchmarks/bench_ep_graphs.py on the CPU at tiny widths: one gloo rank, the all_to_all dispatcher on every
MoE layer, eagerly and through the padded graph layouts (uncaptured: what a replay computes); both give the
plain engine's greedy tokens and every batch size gets its three step times."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_eager_and_graph_steps_with_the_dispatcher_on_one_rank(tmp_path):
    sys.path.insert(0, str(BENCHMARKS))
    import bench_ep_graphs

    out = tmp_path / "ep_graphs.json"
    report = bench_ep_graphs.main(["--small", "--batch-sizes", "1,3", "--steps", "2", "--warmup", "1",
                                   "--prompt-len", "6", "--check-tokens", "4", "--out", str(out)])
    assert out.is_file()
    assert report["dispatcher"] == "AllToAllDispatcher" and report["graphs"] == "uncaptured"
    assert report["tokens_equal"] == {"ep eager": True, "ep graphs": True}
    assert report["graph_counts"]["replays"] > 0 and report["graph_counts"]["size 3"] > 0
    assert [r["batch"] for r in report["rows"]] == [1, 3]
    assert all(r[f"{m} ms"] > 0 for r in report["rows"] for m in bench_ep_graphs.MODES)

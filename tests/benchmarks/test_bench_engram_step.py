"""benchmarks/bench_engram_step.py at a sixteenth of V4.1's widths on the CPU: the release's first 3 layers
(its first Engram layer and KV source), tables written to a file and placed by the loader's ``place_tables``,
an engine a placement; every placement and batch gets a step time and its difference to the step without
Engram."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
RELEASE = Path(__file__).resolve().parents[3] / "shared" / "reference" / "deepseek-v4.1-flash"


@pytest.mark.skipif(not RELEASE.is_dir(), reason="the release's config is not beside the repository")
def test_each_placement_is_timed_against_the_step_without_engram(tmp_path):
    sys.path.insert(0, str(BENCHMARKS))
    import bench_engram_step

    out = tmp_path / "engram_step.json"
    report = bench_engram_step.main(["--shrink", "16", "--layers", "3", "--experts", "4", "--rows", "20000",
                                     "--batches", "1,3", "--steps", "2", "--warmup", "1", "--prompt-len", "6",
                                     "--placements", "none,host,file", "--dir", str(tmp_path), "--out", str(out)])
    assert out.is_file()
    assert report["engram_layers"] == [1] and 20_000 <= report["table_rows"][0] < 30_000
    assert [(r["placement"], r["batch"]) for r in report["rows"]] == [
        (p, b) for p in ("none", "host", "file") for b in (1, 3)]
    assert all(r["step_ms"] > 0 and "added_pct" in r and len(r["steps_ms"]) == 2 for r in report["rows"])
    assert report["residence"]["none"] == [] and report["failed"] == {}
    assert report["residence"]["host"] == ["anonymous"]
    assert all(where.endswith("engram.safetensors") for where in report["residence"]["file"])

"""The step log summary: step times from launch or the previous output, admissions charged with the step
read after their launch, logs with and without the decode-only flag."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import summarize_step_log as ssl  # noqa: E402

# [finish ms, launch ms, sequences, tokens, speculative, output tokens, decode only]
RUN = [
    [130.0, 100.0, 4, 64, 1, 4, 0],  # the prompts: 30 ms from its launch
    [134.0, 110.0, 4, 16, 1, 10, 1],  # launched during the one before: 4 ms from its output
    [150.0, 132.0, 4, 16, 1, 10, 1],  # read after the admission below was launched: charged to it
    [160.0, 148.0, 5, 30, 1, 12, 0],  # admits a prompt
    [163.0, 158.0, 5, 5, 0, 5, 1],  # a plain step of 5 sequences (bucket 8)
]


def test_a_run_splits_into_admissions_and_decode_buckets():
    parts = ssl.split_run(RUN, run_seconds=0.07, k=3)
    assert parts == {"admit": [30.0, 16.0, 10.0], "spec 4": [4.0], "plain 8": [3.0]}


def test_a_step_launched_before_the_run_is_timed_from_its_start():
    stale = [[105.0, 10.0, 1, 3, 1, 0, 1]] + RUN  # read after the prompts' launch: an admission's too
    parts = ssl.split_run(stale, run_seconds=0.063, k=3)  # the run began at 100 ms
    assert parts["admit"][:2] == [5.0, 25.0]


def test_older_logs_infer_decode_steps_from_their_tokens():
    old = [step[:6] for step in RUN]
    assert ssl.split_run(old, 0.07, k=3) == ssl.split_run(RUN, 0.07, k=3)
    plain_engine = [[10.0, 0.0, 2, 2, 1, 2], [12.0, 9.0, 2, 2, 1, 2]]  # flagged speculative, no drafts
    assert set(ssl.split_run(plain_engine, 0.012, k=0)) == {"plain 2"}


def test_summary_shares_add_up_and_the_cli_writes_json(tmp_path, capsys):
    report = {"rows": [{"mode": "k=3", "batch": 4, "seconds": 0.07, "run_seconds": [0.07, 0.07],
                        "step_log": [RUN, RUN]}, {"mode": "off", "batch": 4, "seconds": 1.0}]}
    src, dst = tmp_path / "r.json", tmp_path / "s.json"
    src.write_text(json.dumps(report))
    out = ssl.main([str(src), "--json-out", str(dst)])
    (row,) = out["files"][str(src)]
    assert row["runs"] == 2 and row["ms_per_run"] == pytest.approx(63.0)
    assert sum(p["share"] for p in row["parts"].values()) == pytest.approx(1.0)
    assert row["parts"]["admit"]["ms_per_run"] == pytest.approx(56.0)
    assert json.loads(dst.read_text())["files"][str(src)][0]["parts"]["spec 4"]["steps_per_run"] == 1
    assert "admit" in capsys.readouterr().out

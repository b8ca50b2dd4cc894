"""benchmarks/bench_bounded_replay.py --model on a tiny V4.1 checkpoint (Engram in early layers only, which
bounded replay can cut) at short lengths: prompts and continuations come from the stdlib's held-out text
and every mode reports its held-out perplexity, top-1, greedy agreement and logprob difference to the
full prefill; a checkpoint with Engram after its last KV source is refused with the reason."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture()
def bench():
    sys.path.insert(0, str(BENCHMARKS))
    import bench_bounded_replay as bbr

    threads = torch.get_num_threads()
    yield bbr
    torch.set_num_threads(threads)


def run(bbr, model: Path, out: Path) -> dict:
    return bbr.main(["--model", str(model), "--lengths", "24,40", "--chunk", "16", "--reps", "1", "--threads", "1",
                     "--quality", "--quality-tokens", "4", "--out", str(out)])


def test_model_run_reports_heldout_quality(bench, tmp_path):
    from deepinfer_core.testing.tiny_v41 import build_tiny_v41

    model = build_tiny_v41(tmp_path / "v41", with_drafter=False, engram_layer_ids=[1, 3])
    out = tmp_path / "replay.json"
    report = run(bench, model, out)
    assert json.loads(out.read_text()) == report
    assert report["preset"] == "model" and report["model"] == "v41" and "refused" not in report
    assert report["heldout"]["files"] and report["heldout"]["tokens"] == 44 and report["late_layers"] == [5, 6, 7]
    rows = {(r["length"], r["mode"]): r for r in report["rows"]}
    assert set(rows) == {(n, m) for n in (24, 40) for m in ("full", "mask", "compact")}
    for (_, mode), r in rows.items():
        assert r["ttft_s"] > 0 and r["quality_tokens"] == 4 and r["ppl"] > 1 and 0 <= r["top1"] <= 1
        assert 0 <= r["greedy_agreement"] <= 1 and r["max_logprob_diff"] >= 0
        if mode == "full":
            assert r["greedy_agreement"] == 1 and r["max_logprob_diff"] == 0
    for length in (24, 40):  # the two implementations cut the same
        mask, compact = rows[length, "mask"], rows[length, "compact"]
        assert abs(mask["ppl"] - compact["ppl"]) < 1e-4 * mask["ppl"]
        assert compact["max_logprob_diff"] > 0  # the prompts are longer than keep: the cut changes something


def test_model_with_late_engram_is_refused(bench, tmp_path, capsys):
    from deepinfer_core.testing.tiny_v41 import build_tiny_v41

    model = build_tiny_v41(tmp_path / "late", with_drafter=False)  # Engram on layers 1 and 5 (after source 4)
    out = tmp_path / "replay.json"
    report = run(bench, model, out)
    assert report["rows"] == [] and "carry Engram" in report["refused"]
    assert json.loads(out.read_text())["refused"] == report["refused"]
    assert "bounded replay refused" in capsys.readouterr().out

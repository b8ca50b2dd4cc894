"""benchmarks/profile_decode.py on the CPU at small widths. --context: decode steps at a context nothing was
prefilled for, eager and through a decode graph (run eagerly from its static buffers on the CPU), profiled
into the per-event table and JSON; on the CPU the times are CPU times."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
CONTEXT, BATCH, STEPS, ROWS = 1024, 2, 2, 10


@pytest.fixture
def profile_decode():
    sys.path.insert(0, str(BENCHMARKS))
    import profile_decode

    threads = torch.get_num_threads()
    yield profile_decode
    torch.set_num_threads(threads)  # bench_long_context's setup sets the CPU's thread count


def _run(profile_decode, out: Path, *extra: str) -> dict:
    return profile_decode.main(["--context", str(CONTEXT), "--batch", str(BATCH), "--steps", str(STEPS),
                                "--warmup", "1", "--rows", str(ROWS), "--small", "--device", "cpu",
                                "--backend", "cpu_ref", "--out", str(out), *extra])


@pytest.mark.parametrize("mode", ["eager", "graphs"])
def test_profile_at_context(profile_decode, tmp_path, capsys, mode):
    summary = _run(profile_decode, tmp_path, *(["--eager"] if mode == "eager" else []))
    tag = f"ctx{CONTEXT}_b{BATCH}_{mode}"
    written = json.loads((tmp_path / f"profile_{tag}.json").read_text())
    assert written == json.loads(json.dumps(summary))
    assert summary["mode"] == tag and summary["batch"] == BATCH and summary["context"] == CONTEXT
    assert summary["time"] == "cpu" and summary["device"] == "cpu"
    assert summary["max_model_len"] == (None if mode == "eager" else CONTEXT + 1)
    assert summary["step_ms"] > 0 and summary["device_ms_per_step"] > 0
    top = summary["top"]
    assert 0 < len(top) <= ROWS
    assert all(isinstance(k, str) and v >= 0 for k, v in top) and top[0][1] > 0
    assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    assert sum(v for _, v in top) <= summary["device_ms_per_step"] * (1 + 1e-6)
    assert "Self CPU" in (tmp_path / f"profile_{tag}.txt").read_text()
    printed = capsys.readouterr().out
    assert f"== {tag}: CPU time" in printed and top[0][0][:110] in printed


def test_graph_capacity_below_the_context_is_refused(profile_decode, tmp_path):
    with pytest.raises(SystemExit, match="holds no decode step"):
        _run(profile_decode, tmp_path, "--max-model-len", str(CONTEXT))


def test_prefill_profile_times_one_chunk_per_prompt(profile_decode, tmp_path, capsys):
    prompt = 64
    summary = profile_decode.main(["--prefill", "--batch", str(BATCH), "--prompt-len", str(prompt), "--rows",
                                   str(ROWS), "--small", "--device", "cpu", "--backend", "cpu_ref",
                                   "--out", str(tmp_path)])
    tag = f"prefill{prompt}_b{BATCH}_graphs"
    assert json.loads((tmp_path / f"profile_{tag}.json").read_text()) == json.loads(json.dumps(summary))
    assert summary["prefill_steps"] == BATCH  # the chunk budget is one prompt
    assert summary["step_ms"] > 0 and summary["prefill_tok_s"] == pytest.approx(prompt / summary["step_ms"] * 1e3)
    assert 0 < summary["device_ms_per_step"] and f"== {tag}: CPU time" in capsys.readouterr().out
    phases = summary["phases_ms"]  # the timed round's runner calls, on the CPU without device spans
    assert set(phases) == {"prepare_host", "execute_host"} and 0 < phases["execute_host"] < summary["step_ms"]
    assert summary["host_top"] and all(n >= 0 and ms >= 0 for _, n, ms in summary["host_top"])

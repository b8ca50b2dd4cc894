"""``deepinfer bench --mode sweep`` on tiny random weights on the CPU: the JSON's figures, floors below the
measured step times, the markdown table, a failing engine config recorded, and ``--plot-only``."""

from __future__ import annotations

import ast
import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest

from deepinfer_core.entrypoints import cli
from deepinfer_core.entrypoints.cli_bench import load_sweep_cli

CHECKOUT = Path(__file__).resolve().parents[2]

CONFIGS = ("eager", "eager+async")
BATCHES = (1, 2)
CHUNKS = (32, 64)
GEN_LEN = 6


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """One sweep run; the ``graphs`` config is made to fail on building its engine."""
    load_sweep_cli(CHECKOUT)  # puts the checkout's benchmarks package on the path
    from benchmarks import bench_gpu_decode as bgd

    out = tmp_path_factory.mktemp("sweep")
    make_engine = bgd.make_engine

    def engine_without_graphs(model, cfg_dir, **args):
        if not args.get("enforce_eager", True):
            raise RuntimeError("graphs are not supported here")
        return make_engine(model, cfg_dir, **args)

    stdout = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(stdout):
        mp.setattr(bgd, "make_engine", engine_without_graphs)
        code = cli.main([
            "bench", "--mode", "sweep", "--small", "--backend", "cpu_ref", "--device", "cpu", "--threads", "1",
            "--configs", ",".join((*CONFIGS, "graphs")), "--batch-sizes", ",".join(map(str, BATCHES)),
            "--prompt-len", "16", "--gen-len", str(GEN_LEN), "--warmup-steps", "1",
            "--chunk-sizes", ",".join(map(str, CHUNKS)), "--out", str(out), "--checkout", str(CHECKOUT),
        ])
    assert code == 0
    return out, json.loads((out / "sweep.json").read_text()), stdout.getvalue()


def test_json_has_environment_and_options(sweep):
    _, report, _ = sweep
    env = report["environment"]
    for key in ("device", "torch", "transformers", "triton", "python", "date"):
        assert key in env
    assert env["device"] == "cpu" and env["copy_bandwidth_gb_s"] > 0 and env["matmul_tflops"] > 0
    opts = report["options"]
    assert opts["batch_sizes"] == list(BATCHES) and opts["chunk_sizes"] == list(CHUNKS)
    assert opts["configs"] == [*CONFIGS, "graphs"] and opts["prefill_len"] == max(CHUNKS)
    assert report["model"]["small"] and report["model"]["layers"] == 4


def test_decode_steps_and_floors(sweep):
    _, report, _ = sweep
    for name in CONFIGS:
        rows = report["configs"][name]["decode"]
        assert [r["batch"] for r in rows] == list(BATCHES)
        for row in rows:
            steps = row["steps"]
            assert len(steps) >= GEN_LEN
            for step in steps:
                assert step["seqs"] == row["batch"] and step["tokens"] == row["batch"]
                assert step["routing"] == "recorded" and len(step["unique_experts"]) == 4
                assert 0 < step["floor_s"] < step["wall_s"]
                assert step["floor_bw_s"] > 0 and step["floor_compute_s"] > 0 and step["flops"] > 0
                assert 0 < step["forward_s"] <= step["wall_s"] and step["sample_s"] > 0
            s = row["summary"]
            assert s["steps"] == len(steps) - 1
            assert s["tok_s"] == pytest.approx(row["batch"] * 1e3 / s["step_ms"])
            assert s["per_user_tok_s"] == pytest.approx(1e3 / s["step_ms"])
            assert 0 < s["floor_ms"] < s["step_ms"] and s["step_over_floor"] > 1
            assert s["engine_over_transformers"] > 0


def test_prefill_chunks_and_floors(sweep):
    _, report, _ = sweep
    for name in CONFIGS:
        rows = report["configs"][name]["prefill"]
        assert [r["chunk"] for r in rows] == list(CHUNKS)
        for row in rows:
            assert [st["tokens"] for st in row["steps"]] == [row["chunk"]] * (max(CHUNKS) // row["chunk"])
            s = row["summary"]
            assert s["tokens"] == max(CHUNKS) and s["tok_s"] > 0 and 0 < s["matmul_fraction"] < 1
            assert 0 < s["floor_ms"] < s["time_ms"]
    hf = report["transformers"]
    assert [r["batch"] for r in hf["decode"]] == list(BATCHES) and all(r["tok_s"] > 0 for r in hf["decode"])
    assert [r["chunk"] for r in hf["prefill"]] == list(CHUNKS) and all(r["tok_s"] > 0 for r in hf["prefill"])


def test_failing_config_is_recorded_and_the_sweep_goes_on(sweep):
    _, report, stdout = sweep
    graphs = report["configs"]["graphs"]
    assert "graphs are not supported here" in graphs["error"] and graphs["decode"] == []
    assert all("graphs are not supported here" in r["error"] for r in graphs["prefill"])
    assert "## Errors" in stdout and "- graphs: RuntimeError: graphs are not supported here" in stdout


def test_markdown_table_printed_and_written(sweep):
    out, _, stdout = sweep
    assert (out / "summary.md").read_text().strip() == stdout.strip()
    lines = stdout.splitlines()
    header = next(line for line in lines if line.startswith("| batch | config | step ms"))
    assert "HF tok/s" in header and "engine/HF" in header and "floor ms" in header and "step/floor" in header
    table = []
    for line in lines[lines.index(header) + 2:]:
        if not line.startswith("| "):
            break
        table.append(tuple(cell.strip() for cell in line.split("|")[1:3]))
    assert table == [(str(b), c) for b in BATCHES for c in CONFIGS]  # the failed config has no decode rows
    assert any(line.startswith("| chunk | config | tok/s") for line in lines)


def test_plot_only_redraws_from_the_json(sweep, tmp_path):
    pytest.importorskip("matplotlib")
    out, _, _ = sweep
    shutil.copy(out / "sweep.json", tmp_path / "sweep.json")
    redraw_dir = tmp_path / "plots"
    assert cli.main(["bench", "--mode", "sweep", "--plot-only", str(tmp_path / "sweep.json"),
                     "--out", str(redraw_dir), "--checkout", str(CHECKOUT)]) == 0
    for name in ("pareto.png", "breakdown.png"):
        assert (redraw_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (redraw_dir / "summary.md").read_text() == (out / "summary.md").read_text()


def test_full_width_sweep_on_the_default_cpu_backend_is_refused(capsys):
    assert cli.main(["bench", "--mode", "sweep", "--batch-sizes", "1"]) != 0
    assert "--backend nvidia_sm100" in capsys.readouterr().err


def test_fp8_configs_are_compared_with_their_bf16_config():
    from benchmarks.gpu_sweep.report import fp8_goals

    def config(steps, tok_s):
        return {"decode": [{"batch": b, "summary": {"step_ms": ms}} for b, ms in steps.items()],
                "prefill": [{"chunk": c, "summary": {"tok_s": t}} for c, t in tok_s.items()]}

    report = {"configs": {"graphs": config({1: 4.0, 64: 10.0, 128: 20.0}, {512: 100.0, 2048: 200.0}),
                          "graphs+fp8": config({1: 4.4, 64: 6.0, 128: 9.0}, {512: 90.0, 2048: 300.0}),
                          "eager+fp8": config({1: 1.0}, {})}}
    assert fp8_goals(report) == [
        "- graphs+fp8: decode step at batch 64 0.60x the bf16 step (goal <= 0.65x at batch 64: met)",
        "- graphs+fp8: prefill chunk 2048 1.50x the bf16 tokens/s (goal >= 1.3x: met)",
    ]


def test_the_sweep_modes_name_the_checkout_they_need(tmp_path, capsys):
    """The sweep is a script of the repository, loaded from the checkout ``--checkout`` names (default: the
    current directory); a folder without one is a usage error saying so."""
    assert cli.main(["bench", "--mode", "sweep", "--small", "--checkout", str(tmp_path)]) == 2
    assert "--checkout DIR" in capsys.readouterr().err


def test_the_core_imports_nothing_from_benchmarks():
    """The installed package stands alone: no module of it imports the repository's benchmarks/ folder."""
    offenders = []
    for path in sorted((CHECKOUT / "deepinfer_core").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            offenders += [f"{path.relative_to(CHECKOUT)}: {n}" for n in names if n.split(".")[0] == "benchmarks"]
    assert not offenders, offenders

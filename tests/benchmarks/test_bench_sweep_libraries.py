"""``deepinfer bench --mode sweep --libraries ...``: the sweep once per kernel-library set, each in a process
where the libraries outside the set cannot be imported, merged into one table with ratios against ``none``.

Dummy packages made here stand for the libraries: a hidden one raises ImportError in the child (and in the
nvidia backend's own importability check there, and in the child's children); one that is not hidden
imports."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from deepinfer_core.entrypoints import cli
from deepinfer_core.entrypoints.cli_bench import load_sweep_cli

CHECKOUT = Path(__file__).resolve().parents[2]
load_sweep_cli(CHECKOUT)  # puts the checkout's benchmarks package on the path
from benchmarks.gpu_sweep import libraries as libs  # noqa: E402

BATCHES = (1, 2)
CHUNK = 16

PROBE = textwrap.dedent(r"""
    import importlib, importlib.util, json, subprocess, sys
    out = {}
    for name in sys.argv[1:]:
        try:
            mod = importlib.import_module(name)
            out[name] = "imported " + str(mod.VALUE)
        except ImportError as exc:
            out[name] = type(exc).__name__ + ": " + str(exc)
    try:
        importlib.util.find_spec("dummylib.sub")
        out["find_spec dummylib.sub"] = "found"
    except ImportError as exc:
        out["find_spec dummylib.sub"] = type(exc).__name__
    from deepinfer_nvidia_sm100 import capability
    out["module_importable"] = {n: capability.module_importable(n) for n in sys.argv[1:]}
    grandchild = "\n".join(["try:", "    import dummylib", "    print('imported')",
                             "except ImportError as exc:", "    print(type(exc).__name__)"])
    out["grandchild finds dummylib"] = subprocess.run([sys.executable, "-c", grandchild], capture_output=True,
                                                      text=True, check=True).stdout.strip()
    print(json.dumps(out))
""")


def _package(site: Path, name: str, value: int, version: str | None = None) -> None:
    pkg = site / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"VALUE = {value}\n" + (f"__version__ = {version!r}\n" if version else ""))
    (pkg / "sub.py").write_text("X = 1\n")


@pytest.fixture
def site(tmp_path):
    site = tmp_path / "site"
    _package(site, "dummylib", 1)
    _package(site, "otherlib", 2)
    return site


def _probe(tmp_path: Path, site: Path, hidden: tuple[str, ...]) -> dict:
    hook = libs.write_hook(tmp_path / "hook")
    base = dict(os.environ, PYTHONPATH=str(site))
    env = libs.hiding_env(hook, hidden, base)
    assert env["PYTHONPATH"].split(os.pathsep) == [str(hook), str(site)]
    proc = subprocess.run([sys.executable, "-c", PROBE, "dummylib", "otherlib"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_a_hidden_module_raises_import_error_in_the_subprocess_and_its_children(tmp_path, site):
    out = _probe(tmp_path, site, ("dummylib",))
    assert out["dummylib"].startswith("ModuleNotFoundError: ") and libs.HIDE_ENV in out["dummylib"]
    assert out["find_spec dummylib.sub"] == "ModuleNotFoundError"
    assert out["otherlib"] == "imported 2"
    # the nvidia backend's own check declines it as it would a missing library
    assert out["module_importable"] == {"dummylib": False, "otherlib": True}
    assert out["grandchild finds dummylib"] == "ModuleNotFoundError"


def test_nothing_hidden_imports_every_module_present(tmp_path, site):
    out = _probe(tmp_path, site, ())
    assert out["dummylib"] == "imported 1" and out["otherlib"] == "imported 2"
    assert out["find_spec dummylib.sub"] == "found"
    assert out["module_importable"] == {"dummylib": True, "otherlib": True}
    assert out["grandchild finds dummylib"] == "imported"


def test_a_sitecustomize_further_down_the_path_still_runs(tmp_path, site):
    (site / "sitecustomize.py").write_text("import os\nos.environ['SITE_RAN'] = 'yes'\n")
    hook = libs.write_hook(tmp_path / "hook")
    env = libs.hiding_env(hook, ("dummylib",), dict(os.environ, PYTHONPATH=str(site)))
    script = "import os, sitecustomize; print(os.environ.get('SITE_RAN'), sitecustomize.__file__)"
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    ran, path = proc.stdout.split()
    assert ran == "yes" and Path(path).parent == Path(hook)


def test_library_sets_parse_and_hide_the_rest():
    sets = libs.parse_library_sets("none,flash_mla,flash_mla+deep_gemm")
    assert [s.name for s in sets] == ["none", "flash_mla", "flash_mla+deep_gemm"]
    assert [s.hidden for s in sets] == [("flash_mla", "deep_gemm", "deep_ep"), ("deep_gemm", "deep_ep"),
                                        ("deep_ep",)]
    for bad in ("flash_mla+flash_mla", "cutlass", "none,flash_mla,flash_mla", "deep_gemm+flash_mla,flash_mla+deep_gemm",
                "none+flash_mla", ",", ""):
        with pytest.raises(ValueError):
            libs.parse_library_sets(bad)


def test_a_child_whose_libraries_are_not_hidden_refuses_to_run(monkeypatch, site, capsys):
    from benchmarks.gpu_sweep import cli as sweep_cli

    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv(libs.HIDE_ENV, "dummylib")  # asked for, but no finder is in force in this process
    code = sweep_cli.main(["--library-set", "none", "--small", "--backend", "cpu_ref", "--device", "cpu"])
    assert code == 2
    assert "dummylib should be hidden but can be imported" in capsys.readouterr().err


def _report(step_ms: dict[int, float], tok_s: float) -> dict:
    return {"environment": {"device": "cpu"}, "model": {}, "options": {}, "libraries": {"flash_mla": "x"},
            "ops": {"default": {"sparse_attention": "triton", "rms_norm": "triton"}},
            "configs": {"graphs": {
                "decode": [{"batch": b, "summary": {"step_ms": ms, "tok_s": b / ms}} for b, ms in step_ms.items()],
                "prefill": [{"chunk": CHUNK, "summary": {"tok_s": tok_s, "chunk_ms": 1.0}}]}}}


def test_merge_has_one_row_per_set_and_batch_with_ratios_against_none():
    runs = {n: {"hidden": [], "dir": n, "returncode": 0} for n in ("none", "flash_mla", "flash_mla+deep_gemm")}
    reports = {"none": _report({1: 2.0, 64: 10.0}, 100.0), "flash_mla": _report({1: 1.0, 64: 12.0}, 150.0),
               "flash_mla+deep_gemm": _report({1: 4.0}, 50.0)}
    reports["flash_mla"]["ops"]["default"]["sparse_attention"] = "flash_mla"
    reports["flash_mla+deep_gemm"]["configs"]["graphs"]["decode"].append({"batch": 64, "error": "boom\nout of memory"})
    merged = libs.merge(runs, reports)
    assert merged["baseline"] == "none"
    rows = {(r["set"], r["batch"]): r for r in merged["decode"]}
    assert sorted(rows) == sorted((s, b) for s in runs for b in (1, 64))
    assert rows["none", 1]["step_vs_baseline"] == 1.0 and rows["none", 64]["step_vs_baseline"] == 1.0
    assert rows["flash_mla", 1]["step_vs_baseline"] == pytest.approx(0.5)
    assert rows["flash_mla", 64]["step_vs_baseline"] == pytest.approx(1.2)
    assert rows["flash_mla+deep_gemm", 1]["step_vs_baseline"] == pytest.approx(2.0)
    assert rows["flash_mla+deep_gemm", 64]["step_ms"] is None and rows["flash_mla+deep_gemm", 64]["error"]
    pre = {r["set"]: r["tok_s_vs_baseline"] for r in merged["prefill"]}
    assert pre == pytest.approx({"none": 1.0, "flash_mla": 1.5, "flash_mla+deep_gemm": 0.5})
    assert libs.served_ops(merged) == {"sparse_attention": {"none": "triton", "flash_mla": "flash_mla",
                                                            "flash_mla+deep_gemm": "triton"}}
    md = libs.markdown(merged)
    assert "| flash_mla | graphs | 1 | 1.000 | 0.500 |" in md
    assert "| flash_mla | graphs | 64 | 12.000 | 1.200 |" in md
    assert "| flash_mla+deep_gemm | graphs | 64 | - | - |" in md
    assert "| flash_mla+deep_gemm | graphs | 16 | 50 | 0.500 |" in md
    assert "| sparse_attention | triton | flash_mla | triton |" in md
    assert "flash_mla+deep_gemm graphs decode batch 64: out of memory" in md


def test_without_none_the_first_set_is_the_baseline():
    runs = {n: {"hidden": [], "dir": n, "returncode": 0} for n in ("flash_mla", "deep_gemm")}
    merged = libs.merge(runs, {"flash_mla": _report({1: 2.0}, 10.0), "deep_gemm": _report({1: 3.0}, 10.0)})
    assert merged["baseline"] == "flash_mla"
    assert [r["step_vs_baseline"] for r in merged["decode"]] == pytest.approx([1.0, 1.5])
    assert "step / flash_mla" in libs.markdown(merged)


@pytest.mark.slow  # one process per library set
def test_bench_sweep_runs_every_set_in_its_own_process_and_merges(tmp_path, monkeypatch):
    """End to end on the CPU: a dummy ``flash_mla`` on the path is hidden in the ``none`` set's process and
    imported in the ``flash_mla`` set's."""
    site = tmp_path / "site"
    _package(site, "flash_mla", 0, version="0.0+dummy")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    out = tmp_path / "out"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = cli.main([
            "bench", "--mode", "sweep", "--small", "--backend", "cpu_ref", "--device", "cpu", "--threads", "1",
            "--libraries", "none,flash_mla", "--configs", "eager", "--batch-sizes", ",".join(map(str, BATCHES)),
            "--prompt-len", "8", "--gen-len", "3", "--warmup-steps", "1", "--chunk-sizes", str(CHUNK), "--no-hf",
            "--out", str(out), "--checkout", str(CHECKOUT),
        ])
    assert code == 0
    merged = json.loads((out / libs.MERGED_JSON).read_text())
    assert merged["baseline"] == "none" and list(merged["sets"]) == ["none", "flash_mla"]
    none, flash = merged["sets"]["none"], merged["sets"]["flash_mla"]
    assert none["hidden"] == ["flash_mla", "deep_gemm", "deep_ep"] and flash["hidden"] == ["deep_gemm", "deep_ep"]
    assert none["found"]["flash_mla"] == "hidden (installed)"
    assert flash["found"]["flash_mla"] == "0.0+dummy"
    assert flash["found"]["deep_gemm"].startswith("hidden")
    for s in (none, flash):
        assert not Path(s["dir"]).is_absolute()
        child = json.loads((out / s["dir"] / "sweep.json").read_text())
        assert child["library_set"]["hidden"] == s["hidden"]
        assert s["ops"]["default"]["sparse_attention"] == "cpu_ref: native.sparse_attention"
    rows = merged["decode"]
    assert sorted((r["set"], r["batch"]) for r in rows) == sorted((s, b) for s in ("none", "flash_mla")
                                                                   for b in BATCHES)
    base = {r["batch"]: r["step_ms"] for r in rows if r["set"] == "none"}
    for r in rows:
        assert r["step_ms"] > 0 and r["step_vs_baseline"] == pytest.approx(r["step_ms"] / base[r["batch"]])
    assert [r["set"] for r in merged["prefill"]] == ["none", "flash_mla"]
    assert merged["prefill"][0]["tok_s_vs_baseline"] == 1.0 and merged["prefill"][1]["tok_s_vs_baseline"] > 0
    md = (out / libs.MERGED_MD).read_text()
    assert md.strip() in stdout.getvalue()
    assert sum(line.startswith(("| none | eager |", "| flash_mla | eager |")) for line in md.splitlines()) == (
        2 * len(BATCHES) + 2)

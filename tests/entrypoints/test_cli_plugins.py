"""``deepinfer backends`` and ``deepinfer ops``, and the lazy subcommand table of the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from deepinfer_core import plugins
from deepinfer_core.entrypoints import cli
from deepinfer_core.ops.catalogue import CATALOGUE

try:
    from plugin_helpers import FakeDists, backend_source
except ImportError:  # tests/ imported as a package
    from tests.plugin_helpers import FakeDists, backend_source

PACK = "example_fused_rms_norm"


@pytest.fixture(autouse=True)
def fresh_plugins(monkeypatch):
    monkeypatch.delenv(plugins.ALLOWLIST_ENV, raising=False)
    plugins._LOADED.clear()
    yield
    plugins._LOADED.clear()


@pytest.fixture
def dists(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    fake = FakeDists(site)
    fake.ensure_repo_dists(monkeypatch)
    yield fake
    fake.cleanup()


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def backend_lines(out: str) -> dict[str, list[str]]:
    """The ``deepinfer backends`` table: backend name -> [its row, its detail lines...]."""
    blocks: dict[str, list[str]] = {}
    current = None
    for line in out.splitlines():
        if line.startswith("    ") and current:
            blocks[current].append(line.strip())
        elif line and not line.startswith(("BACKEND", "KERNEL PACK", "(")) and current != "__packs__":
            current = line.split()[0]
            blocks[current] = [line]
        if line.startswith("KERNEL PACK"):
            current = "__packs__"
    return blocks


def ops_rows(out: str) -> dict[str, str]:
    rows = {}
    for line in out.splitlines():
        name = line.split(" ", 1)[0]
        if name in CATALOGUE:
            rows[name] = line
    return rows


# --- deepinfer backends ----------------------------------------------------------------------------


def test_backends_table(dists, capsys):
    code, out, _ = run_cli(capsys, "backends")
    assert code == 0
    blocks = backend_lines(out)
    cpu = blocks["cpu_ref"][0].split()
    assert cpu[:5] == ["cpu_ref", "deepinfer-cpu-ref", "0.1.0", "cpu", "yes"]
    assert any(line.startswith("torch: ") for line in blocks["cpu_ref"][1:])

    nvidia = blocks["nvidia_sm100"]
    assert nvidia[0].split()[:4] == ["nvidia_sm100", "deepinfer-nvidia-sm100", "0.1.0", "cuda"]
    if not torch.cuda.is_available():
        assert nvidia[0].split()[4] == "no"
    if torch.version.cuda is None:
        assert nvidia[0].endswith(f"torch {torch.__version__} is built without CUDA (CPU-only build)")
    detail_keys = {line.split(":", 1)[0] for line in nvidia[1:]}
    assert {"flash_mla", "deep_gemm", "deep_ep", "triton", "torch"} <= detail_keys

    ascend = blocks["ascend_950"]
    assert ascend[0].split()[:5] == ["ascend_950", "deepinfer-ascend-950", "0.1.0", "npu", "no"]
    assert len(ascend[0].split()) > 5  # a reason follows
    assert {"cann", "torch_npu", "tilelang", "triton"} <= {line.split(":", 1)[0] for line in ascend[1:]}

    assert f"{PACK}" in out and "deepinfer-example-kernels" in out


def test_backends_json(dists, capsys):
    code, out, _ = run_cli(capsys, "backends", "--json")
    assert code == 0
    data = json.loads(out)
    rows = {b["name"]: b for b in data["backends"]}
    assert rows["cpu_ref"]["available"] is True and rows["cpu_ref"]["reason"] == ""
    assert rows["cpu_ref"]["distribution"] == "deepinfer-cpu-ref"
    for name in ("nvidia_sm100", "ascend_950"):
        if name == "nvidia_sm100" and torch.cuda.is_available():
            continue
        assert rows[name]["available"] is False
        assert rows[name]["reason"]
    assert set(rows["nvidia_sm100"]["details"]) >= {"flash_mla", "deep_gemm", "deep_ep", "triton"}
    packs = {p["name"]: p for p in data["kernel_packs"]}
    assert packs[PACK]["distribution"] == "deepinfer-example-kernels"
    assert packs[PACK]["loaded"] is True
    assert data["allowlist"] is None


def test_backends_json_reports_allowlist(dists, capsys, monkeypatch):
    monkeypatch.setenv(plugins.ALLOWLIST_ENV, "")
    data = json.loads(run_cli(capsys, "backends", "--json")[1])
    assert data["allowlist"] == ""
    assert {p["name"]: p["loaded"] for p in data["kernel_packs"]}[PACK] is False


def test_backends_lists_broken_backend_with_reason(dists, capsys):
    dists.add(
        "deepinfer-broken",
        {plugins.BACKEND_GROUP: {"broken_be": "broken_be_mod"}},
        {"broken_be_mod": "raise ImportError('libnccl.so.2 not found')\n"},
    )
    code, out, _ = run_cli(capsys, "backends")
    assert code == 0
    blocks = backend_lines(out)
    assert blocks["broken_be"][0].split()[:5] == ["broken_be", "deepinfer-broken", "1.0", "?", "no"]
    assert "libnccl.so.2 not found" in blocks["broken_be"][0]
    assert blocks["cpu_ref"][0].split()[4] == "yes"


# --- deepinfer ops ---------------------------------------------------------------------------------


def test_ops_shows_example_pack_as_rms_norm_provider(dists, capsys):
    code, out, _ = run_cli(capsys, "ops", "--backend", "cpu_ref")
    assert code == 0
    rows = ops_rows(out)
    assert set(rows) == set(CATALOGUE)
    rms = rows["rms_norm"].split()
    assert rms[:6] == ["rms_norm", PACK, "[kernel", "pack]", "deepinfer-example-kernels", "0.1.0"]
    assert rms[6] == "10"
    assert "cpu_ref [backend] (deepinfer-cpu-ref) priority 0: shadowed" in rows["rms_norm"]
    assert rows["embedding"].split()[:6] == [
        "embedding",
        "cpu_ref",
        "[backend]",
        "deepinfer-cpu-ref",
        "0.1.0",
        "0",
    ]
    assert "MISSING" not in out
    assert f"kernel packs loaded: {PACK}" in out


def test_ops_json(dists, capsys):
    code, out, _ = run_cli(capsys, "ops", "--backend", "cpu_ref", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["available"] is True and data["missing"] == []
    by_op = {row["op"]: row for row in data["ops"]}
    assert list(by_op) == list(CATALOGUE)
    rms = by_op["rms_norm"]
    assert rms["chosen"]["provider"] == f"{plugins.KERNEL_GROUP}:{PACK}"
    assert rms["chosen"]["distribution"] == "deepinfer-example-kernels"
    assert rms["chosen"]["priority"] == 10
    assert rms["chosen"]["function"] == "deepinfer_example_kernels.ops.fused_rms_norm"
    assert [(a["provider"], a["priority"], a["status"]) for a in rms["alternatives"]] == [
        (f"{plugins.BACKEND_GROUP}:cpu_ref", 0, "shadowed")
    ]
    # linear's only alternative: cpu_ref's batch-invariant variant, chosen in batch-invariant mode only
    assert [(a["provider"], a["priority"], a["status"]) for a in by_op["linear"]["alternatives"]] == [
        (f"{plugins.BACKEND_GROUP}:cpu_ref", 1, "declined by its predicate")
    ]


def test_ops_dtype_the_pack_declines(dists, capsys):
    data = json.loads(run_cli(capsys, "ops", "--backend", "cpu_ref", "--dtype", "float16", "--json")[1])
    rms = next(row for row in data["ops"] if row["op"] == "rms_norm")
    assert rms["chosen"]["provider"] == f"{plugins.BACKEND_GROUP}:cpu_ref"
    assert [(a["name"], a["status"]) for a in rms["alternatives"]] == [(PACK, "declined by its predicate")]


def test_ops_with_empty_allowlist(dists, capsys, monkeypatch):
    monkeypatch.setenv(plugins.ALLOWLIST_ENV, "")
    code, out, _ = run_cli(capsys, "ops", "--backend", "cpu_ref")
    assert code == 0
    assert ops_rows(out)["rms_norm"].split()[:3] == ["rms_norm", "cpu_ref", "[backend]"]
    assert "kernel packs loaded: none (DEEPINFER_PLUGINS='')" in out
    assert "shadowed" not in out


def test_ops_unknown_backend(dists, capsys):
    code, out, err = run_cli(capsys, "ops", "--backend", "nonexistent")
    assert code == 1
    assert out == ""
    assert err.startswith("deepinfer ops: error: unknown backend 'nonexistent'; installed backends: ")
    for name in ("ascend_950", "cpu_ref", "nvidia_sm100"):
        assert name in err


def test_ops_broken_pack_names_its_distribution(dists, capsys, monkeypatch):
    dists.add(
        "deepinfer-bad-pack",
        {plugins.KERNEL_GROUP: {"bad_pack": "bad_pack_mod"}},
        {"bad_pack_mod": "raise SyntaxError('oops')\n"},
    )
    monkeypatch.setenv(plugins.ALLOWLIST_ENV, "bad_pack")
    code, _, err = run_cli(capsys, "ops", "--backend", "cpu_ref")
    assert code == 1
    assert "'bad_pack'" in err and "deepinfer-bad-pack 1.0" in err and "oops" in err


def test_ops_for_backend_without_kernels(dists, capsys, monkeypatch):
    dists.add(
        "deepinfer-half",
        {plugins.BACKEND_GROUP: {"half": "half_mod"}},
        {"half_mod": backend_source("half", ops=["embedding"], available=False, reason="no half-GPU")},
    )
    monkeypatch.setenv(plugins.ALLOWLIST_ENV, "")
    code, out, _ = run_cli(capsys, "ops", "--backend", "half")
    assert code == 0
    assert "NOT available here: no half-GPU" in out.splitlines()[0]
    rows = ops_rows(out)
    assert rows["embedding"].split()[:2] == ["embedding", "half"]
    assert rows["rms_norm"].split() == ["rms_norm", "MISSING"]
    assert f"{len(CATALOGUE) - 1} op(s) missing" in out and "MissingOpError" in out


# --- the subcommand table --------------------------------------------------------------------------


def test_every_subcommand_resolves():
    assert {"backends", "ops"} <= set(cli.SUBCOMMANDS)
    for command in cli.SUBCOMMANDS.values():
        assert callable(cli._resolve(command.run))
        if command.add_arguments:
            assert callable(cli._resolve(command.add_arguments))


def test_no_subcommand_prints_help(capsys):
    code, out, _ = run_cli(capsys)
    assert code == 2
    assert "backends" in out and "ops" in out


def test_ops_requires_backend(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["ops"])
    assert exc.value.code == 2
    assert "--backend" in capsys.readouterr().err


def _python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_help_imports_no_subcommand_module():
    result = _python(
        "import sys\n"
        "from deepinfer_core.entrypoints import cli\n"
        "try:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('LOADED' if 'deepinfer_core.entrypoints.cli_plugins' in sys.modules else 'LAZY')\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip().endswith("LAZY")
    assert "backends" in result.stdout and "ops" in result.stdout


def test_module_entry_point(dists):
    result = subprocess.run(
        [sys.executable, "-m", "deepinfer_core.entrypoints.cli", "backends", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert result.returncode == 0, result.stderr
    names = {b["name"] for b in json.loads(result.stdout)["backends"]}
    assert {"cpu_ref", "nvidia_sm100", "ascend_950"} <= names

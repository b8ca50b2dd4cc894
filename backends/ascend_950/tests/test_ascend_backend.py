"""The ascend_950 backend's wiring, on a machine without CANN, torch_npu or an NPU.

A fake ``torch_npu`` (and ``torch.npu``) stands in for the real one where that proves the wiring: which
implementation the core's resolution picks on an NPU context, that the torch_npu adapters call the fused
operators with the layout their documentation states (the fakes implement that documentation), the device
hook, the NPU platform's graph capture and memory calls, the HCCL communicator and the topology parser.
None of it proves the behaviour of the real torch_npu, CANN or an Ascend 950.
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from deepinfer_ascend_950 import npu, npu_ops, plugin, registration, tilelang_ops

from deepinfer_core import plugins
from deepinfer_core.entrypoints import cli
from deepinfer_core.ops import native
from deepinfer_core.ops.catalogue import CATALOGUE
from deepinfer_core.ops.registry import CHOSEN, BuildContext, resolve_ops

try:
    from plugin_helpers import REPO, FakeDists
except ImportError:  # tests/ imported as a package
    from tests.plugin_helpers import REPO, FakeDists

NPU_DEVICE = SimpleNamespace(type="npu", index=0)
SELF_CHECK = registration.self_check
NOT_INSTALLED = "torch_npu not installed (install the torch-npu matching your torch and CANN; see README)"


@pytest.fixture(autouse=True)
def clean(monkeypatch, tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    fake = FakeDists(site)
    fake.ensure_repo_dists(monkeypatch)
    monkeypatch.delenv(plugins.ALLOWLIST_ENV, raising=False)
    for var in (*npu.CANN_ENV_VARS, "BISHENG_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(npu, "CANN_DEFAULT", str(tmp_path / "no-cann"))
    plugins._LOADED.clear()
    npu._probe.cache_clear()
    SELF_CHECK.cache_clear()
    yield
    fake.cleanup()
    plugins._LOADED.clear()
    npu._probe.cache_clear()
    SELF_CHECK.cache_clear()


# --- fakes ------------------------------------------------------------------------------------------


def fake_rms_norm(x, gamma, epsilon=1e-6):
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + epsilon)
    return (xf * rstd * gamma.float()).to(x.dtype), rstd


def fake_rotary_mul(x, r1, r2, rotary_mode="half"):
    assert x.dim() == 4 and r1.dim() == 4 and r2.dim() == 4, "npu_rotary_mul takes 4-D tensors"
    assert rotary_mode == "interleave"
    rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)  # the documented rearrange
    return x * r1 + rotated * r2


def fake_swiglu(x, dim=-1):
    a, b = x.chunk(2, dim=dim)
    return F.silu(a) * b


class FakeNpu:
    """``torch.npu`` as torch_npu installs it, recording the calls the backend makes."""

    def __init__(self, count=1, name="Ascend950PR", total=64 << 30):
        self.count, self.name, self.total, self.calls, self.current = count, name, total, [], None
        self.allocated, self.peak = 1000, 5000
        fake = self

        class Event:
            def record(self):
                fake.calls.append("event.record")

            def synchronize(self):
                fake.calls.append("event.synchronize")

        class Stream:
            def __init__(self, device=None):
                self.device = device

            def wait_stream(self, other):
                fake.calls.append("wait_stream")

        class NPUGraph:
            def __init__(self):
                self.replays, self.captured_into = 0, None

            def pool(self):  # a graph captured into a pool shares it
                return self.captured_into or ("pool", id(self))

            def replay(self):
                self.replays += 1

        self.Event, self.Stream, self.NPUGraph = Event, Stream, NPUGraph

    def is_available(self):
        return self.count > 0

    def device_count(self):
        return self.count

    def current_device(self):
        return 0

    def get_device_name(self, device=None):
        return self.name

    def get_device_properties(self, device):
        return SimpleNamespace(total_memory=self.total, name=self.name)

    def set_device(self, index):
        self.calls.append(("set_device", index))

    def synchronize(self, device=None):
        self.calls.append("synchronize")

    def current_stream(self):
        return self.Stream()

    def stream(self, s):
        fake = self

        class Ctx:
            def __enter__(self):
                fake.calls.append("side_stream")

            def __exit__(self, *exc):
                fake.calls.append("main_stream")

        return Ctx()

    def graph(self, graph, pool=None):
        fake = self

        class Ctx:
            def __enter__(self):
                graph.captured_into = pool
                fake.calls.append(("capture", pool))

            def __exit__(self, *exc):
                fake.calls.append("captured")

        return Ctx()

    def memory_allocated(self, device=None):
        return self.allocated

    def max_memory_allocated(self, device=None):
        return self.peak

    def reset_peak_memory_stats(self, device=None):
        self.calls.append("reset_peak")

    def empty_cache(self):
        self.calls.append("empty_cache")


def install_fake_torch_npu(monkeypatch, tmp_path, ops=("npu_rms_norm", "npu_rotary_mul", "npu_swiglu"),
                           count=1, cann=True, bisheng=True) -> FakeNpu:
    module = types.ModuleType("torch_npu")
    module.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    module.__version__ = "2.9.0.post1"
    impls = {"npu_rms_norm": fake_rms_norm, "npu_rotary_mul": fake_rotary_mul, "npu_swiglu": fake_swiglu}
    for name in ops:
        setattr(module, name, impls[name])
    fake = FakeNpu(count)
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    monkeypatch.setattr(torch, "npu", fake, raising=False)
    if cann:
        home = tmp_path / "cann"
        (home / "compiler").mkdir(parents=True, exist_ok=True)
        (home / "compiler" / "version.info").write_text("Version=8.5.RC1\n")
        monkeypatch.setenv("ASCEND_HOME_PATH", str(home))
    if bisheng:
        bin_dir = tmp_path / "bisheng" / "bin"
        bin_dir.mkdir(parents=True, exist_ok=True)
        (bin_dir / "bisheng").write_text("#!/bin/sh\n")
        monkeypatch.setenv("BISHENG_HOME", str(bin_dir.parent))
    npu._probe.cache_clear()
    return fake


def registry():
    return plugins.collect_registry(plugins.load_backend("ascend_950", require_available=False))


def chosen(reg, ctx) -> dict:
    return {op: next(impl.fn for impl, verdict in reg.explain(op, ctx) if verdict == CHOSEN) for op in CATALOGUE}


# --- listing --------------------------------------------------------------------------------------


def test_backends_lists_ascend_with_the_exact_reason(capsys, monkeypatch):
    real = npu.importlib.util.find_spec
    monkeypatch.setattr(npu.importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch_npu" else real(name, *a))
    assert cli.main(["backends", "--json"]) == 0
    rows = {b["name"]: b for b in json.loads(capsys.readouterr().out)["backends"]}
    row = rows["ascend_950"]
    assert (row["available"], row["reason"], row["device"]) == (False, NOT_INSTALLED, "npu")
    details = row["details"]
    assert details["torch_npu"] == f"missing: {NOT_INSTALLED}"
    assert details["cann"] == "missing: toolkit not found"
    assert details["bisheng"].startswith("missing: ")
    assert "deepinfer_ascend_950.dry_run" in details["ops"]
    if importlib.util.find_spec("tilelang") is not None:
        assert details["tilelang"] == "0.1.15"


def test_backends_reason_without_an_npu_device(capsys, monkeypatch, tmp_path):
    install_fake_torch_npu(monkeypatch, tmp_path, count=0)
    assert cli.main(["backends", "--json"]) == 0
    row = {b["name"]: b for b in json.loads(capsys.readouterr().out)["backends"]}["ascend_950"]
    assert row["available"] is False and row["reason"].startswith("no NPU device (torch.npu.is_available() is False")
    assert row["details"]["cann"].startswith("8.5.RC1 at ")


@pytest.mark.parametrize("nodes,want", [([], "missing: no Ascend NPU (no /dev/davinci* device node)"),
                                         (["/dev/davinci0"], "1 Ascend device node(s) (/dev/davinci0); the chip is "
                                                             "unknown without torch_npu")])
def test_details_say_whether_an_npu_is_there_without_torch_npu(monkeypatch, nodes, want):
    real = npu.importlib.util.find_spec
    monkeypatch.setattr(npu.importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch_npu" else real(name, *a))
    monkeypatch.setattr(plugin.glob, "glob", lambda pattern: list(nodes) if pattern == plugin.DEVICE_NODES else [])
    assert plugin.details()["npu_device"] == want


def test_details_name_the_missing_npu_device_with_torch_npu(monkeypatch, tmp_path):
    install_fake_torch_npu(monkeypatch, tmp_path, count=0)
    assert plugin.details()["npu_device"] == "missing: torch.npu.is_available() is False"


def test_ops_dry_run_asks_the_backend_for_both_plans(capsys):
    assert cli.main(["ops", "--backend", "ascend_950", "--dry-run", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    plans = data["plans"]
    assert data["available"] is False and set(plans) == {"here", "npu"}
    assert set(plans["here"]) == set(CATALOGUE) and set(plans["here"].values()) == {"native"}
    assert plans["npu"]["moe_experts_fp4"] == "tilelang (if its self-check passes, else native)"
    assert plans["npu"]["moe_route"] == "tilelang (if its self-check passes, else torch_npu.npu_moe_gating_top_k)"
    assert plans["npu"]["rms_norm"] == "torch_npu.npu_rms_norm" and plans["npu"]["linear"] == "native"
    for op in ("kv_fp8_pack", "sparse_attention_fp8"):  # the FP8 KV entry's kernels
        assert plans["npu"][op] == "tilelang (if its self-check passes, else native)"
    assert plans["npu"]["linear_fp8_ue8m0"] == "native"
    v41 = ("indexer_scores", "candidate_blocks", "hc_mixes", "hc_collapse", "fp4_kv_sim", "moe_experts_quant_act",
           "embedding_fp8", "engram_gate", "kv_fp4_pack", "kv_fp4_unpack", "moe_experts_fp4_quant_act")
    assert all(plans["here"][op] == plans["npu"][op] == "native" for op in v41)  # DeepSeek-V4.1's, no kernel yet
    assert cli.main(["ops", "--backend", "ascend_950", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    row = next(line.split() for line in lines if line.startswith("sparse_attention_fp8 "))
    assert row[1] == "native" and row[2] == "tilelang"
    assert lines[0].startswith("backend ascend_950: NOT available here: ") and "OP" in lines[3]
    assert sum(line.split()[0] in CATALOGUE for line in lines[4:] if line.strip()) == len(CATALOGUE)


def test_ops_dry_run_of_a_backend_without_one_is_an_error(capsys):
    assert cli.main(["ops", "--backend", "cpu_ref", "--dry-run"]) == 1
    assert "has no dry run (dry_run_plans)" in capsys.readouterr().err


# --- resolution -----------------------------------------------------------------------------------


def test_every_catalogued_op_is_registered_with_native_at_the_bottom():
    reg = registry()
    for op in CATALOGUE:
        impls = reg.candidates(op)
        assert impls[-1].fn is native.NATIVE_OPS[op] and impls[-1].priority == registration.NATIVE
        assert impls[-1].syncs_host == (op in native.SYNCS_HOST)
    table = resolve_ops(reg, BuildContext(backend="ascend_950", device=torch.device("cpu")))
    assert set(table.chosen) == set(CATALOGUE)  # complete without the cpu_ref fallback


def test_on_a_cpu_device_everything_is_native():
    got = chosen(registry(), BuildContext(backend="ascend_950", device=torch.device("cpu"), dtype=torch.bfloat16))
    assert got == native.NATIVE_OPS


def test_fake_npu_context_picks_torch_npu_and_tilelang(monkeypatch, tmp_path):
    install_fake_torch_npu(monkeypatch, tmp_path)
    ctx = BuildContext(backend="ascend_950", device=NPU_DEVICE, dtype=torch.bfloat16, probe_only=True)
    want = dict(native.NATIVE_OPS, rms_norm=npu_ops.rms_norm, rotary_emb=npu_ops.rotary_emb, swiglu=npu_ops.swiglu,
                sparse_attention=tilelang_ops.sparse_attention, hc_pre=tilelang_ops.hc_pre)
    want.update(registration.tilelang_kernel_ops())  # every TileLang kernel serves bf16 on an NPU
    assert chosen(registry(), ctx) == want
    labels = registration.op_labels(registry(), ctx)
    assert labels["rms_norm"] == "torch_npu.npu_rms_norm" and labels["linear"] == "native"
    assert labels["sparse_attention"] == "tilelang (if its self-check passes, else native)"


def test_fake_npu_context_declines_what_is_missing(monkeypatch, tmp_path):
    install_fake_torch_npu(monkeypatch, tmp_path, ops=("npu_rms_norm",), bisheng=False)
    ctx = BuildContext(backend="ascend_950", device=NPU_DEVICE, dtype=torch.bfloat16, probe_only=True)
    got = chosen(registry(), ctx)
    assert got["rms_norm"] is npu_ops.rms_norm
    assert got["swiglu"] is native.swiglu and got["rotary_emb"] is native.rotary_emb  # no such operator
    assert got["sparse_attention"] is native.sparse_attention and got["hc_pre"] is native.hc_pre  # no bisheng
    assert registration.tilelang_verdict("hc_pre", ctx) == (
        False, "CANN's bisheng compiler not found (BISHENG_HOME/bin, PATH)")


def test_fake_npu_context_kernel_dtypes_and_self_check(monkeypatch, tmp_path):
    install_fake_torch_npu(monkeypatch, tmp_path)
    f32 = BuildContext(backend="ascend_950", device=NPU_DEVICE, dtype=torch.float32, probe_only=True)
    got = chosen(registry(), f32)
    assert got["sparse_attention"] is native.sparse_attention and got["hc_pre"] is tilelang_ops.hc_pre
    # an engine build (not probe_only) runs the kernel's self-check; a failing one declines the kernel
    calls = []

    def failing(op, device, dtype):
        calls.append((op, device, dtype))
        return False, "self-check failed: mismatch"

    monkeypatch.setattr(registration, "self_check", failing)
    build = BuildContext(backend="ascend_950", device=NPU_DEVICE, dtype=torch.bfloat16)
    got = chosen(registry(), build)
    assert got["sparse_attention"] is native.sparse_attention and got["hc_pre"] is native.hc_pre
    assert {c[0] for c in calls} == {"sparse_attention", "hc_pre"} | set(registration.tilelang_kernel_ops())


def test_dry_run_shows_both_plans(capsys):
    from deepinfer_ascend_950 import dry_run

    plans = dry_run.plans(torch.bfloat16)
    assert set(plans["here"].values()) == {"native"}
    assert plans["npu"]["rotary_emb"] == "torch_npu.npu_rotary_mul"
    assert plans["npu"]["hc_pre"].startswith("tilelang")
    assert plans["npu"]["kv_fp8_pack"].startswith("tilelang") and plans["here"]["kv_fp8_pack"] == "native"
    assert dry_run.main(["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["available"] is False and data["npu"]["swiglu"] == "torch_npu.npu_swiglu"


# --- torch_npu adapters ---------------------------------------------------------------------------


def test_torch_npu_adapters_match_native_through_documented_fakes(monkeypatch, tmp_path):
    install_fake_torch_npu(monkeypatch, tmp_path)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 32, generator=g)
    w = torch.randn(32, generator=g)
    torch.testing.assert_close(npu_ops.rms_norm(x, w, 1e-6), native.rms_norm(x, w, 1e-6))
    torch.testing.assert_close(npu_ops.rms_norm(x, None, 1e-6), native.rms_norm(x, None, 1e-6))
    cos, sin = torch.randn(5, 8, generator=g), torch.randn(5, 8, generator=g)
    for inverse in (False, True):
        torch.testing.assert_close(npu_ops.rotary_emb(x, cos, sin, inverse), native.rotary_emb(x, cos, sin, inverse))
    gu = torch.randn(7, 64, generator=g) * 8
    torch.testing.assert_close(npu_ops.swiglu(gu, 10.0), native.swiglu(gu, 10.0))


def test_rotary_adapter_falls_back_outside_the_operator_limits(monkeypatch, tmp_path):
    install_fake_torch_npu(monkeypatch, tmp_path)
    monkeypatch.setattr(sys.modules["torch_npu"], "npu_rotary_mul", None)  # must not be called
    x, cos, sin = torch.randn(2, npu_ops.ROTARY_MAX_BN, 8), torch.randn(2, 2), torch.randn(2, 2)
    torch.testing.assert_close(npu_ops.rotary_emb(x, cos, sin), native.rotary_emb(x, cos, sin))


# --- device, platform, communicator, topology -----------------------------------------------------


def test_init_device_without_torch_npu_is_a_clear_error(monkeypatch):
    real = npu.importlib.util.find_spec
    monkeypatch.setattr(npu.importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch_npu" else real(name, *a))
    with pytest.raises(RuntimeError, match=r"cannot select an NPU for local rank 0: torch_npu not installed"):
        plugin.deepinfer_init_device(local_rank=0)


def test_worker_device_selection_fails_clearly_without_an_npu(monkeypatch, tmp_path):
    """What crashed with ``None.type`` before: a worker on ascend_950 without device=... now gets the
    backend's device hook and its error."""
    from deepinfer_core.worker.worker import Worker

    install_fake_torch_npu(monkeypatch, tmp_path, count=0)
    backend = plugins.load_backend("ascend_950", require_available=False)
    worker = Worker(SimpleNamespace(device=None), backend, None, Path("."), None, None, None)
    with pytest.raises(RuntimeError, match="no NPU device visible"):
        worker.init_device()


def test_init_device_picks_the_local_rank(monkeypatch, tmp_path):
    fake = install_fake_torch_npu(monkeypatch, tmp_path, count=2)
    monkeypatch.setattr(plugin, "npu_device", lambda index: ("npu", index))
    assert plugin.deepinfer_init_device(local_rank=1) == ("npu", 1)
    assert ("set_device", 1) in fake.calls
    with pytest.raises(RuntimeError, match="local rank 2 has no NPU: 2 visible"):
        plugin.deepinfer_init_device(local_rank=2)


def test_platform_hook_and_npu_platform(monkeypatch, tmp_path):
    from deepinfer_ascend_950.platform import NpuPlatform

    from deepinfer_core.config import CacheConfig

    fake = install_fake_torch_npu(monkeypatch, tmp_path)
    assert plugin.deepinfer_platform(device=torch.device("cpu")) is None
    platform = plugin.deepinfer_platform(device=NPU_DEVICE)
    assert isinstance(platform, NpuPlatform) and platform.supports_graphs and platform.measures_memory
    assert platform.default_dtype == torch.bfloat16
    budget = platform.memory_budget(CacheConfig(gpu_memory_utilization=0.5), reserved_bytes=24)
    assert budget == (64 << 30) // 2 - 1000 - 24
    assert platform.peak_memory_of(lambda: None) == 4000
    assert fake.calls[:2] == ["synchronize", "reset_peak"] and fake.calls[-1] == "empty_cache"

    fake.calls.clear()
    runs = []
    graphs = platform.capture_graphs([2, 8, 4], lambda size: runs.append(size) or torch.zeros(size))
    assert runs == [8, 8, 8, 4, 4, 4, 2, 2, 2]  # largest first; twice on the side stream, then captured
    captures = [c for c in fake.calls if isinstance(c, tuple) and c[0] == "capture"]
    assert captures[0] == ("capture", None) and captures[1][1] == captures[2][1] != None  # noqa: E711 one pool
    assert captures[1][1][0] == "pool"
    graphs[4].replay()
    assert graphs[4].graph.replays == 1 and graphs[4].output.shape == (4,)
    assert fake.calls.count("side_stream") == 3


def test_graph_runner_hook_needs_graph_support():
    runner = plugin.deepinfer_graph_runner
    assert runner(None, None, [1, 2], 64, 16, SimpleNamespace(supports_graphs=False), (1,), False, None) is None
    assert runner(None, None, [], 64, 16, SimpleNamespace(supports_graphs=True), (1,), False, None) is None


def test_communicator_is_hccl_on_npus(monkeypatch):
    import torch.distributed as dist
    from deepinfer_ascend_950.comm import HcclCommunicator

    from deepinfer_core.comm import TorchDistributedCommunicator

    one = plugin.deepinfer_make_communicator(group=None, device=NPU_DEVICE)
    assert isinstance(one, HcclCommunicator) and one.world_size == 1
    cpu = plugin.deepinfer_make_communicator(group=None, device=torch.device("cpu"))
    assert type(cpu) is TorchDistributedCommunicator
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    with pytest.raises(RuntimeError, match="uses 'gloo', but NPU tensors need 'hccl'"):
        plugin.deepinfer_make_communicator(group=None, device=NPU_DEVICE)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "hccl")
    assert plugin.deepinfer_make_communicator(group=None, device=NPU_DEVICE).world_size == 2


TOPO = """\
           NPU0       NPU1       NPU2       NPU3       CPU Affinity
NPU0       X          HCCS       HCCS       SYS        0-23
NPU1       HCCS       X          SIO        SYS        0-23
NPU2       HCCS       SIO        X          PIX        24-47
NPU3       SYS        SYS        PIX        X          24-47

Legend:
  X    = Self
  SYS  = Path traversing PCIe and NUMA nodes.
"""


def test_topology_parses_npu_smi_and_discovers_devices(monkeypatch, tmp_path):
    from deepinfer_ascend_950 import topology

    assert topology.parse_topo_matrix(TOPO) == {0: [1, 2], 1: [0, 2], 2: [0, 1], 3: []}
    assert topology.parse_topo_matrix("npu-smi: command failed") == {}
    fake = FakeNpu(count=2)
    monkeypatch.setattr(topology, "_npu_smi_topo", lambda: TOPO)
    topo = topology.discover(fake)
    assert [d.index for d in topo.devices] == [0, 1] and topo.devices[0].peers == [1]
    assert topo.devices[1].kind == "npu (Ascend950PR, 64 GiB)"
    assert topology.discover(None).devices == []
    plan = plugin.deepinfer_plan_parallel(topology=topo, parallel_config=SimpleNamespace(
        data_parallel_size=2, expert_parallel_size=2))
    assert plan.device_of_rank == {0: 0, 1: 1}


def test_registering_and_resolving_imports_neither_torch_npu_nor_tilelang(tmp_path):
    code = textwrap.dedent("""
        import sys, torch
        from deepinfer_core.ops.registry import BuildContext, OpRegistry, resolve_ops
        from deepinfer_ascend_950 import registration
        reg = OpRegistry(); registration.register_all(reg)
        resolve_ops(reg, BuildContext(backend="ascend_950", device=torch.device("cpu")))
        assert "tilelang" not in sys.modules and "torch_npu" not in sys.modules, sorted(sys.modules)
        print("clean")
    """)
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",
           "PYTHONPATH": os.pathsep.join([str(REPO / "backends/ascend_950"), str(REPO)])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and "clean" in done.stdout, done.stderr


def test_ops_dry_run_imports_neither_torch_npu_nor_tilelang():
    code = textwrap.dedent("""
        import contextlib, io, sys
        from deepinfer_core.entrypoints import cli
        with contextlib.redirect_stdout(io.StringIO()):
            assert cli.main(["ops", "--backend", "ascend_950", "--dry-run", "--json"]) == 0
        assert not {"tilelang", "tvm", "torch_npu"} & set(sys.modules), sorted(sys.modules)
        print("clean")
    """)
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and "clean" in done.stdout, done.stderr

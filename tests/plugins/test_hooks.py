"""Every hook spec is called by the core where its docstring says, and has a test named after it here
or elsewhere (``test_hook_<name>`` or a test whose name holds the hook's short name). The tests below
register a kernel pack implementing the hook and check that building or running an engine used it."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest
import torch

from deepinfer_core import hookspecs, plugins

try:
    from plugin_helpers import FakeDists
except ImportError:  # tests/ imported as a package
    from tests.plugin_helpers import FakeDists

CORE = Path(hookspecs.__file__).parent
REPO = Path(__file__).resolve().parents[2]
SPECS = sorted(name for name, obj in inspect.getmembers(hookspecs, inspect.isfunction)
               if hasattr(obj, f"{hookspecs.PROJECT}_spec"))


def _core_callers(name: str) -> list[str]:
    pattern = re.compile(rf"\bhook\.{name}\b")
    return [str(p.relative_to(CORE)) for p in CORE.rglob("*.py") if pattern.search(p.read_text())]


def _test_names() -> set[str]:
    names = set()
    for path in [*(REPO / "tests").rglob("test_*.py"), *REPO.glob("backends/*/tests/**/test_*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test_"):
                names.add(node.name)
    return names


def test_every_hook_has_a_caller_in_the_core():
    assert len(SPECS) >= 10
    assert [name for name in SPECS if not _core_callers(name)] == []


def test_every_hook_has_a_test_named_after_it():
    names = _test_names()
    untested = [h for h in SPECS if not any(h.removeprefix("deepinfer_") in t for t in names)]
    assert untested == []


def _shipped_hookimpls() -> list[tuple[str, object]]:
    import importlib

    impls = []
    for module in ("deepinfer_cpu_ref.plugin", "deepinfer_nvidia_sm100.plugin", "deepinfer_ascend_950.plugin",
                   "deepinfer_example_kernels.plugin"):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        impls += [(f"{module}.{name}", fn) for name, fn in inspect.getmembers(mod, inspect.isfunction)
                  if hasattr(fn, f"{hookspecs.PROJECT}_impl")]
    return impls


def test_shipped_hookimpls_take_every_argument_without_defaults():
    """pluggy never passes a hookimpl's defaulted parameters: a default there silently pins the value."""
    impls = _shipped_hookimpls()
    assert any(name.startswith("deepinfer_cpu_ref.") for name, _ in impls)
    defaulted = [f"{name}({p.name})" for name, fn in impls for p in inspect.signature(fn).parameters.values()
                 if p.default is not inspect.Parameter.empty]
    assert defaulted == []


def test_the_checks_catch_a_hook_without_caller_or_test():
    assert _core_callers("deepinfer_no_such_hook") == []
    assert not any("no_such_hook" in t for t in _test_names())


# --- each hook through the core ---------------------------------------------------------------------

PACK = '''
import torch
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.platform import Platform
from deepinfer_core.topology import ParallelPlan

CALLS = []

class RecordingPlatform(Platform):
    def memory_budget(self, cache_config, reserved_bytes=0):
        CALLS.append(("memory_budget", reserved_bytes))
        return super().memory_budget(cache_config, reserved_bytes)

@hookimpl
def deepinfer_configure(model_config, cache_config):
    CALLS.append(("configure", cache_config.block_size))
    cache_config.num_blocks = 37

@hookimpl
def deepinfer_init_device(local_rank):
    CALLS.append(("init_device", local_rank))
    return torch.device("cpu")

@hookimpl
def deepinfer_platform(device):
    CALLS.append(("platform", device.type))
    return RecordingPlatform(device)

@hookimpl
def deepinfer_discover_topology():
    from deepinfer_core.topology import single_host_cpu_topology
    CALLS.append(("discover_topology",))
    return single_host_cpu_topology()

@hookimpl
def deepinfer_plan_parallel(topology, parallel_config):
    CALLS.append(("plan_parallel", parallel_config.data_parallel_size, topology.num_devices))
    return ParallelPlan(1, 1, {0: 0})

@hookimpl
def deepinfer_make_communicator(group, device):
    from deepinfer_core.comm import TorchDistributedCommunicator
    CALLS.append(("make_communicator", device.type))
    return TorchDistributedCommunicator(group)

@hookimpl
def deepinfer_collect_env():
    return {"recorder": "present"}
'''


@pytest.fixture
def recorder(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    fake = FakeDists(site)
    fake.ensure_repo_dists(monkeypatch)
    fake.add("deepinfer-recorder", {plugins.KERNEL_GROUP: {"recorder": "recorder_pack"}}, {"recorder_pack": PACK})
    monkeypatch.setenv(plugins.ALLOWLIST_ENV, "recorder")
    plugins._LOADED.clear()
    import sys

    yield sys.modules.get("recorder_pack") or __import__("recorder_pack")
    plugins._LOADED.clear()
    fake.cleanup()


@pytest.fixture
def engine(recorder):
    from deepinfer_core.engine.args import EngineArgs
    from deepinfer_core.engine.llm_engine import LLMEngine

    recorder.CALLS.clear()
    return LLMEngine(EngineArgs(dtype="float32", max_num_seqs=4))


def _calls(recorder, kind):
    return [c for c in recorder.CALLS if c[0] == kind]


def test_hook_deepinfer_backend_info(recorder):
    loaded = plugins.load_backend("cpu_ref")
    assert loaded.info.name == "cpu_ref" and loaded.info.device_type == "cpu"


def test_hook_deepinfer_configure(engine, recorder):
    assert _calls(recorder, "configure") == [("configure", 128)]
    assert engine.pool_sizes.num_blocks == 37  # the mutated cache config sized the pool


def test_hook_deepinfer_init_device(engine, recorder):
    assert _calls(recorder, "init_device") == [("init_device", 0)]
    assert engine.device == torch.device("cpu")


def test_hook_deepinfer_platform(engine, recorder):
    assert _calls(recorder, "platform") == [("platform", "cpu")]
    assert type(engine.platform).__name__ == "RecordingPlatform"
    assert _calls(recorder, "memory_budget") == [("memory_budget", 0)]  # the pools were planned through it


def test_hook_deepinfer_discover_topology_and_plan_parallel(engine, recorder):
    assert _calls(recorder, "discover_topology") == [("discover_topology",)]
    assert _calls(recorder, "plan_parallel") == [("plan_parallel", 1, 1)]
    assert engine.executor.plan.device_of_rank == {0: 0} and engine.executor.driver_worker.local_rank == 0


def test_hook_deepinfer_make_communicator(engine, recorder):
    assert _calls(recorder, "make_communicator") == [("make_communicator", "cpu")]
    comm = engine.executor.communicator
    assert comm.world_size == 1 and comm.rank == 0
    t = torch.ones(3)
    assert torch.equal(comm.all_reduce(t), torch.ones(3))


def test_hook_deepinfer_collect_env(recorder):
    rows = {r["name"]: r for r in plugins.describe_backends()}
    assert rows["cpu_ref"].get("recorder") == "present"


def test_hook_deepinfer_register_ops(recorder):
    loaded = plugins.load_backend("cpu_ref")
    registry = plugins.collect_registry(loaded)
    assert registry.candidates("rms_norm")  # the backend (and the core's native bodies) registered


def test_hook_deepinfer_graph_runner_is_asked_only_where_graphs_can_run(recorder, monkeypatch):
    """On a platform with graphs the ModelRunner asks the backend for its graph runner (with the
    platform; with verification-sized graphs and streams when speculating) and decodes through it; on
    one without, it never asks."""
    from deepinfer_core.engine.args import EngineArgs
    from deepinfer_core.engine.llm_engine import LLMEngine
    from deepinfer_core.worker.graph_runner import GraphRunner

    asked = []

    class GraphPlatform(recorder.RecordingPlatform):
        supports_graphs = True

    def graph_runner(model, cache, capture_sizes, max_model_len, block_size, platform, query_lens, keep_streams):
        asked.append((tuple(capture_sizes), type(platform).__name__, tuple(query_lens), keep_streams))
        return GraphRunner(model, cache, capture_sizes, max_model_len, block_size, capture=False, platform=platform,
                           query_lens=query_lens, keep_streams=keep_streams)

    from deepinfer_core.default_model import v4_model_path

    v4 = str(v4_model_path())  # the trained tiny V4: V4.1 decodes eagerly, and drafts with DSpark
    engine = LLMEngine(EngineArgs(v4, dtype="float32", max_num_seqs=4))
    assert asked == [] and engine.runner.graph_runner is None
    eager = _greedy(engine)

    monkeypatch.setattr(recorder, "deepinfer_platform", None, raising=False)
    loaded = plugins.load_backend("cpu_ref")
    from deepinfer_core.hookspecs import hookimpl

    class GraphPack:
        @hookimpl(tryfirst=True)
        def deepinfer_platform(self, device):
            return GraphPlatform(device)

        @hookimpl
        def deepinfer_graph_runner(self, model, cache, capture_sizes, max_model_len, block_size, platform,
                                   query_lens, keep_streams):
            return graph_runner(model, cache, capture_sizes, max_model_len, block_size, platform, query_lens,
                                keep_streams)

    pack = GraphPack()
    loaded.pm.register(pack, name="graph-pack")
    try:
        engine = LLMEngine(EngineArgs(v4, dtype="float32", max_num_seqs=4))
        assert asked == [] and engine.runner.graph_runner is None  # cpu_ref's MoE waits for the host
        from deepinfer_core.ops.registry import OpTable

        monkeypatch.setattr(OpTable, "syncs_host", lambda self, ops: [])
        engine = LLMEngine(EngineArgs(v4, dtype="float32", max_num_seqs=4))
        assert asked == [((1, 2, 4), "GraphPlatform", (1,), False)]
        assert isinstance(engine.runner.graph_runner, GraphRunner)
        assert _greedy(engine) == eager
        asked.clear()
        engine = LLMEngine(EngineArgs(v4, dtype="float32", max_num_seqs=4,
                                      speculative_config={"method": "mtp", "num_speculative_tokens": 2}))
        assert asked == [((1, 2, 4), "GraphPlatform", (1, 3), True)]
        assert engine.runner.graph_runner.query_lens == [1, 3]
        assert _greedy(engine) == eager
        assert engine.drafts.confidence is None and engine.runner.step_profile is None  # fixed k: no timing
        engine = LLMEngine(EngineArgs(v4, dtype="float32", max_num_seqs=4, speculative_config={
            "method": "mtp", "num_speculative_tokens": 2, "schedule": "confidence"}))
        profile = engine.drafts.confidence.profile  # the graphs timed, for the scheduler to price steps by
        # every verification length: a step verifying fewer drafts replays (and is priced as) a shorter graph
        assert engine.runner.graph_runner.query_lens == [1, 2, 3]
        assert sorted(profile.seconds) == [(s, q) for s in (1, 2, 4) for q in (1, 2, 3)]
        assert all(t > 0 for t in profile.seconds.values())
        assert _greedy(engine) == eager
    finally:
        loaded.pm.unregister(pack)


def _greedy(engine) -> list[int]:
    from deepinfer_core.sampling.params import SamplingParams

    engine.add_request("g", {"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(temperature=0, max_tokens=6,
                                                                             ignore_eos=True))
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
    return out.outputs[0].token_ids


def test_hook_deepinfer_kv_cache_spec_sizes_the_engine_cache(recorder):
    """The engine's worker asks for the layout once and allocates the cache after it."""
    from deepinfer_core.engine.args import EngineArgs
    from deepinfer_core.engine.llm_engine import LLMEngine
    from deepinfer_core.hookspecs import hookimpl
    from deepinfer_core.model.kv_cache_spec import KVCacheSpec

    asked = []

    class SpecPack:
        @hookimpl
        def deepinfer_kv_cache_spec(self, model_config, cache_config, dtype):
            asked.append(dtype)
            return KVCacheSpec.default(model_config, cache_config.block_size, dtype)

    loaded = plugins.load_backend("cpu_ref")
    pack = SpecPack()
    loaded.pm.register(pack, name="spec-pack")
    try:
        engine = LLMEngine(EngineArgs(dtype="float32", max_num_seqs=4))
    finally:
        loaded.pm.unregister(pack)
    assert asked == [torch.float32]
    assert engine.cache.kv_spec == KVCacheSpec.default(engine.model_config, 128, torch.float32)
    assert _greedy(engine)

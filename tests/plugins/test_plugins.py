"""Plugin discovery, loading and op resolution: every bad input gives an error naming its origin."""

from __future__ import annotations

import importlib.util
import inspect
import os
import shutil
import subprocess
import sys
import textwrap
import types

import pluggy
import pytest
import torch

from deepinfer_core import hookspecs, plugins
from deepinfer_core.ops.catalogue import CATALOGUE
from deepinfer_core.ops.registry import MissingOpError, OpRegistrationError

try:
    from plugin_helpers import REPO, FakeDists, backend_source, kernel_pack_source
except ImportError:  # tests/ imported as a package
    from tests.plugin_helpers import REPO, FakeDists, backend_source, kernel_pack_source

PACK = "example_fused_rms_norm"
PACK_PROVIDER = f"{plugins.KERNEL_GROUP}:{PACK}"
CPU_REF_PROVIDER = f"{plugins.BACKEND_GROUP}:cpu_ref"


@pytest.fixture(autouse=True)
def fresh_plugins(monkeypatch):
    """No cached loads and no allowlist leak between tests."""
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


def only_packs(monkeypatch, *names: str) -> None:
    monkeypatch.setenv(plugins.ALLOWLIST_ENV, ",".join(names))


def test_discovery_sees_each_distribution_installed_or_removed_after_a_lookup(dists):
    """Entry points are read once per state of the import path: a distribution installed (or removed)
    after a lookup, even in the same folder within one tick of its clock, is seen by the next."""
    assert "late_one" not in plugins.installed_backends()
    for n in ("one", "two"):
        dists.add(f"deepinfer-late-{n}", {plugins.BACKEND_GROUP: {f"late_{n}": f"late_{n}_mod"}},
                  {f"late_{n}_mod": backend_source(f"late_{n}")})
        assert f"late_{n}" in plugins.installed_backends()
    shutil.rmtree(dists.site / "deepinfer_late_two-1.0.dist-info")
    assert "late_two" not in plugins.installed_backends() and "late_one" in plugins.installed_backends()


# --- bad inputs ------------------------------------------------------------------------------------


def test_unknown_backend_lists_installed_backends(dists):
    dists.add(
        "deepinfer-fake-one",
        {plugins.BACKEND_GROUP: {"fake_one": "fake_one_mod"}},
        {"fake_one_mod": backend_source("fake_one")},
    )
    with pytest.raises(plugins.PluginError) as err:
        plugins.load_backend("no_such_backend")
    msg = str(err.value)
    assert "'no_such_backend'" in msg
    assert "installed backends: " in msg
    for name in ("cpu_ref", "fake_one", "nvidia_sm100", "ascend_950"):
        assert name in msg
    assert not isinstance(err.value, plugins.BackendUnavailableError)


def test_backend_import_failure_names_entry_point_and_distribution(dists):
    dists.add(
        "deepinfer-broken-import",
        {plugins.BACKEND_GROUP: {"broken_import": "broken_import_mod"}},
        {"broken_import_mod": "raise ImportError('libfancy.so.3: cannot open shared object file')\n"},
        version="2.5",
    )
    with pytest.raises(plugins.PluginError) as err:
        plugins.load_backend("broken_import")
    msg = str(err.value)
    assert msg.startswith("cannot import entry point 'broken_import' (broken_import_mod)")
    assert "deepinfer-broken-import 2.5" in msg
    assert "ImportError: libfancy.so.3" in msg
    assert isinstance(err.value.__cause__, ImportError)


def test_backend_entry_point_to_missing_module(dists):
    dists.add("deepinfer-typo", {plugins.BACKEND_GROUP: {"typo": "no_such_module_xyz.plugin"}})
    with pytest.raises(plugins.PluginError, match=r"'typo'.*deepinfer-typo 1\.0.*ModuleNotFoundError"):
        plugins.load_backend("typo")


def test_kernel_pack_import_failure_names_pack(dists, monkeypatch):
    dists.add(
        "deepinfer-bad-pack-import",
        {plugins.KERNEL_GROUP: {"bad_import": "bad_import_mod"}},
        {"bad_import_mod": "import torch\nraise RuntimeError('needs a newer triton')\n"},
    )
    only_packs(monkeypatch, "bad_import")
    with pytest.raises(
        plugins.PluginError, match=r"'bad_import'.*deepinfer-bad-pack-import 1\.0.*newer triton"
    ):
        plugins.load_backend("cpu_ref")


def test_plugin_raising_while_registering_ops(dists, monkeypatch):
    dists.add(
        "deepinfer-raiser",
        {plugins.KERNEL_GROUP: {"raiser": "raiser_mod"}},
        {"raiser_mod": kernel_pack_source("raise ZeroDivisionError('kernel table is empty')\n")},
    )
    only_packs(monkeypatch, "raiser")
    loaded = plugins.load_backend("cpu_ref")  # importing and validating is fine
    with pytest.raises(plugins.PluginError) as err:
        plugins.collect_registry(loaded)
    msg = str(err.value)
    assert "deepinfer.kernels:raiser" in msg
    assert "deepinfer-raiser 1.0" in msg
    assert "raised while registering ops: kernel table is empty" in msg
    assert isinstance(err.value.__cause__, ZeroDivisionError)


def test_op_registered_twice_at_same_priority(dists, monkeypatch):
    dists.add(
        "deepinfer-dup",
        {plugins.KERNEL_GROUP: {"dup": "dup_mod"}},
        {"dup_mod": kernel_pack_source("registry.register('rms_norm', ALL_OPS['rms_norm'], priority=0)\n")},
    )
    only_packs(monkeypatch, "dup")
    with pytest.raises(plugins.PluginError) as err:
        plugins.build_op_table("cpu_ref")
    msg = str(err.value)
    assert "deepinfer-dup 1.0" in msg
    assert "op 'rms_norm' registered twice at priority 0" in msg
    assert f"by {CPU_REF_PROVIDER} and by deepinfer.kernels:dup" in msg
    assert isinstance(err.value.__cause__, OpRegistrationError)


def test_same_op_at_different_priorities_is_fine(dists, monkeypatch):
    dists.add(
        "deepinfer-lower",
        {plugins.KERNEL_GROUP: {"lower": "lower_mod"}},
        {
            "lower_mod": kernel_pack_source(
                "registry.register('rms_norm', ALL_OPS['rms_norm'], priority=-5)\n"
            )
        },
    )
    only_packs(monkeypatch, "lower")
    table = plugins.build_op_table("cpu_ref")
    assert table.provider("rms_norm") == CPU_REF_PROVIDER  # priority 0 beats -5


def test_hookimpl_with_wrong_signature(dists, monkeypatch):
    source = (
        "from deepinfer_core.hookspecs import hookimpl\n\n"
        "@hookimpl\n"
        "def deepinfer_register_ops(registry, backend, device):\n"
        "    pass\n"
    )
    dists.add(
        "deepinfer-wrong-sig",
        {plugins.KERNEL_GROUP: {"wrong_sig": "wrong_sig_mod"}},
        {"wrong_sig_mod": source},
    )
    only_packs(monkeypatch, "wrong_sig")
    with pytest.raises(plugins.PluginError) as err:
        plugins.load_backend("cpu_ref")
    msg = str(err.value)
    assert msg.startswith("invalid hook implementation in entry point 'wrong_sig' (wrong_sig_mod)")
    assert "deepinfer-wrong-sig 1.0" in msg
    assert "device" in msg  # pluggy names the argument the hookspec does not have
    assert isinstance(err.value.__cause__, pluggy.PluginValidationError)
    assert plugins._LOADED == {}  # a failed load is not cached


def test_hookimpl_for_unknown_hook(dists, monkeypatch):
    source = (
        "from deepinfer_core.hookspecs import hookimpl\n\n"
        "@hookimpl\n"
        "def deepinfer_register_opps(registry):\n"
        "    pass\n"
    )
    dists.add(
        "deepinfer-typo-hook",
        {plugins.KERNEL_GROUP: {"typo_hook": "typo_hook_mod"}},
        {"typo_hook_mod": source},
    )
    only_packs(monkeypatch, "typo_hook")
    with pytest.raises(
        plugins.PluginError, match=r"'typo_hook'.*deepinfer-typo-hook 1\.0.*deepinfer_register_opps"
    ):
        plugins.load_backend("cpu_ref")


def test_hookimpl_taking_a_subset_of_the_arguments_is_called_correctly(dists, monkeypatch):
    # pluggy allows an implementation to accept only some of the spec's arguments
    source = (
        "from deepinfer_core.hookspecs import hookimpl\n"
        "from deepinfer_cpu_ref.ops import ALL_OPS\n\n"
        "@hookimpl\n"
        "def deepinfer_register_ops(registry):\n"
        "    registry.register('swiglu', ALL_OPS['swiglu'], priority=3)\n"
    )
    dists.add("deepinfer-subset", {plugins.KERNEL_GROUP: {"subset": "subset_mod"}}, {"subset_mod": source})
    only_packs(monkeypatch, "subset")
    table = plugins.build_op_table("cpu_ref")
    assert table.provider("swiglu") == "deepinfer.kernels:subset"


def test_unmarked_function_is_not_a_hook(dists, monkeypatch):
    # without @hookimpl pluggy does not register the function, so it must not be called either
    source = (
        "def deepinfer_register_ops(registry, backend):\n"
        "    raise AssertionError('called an unmarked function')\n"
    )
    dists.add(
        "deepinfer-unmarked", {plugins.KERNEL_GROUP: {"unmarked": "unmarked_mod"}}, {"unmarked_mod": source}
    )
    only_packs(monkeypatch, "unmarked")
    assert plugins.build_op_table("cpu_ref").provider("rms_norm") == CPU_REF_PROVIDER


def test_backend_without_info_hook(dists):
    dists.add(
        "deepinfer-no-info", {plugins.BACKEND_GROUP: {"no_info": "no_info_mod"}}, {"no_info_mod": "X = 1\n"}
    )
    with pytest.raises(
        plugins.PluginError, match=r"'no_info'.*deepinfer-no-info 1\.0.*no deepinfer_backend_info"
    ):
        plugins.load_backend("no_info")


def test_backend_info_hook_raising(dists):
    source = (
        "from deepinfer_core.hookspecs import hookimpl\n\n"
        "@hookimpl\n"
        "def deepinfer_backend_info():\n"
        "    raise OSError('driver version mismatch')\n"
    )
    dists.add(
        "deepinfer-info-raises",
        {plugins.BACKEND_GROUP: {"info_raises": "info_raises_mod"}},
        {"info_raises_mod": source},
    )
    with pytest.raises(plugins.PluginError) as err:
        plugins.load_backend("info_raises", require_available=False)
    assert "deepinfer-info-raises 1.0" in str(err.value)
    assert "driver version mismatch" in str(err.value)


def test_module_registered_twice(dists, monkeypatch):
    # one module declared as both the backend and a kernel pack: pluggy refuses the second registration
    dists.add(
        "deepinfer-twice",
        {plugins.BACKEND_GROUP: {"twice": "twice_mod"}, plugins.KERNEL_GROUP: {"twice_pack": "twice_mod"}},
        {"twice_mod": backend_source("twice")},
    )
    only_packs(monkeypatch, "twice_pack")
    with pytest.raises(plugins.PluginError, match=r"'twice_pack'.*deepinfer-twice 1\.0"):
        plugins.load_backend("twice")


def test_unavailable_backend(dists):
    dists.add(
        "deepinfer-needs-hw",
        {plugins.BACKEND_GROUP: {"needs_hw": "needs_hw_mod"}},
        {
            "needs_hw_mod": backend_source(
                "needs_hw", available=False, reason="no flux capacitor on this host"
            )
        },
    )
    with pytest.raises(plugins.BackendUnavailableError) as err:
        plugins.load_backend("needs_hw")
    msg = str(err.value)
    assert "'needs_hw'" in msg
    assert "deepinfer-needs-hw 1.0" in msg
    assert msg.endswith("is not available here: no flux capacitor on this host")
    # still loadable for inspection
    loaded = plugins.load_backend("needs_hw", require_available=False)
    assert loaded.info.name == "needs_hw"
    with pytest.raises(plugins.BackendUnavailableError):
        plugins.build_op_table("needs_hw")


def test_unknown_op_name(dists, monkeypatch):
    dists.add(
        "deepinfer-typo-op",
        {plugins.KERNEL_GROUP: {"typo_op": "typo_op_mod"}},
        {
            "typo_op_mod": kernel_pack_source(
                "registry.register('rms_nrom', ALL_OPS['rms_norm'], priority=5)\n"
            )
        },
    )
    only_packs(monkeypatch, "typo_op")
    with pytest.raises(plugins.PluginError) as err:
        plugins.build_op_table("cpu_ref")
    msg = str(err.value)
    assert "deepinfer.kernels:typo_op" in msg and "deepinfer-typo-op 1.0" in msg
    assert "unknown op 'rms_nrom'" in msg
    assert "'rms_norm'" in msg  # the known ops are listed
    assert isinstance(err.value.__cause__, OpRegistrationError)


def test_non_callable_op(dists, monkeypatch):
    dists.add(
        "deepinfer-not-fn",
        {plugins.KERNEL_GROUP: {"not_fn": "not_fn_mod"}},
        {"not_fn_mod": kernel_pack_source("registry.register('linear', 'F.linear', priority=5)\n")},
    )
    only_packs(monkeypatch, "not_fn")
    with pytest.raises(plugins.PluginError, match=r"deepinfer-not-fn 1\.0.*non-callable for op 'linear'"):
        plugins.build_op_table("cpu_ref")


def test_missing_op_at_build_time_and_reference_fallback(dists, monkeypatch):
    dists.add(
        "deepinfer-partial",
        {plugins.BACKEND_GROUP: {"partial": "partial_mod"}},
        {"partial_mod": backend_source("partial", ops=["embedding", "linear"])},
    )
    only_packs(monkeypatch)  # no kernel packs: the fallback is the bare reference
    with pytest.raises(MissingOpError) as err:
        plugins.build_op_table("partial")
    msg = str(err.value)
    assert "backend 'partial'" in msg
    assert "'rms_norm'" in msg and "'sparse_attention'" in msg
    assert "'embedding'" not in msg and "'linear'" not in msg
    assert "allow_reference_fallback=True" in msg

    table = plugins.build_op_table("partial", allow_reference_fallback=True)
    assert table.provider("embedding") == "deepinfer.backends:partial"
    assert table.provider("linear") == "deepinfer.backends:partial"
    assert set(table.chosen) == set(CATALOGUE)
    for op in set(CATALOGUE) - {"embedding", "linear"}:
        assert table.provider(op) == CPU_REF_PROVIDER
    x = torch.randn(3, 8)
    torch.testing.assert_close(
        table.rms_norm(x, None, 1e-6), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    )


def test_predicate_declining_falls_to_next_priority(dists, monkeypatch):
    dists.add(
        "deepinfer-picky",
        {plugins.KERNEL_GROUP: {"picky": "picky_mod"}},
        {
            "picky_mod": kernel_pack_source(
                "registry.register('swiglu', ALL_OPS['swiglu'], priority=7,\n"
                "                  predicate=lambda ctx: ctx.dtype == 'only-this')\n"
            )
        },
    )
    only_packs(monkeypatch, "picky")
    assert plugins.build_op_table("cpu_ref").provider("swiglu") == CPU_REF_PROVIDER
    plugins._LOADED.clear()
    assert (
        plugins.build_op_table("cpu_ref", dtype="only-this").provider("swiglu") == "deepinfer.kernels:picky"
    )


# --- the example kernel pack -----------------------------------------------------------------------


def test_example_pack_overrides_rms_norm_on_cpu_ref(dists, monkeypatch):
    only_packs(monkeypatch, PACK)  # other installed packs must not change the expected table
    loaded = plugins.load_backend("cpu_ref")
    assert PACK in loaded.kernel_packs
    registry = plugins.collect_registry(loaded)
    assert [(i.provider, i.priority) for i in registry.candidates("rms_norm")] == [
        (PACK_PROVIDER, 10),
        (CPU_REF_PROVIDER, 0),
    ]
    table = plugins.build_op_table("cpu_ref")
    assert table.provider("rms_norm") == PACK_PROVIDER
    assert table.rms_norm.__module__ == "deepinfer_example_kernels.ops"
    # every other op is still the reference
    assert {op for op in CATALOGUE if table.provider(op) != CPU_REF_PROVIDER} == {"rms_norm"}


@pytest.mark.parametrize("dtype", [None, torch.float32, torch.float64, torch.bfloat16])
def test_example_pack_predicate_accepts_supported_dtypes(dists, dtype):
    assert plugins.build_op_table("cpu_ref", dtype=dtype).provider("rms_norm") == PACK_PROVIDER


@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn, torch.int8])
def test_example_pack_predicate_declines_other_dtypes(dists, dtype):
    assert plugins.build_op_table("cpu_ref", dtype=dtype).provider("rms_norm") == CPU_REF_PROVIDER


def test_example_pack_does_not_register_for_other_backends(dists):
    dists.add(
        "deepinfer-other",
        {plugins.BACKEND_GROUP: {"other_be": "other_be_mod"}},
        {"other_be_mod": backend_source("other_be")},
    )
    loaded = plugins.load_backend("other_be")
    assert PACK in loaded.kernel_packs  # loaded, but it declines to register
    registry = plugins.collect_registry(loaded)
    assert [i.provider for i in registry.candidates("rms_norm")] == ["deepinfer.backends:other_be"]
    assert plugins.build_op_table("other_be").provider("rms_norm") == "deepinfer.backends:other_be"


@pytest.mark.parametrize("allow", ["", "some_other_pack", " , "])
def test_allowlist_excludes_example_pack(dists, monkeypatch, allow):
    monkeypatch.setenv(plugins.ALLOWLIST_ENV, allow)
    loaded = plugins.load_backend("cpu_ref")
    assert loaded.kernel_packs == []
    assert [name for name, _ in loaded.pm.list_name_plugin()] == [CPU_REF_PROVIDER]
    assert plugins.build_op_table("cpu_ref").provider("rms_norm") == CPU_REF_PROVIDER


def test_allowlist_includes_named_pack(dists, monkeypatch):
    monkeypatch.setenv(plugins.ALLOWLIST_ENV, f" some_other_pack , {PACK} ")
    assert plugins.build_op_table("cpu_ref").provider("rms_norm") == PACK_PROVIDER


def _reference_rms_norm(x, weight, eps):
    from deepinfer_cpu_ref.ops import rms_norm

    return rms_norm(x, weight, eps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_weight", [True, False])
def test_example_rms_norm_matches_reference(dists, dtype, with_weight):
    from deepinfer_example_kernels.ops import fused_rms_norm

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 5, 96, generator=gen, dtype=torch.float64) * 30).to(dtype)
    weight = torch.randn(96, generator=gen, dtype=torch.float64).to(dtype) if with_weight else None
    x_before = x.clone()
    out = fused_rms_norm(x, weight, 1e-5)
    ref = _reference_rms_norm(x, weight, 1e-5)
    assert out.dtype == dtype and out.shape == x.shape
    tol = {torch.float64: 1e-12, torch.float32: 1e-6}.get(dtype)  # low precision: dtype defaults
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    assert torch.equal(x, x_before)  # the input is not modified in place


def test_example_rms_norm_keeps_float64_precision(dists):
    from deepinfer_example_kernels.ops import fused_rms_norm

    x = torch.tensor([[1.0 + 1e-12, 1.0 - 1e-12, 3.0]], dtype=torch.float64)
    expected = x / torch.sqrt((x**2).mean(-1, keepdim=True) + 1e-6)
    out = fused_rms_norm(x, None, 1e-6)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, expected, rtol=1e-14, atol=0)
    # a float32 computation cannot resolve the 1e-12 difference between the first two entries
    assert out[0, 0] != out[0, 1]


# --- loading behaviour -----------------------------------------------------------------------------


def test_load_backend_is_idempotent(dists):
    first = plugins.load_backend("cpu_ref")
    again = plugins.load_backend("cpu_ref", require_available=False)
    assert first is again
    assert first.pm is again.pm
    # each plugin module registered once
    names = [name for name, _ in first.pm.list_name_plugin()]
    assert len(names) == len(set(names)) == 1 + len(first.kernel_packs)


def test_changing_the_allowlist_gives_a_new_load(dists, monkeypatch):
    with_pack = plugins.load_backend("cpu_ref")
    only_packs(monkeypatch)
    without = plugins.load_backend("cpu_ref")
    assert without is not with_pack
    assert PACK in with_pack.kernel_packs and without.kernel_packs == []


def undocumented_hookspecs(module: types.ModuleType) -> list[str]:
    """Names of the hookspecs in ``module`` without a docstring."""
    marker = f"{hookspecs.PROJECT}_spec"
    specs = [name for name, obj in inspect.getmembers(module, inspect.isfunction) if hasattr(obj, marker)]
    assert specs, f"no hookspecs found in {module.__name__}"
    return [name for name in specs if not (inspect.getdoc(getattr(module, name)) or "").strip()]


def test_every_hookspec_has_a_docstring():
    assert "deepinfer_register_ops" in dir(hookspecs)
    assert undocumented_hookspecs(hookspecs) == []


def test_docstring_check_catches_an_undocumented_hookspec():
    fake = types.ModuleType("fake_specs")

    @hookspecs.hookspec
    def deepinfer_documented() -> None:
        """Has one."""

    @hookspecs.hookspec
    def deepinfer_silent() -> None:
        pass

    fake.deepinfer_documented = deepinfer_documented
    fake.deepinfer_silent = deepinfer_silent
    assert undocumented_hookspecs(fake) == ["deepinfer_silent"]


# --- describe_backends -----------------------------------------------------------------------------


def test_describe_backends_survives_broken_backends(dists):
    dists.add(
        "deepinfer-broken-import",
        {plugins.BACKEND_GROUP: {"broken_import": "broken_import_mod"}},
        {"broken_import_mod": "raise ImportError('no libfancy')\n"},
    )
    dists.add(
        "deepinfer-probe-raises",
        {plugins.BACKEND_GROUP: {"probe_raises": "probe_raises_mod"}},
        {
            "probe_raises_mod": (
                "from deepinfer_core.hookspecs import hookimpl\n"
                "from deepinfer_core.hookspecs import BackendInfo\n\n"
                "def boom():\n    raise RuntimeError('probe exploded')\n\n"
                "@hookimpl\n"
                "def deepinfer_backend_info():\n"
                "    return BackendInfo(name='probe_raises', device_type='x',\n"
                "                       is_available=boom, details=boom)\n"
            )
        },
    )
    rows = {row["name"]: row for row in plugins.describe_backends()}
    assert rows["cpu_ref"]["available"] == "yes"
    assert rows["broken_import"]["available"] == "no"
    assert "deepinfer-broken-import" in rows["broken_import"]["reason"]
    assert "no libfancy" in rows["broken_import"]["reason"]
    assert rows["probe_raises"]["available"] == "no"
    assert "probe exploded" in rows["probe_raises"]["reason"]
    assert rows["probe_raises"]["distribution"] == "deepinfer-probe-raises"


# --- backend probes (no GPU/NPU needed: the hardware is faked) ---------------------------------------


class FakeCuda:
    def __init__(self, available=True, capability=(10, 0), name="NVIDIA B200", raises=None):
        self._available, self._capability, self._name, self._raises = available, capability, name, raises

    def is_available(self):
        if self._raises:
            raise self._raises
        return self._available

    def current_device(self):
        return 0

    def device_count(self):
        return 8 if self._available else 0

    def get_device_capability(self, device=None):
        return self._capability

    def get_device_name(self, device=None):
        return self._name


@pytest.fixture
def nvidia(dists, monkeypatch):
    from deepinfer_nvidia_sm100 import plugin

    monkeypatch.setattr(torch.version, "cuda", "12.9")
    return plugin


def test_nvidia_probe_on_this_cpu_build(dists):
    from deepinfer_nvidia_sm100 import plugin

    ok, reason = plugin.is_available()
    if torch.version.cuda is None:
        assert (ok, reason) == (False, f"torch {torch.__version__} is built without CUDA (CPU-only build)")
    elif not torch.cuda.is_available():
        assert not ok and reason.startswith("no CUDA device visible")
    else:
        assert ok == (torch.cuda.get_device_capability() >= (9, 0))


def test_nvidia_probe_no_device(nvidia, monkeypatch):
    monkeypatch.setattr(torch, "cuda", FakeCuda(available=False))
    ok, reason = nvidia.is_available()
    assert not ok
    assert reason.startswith("no CUDA device visible") and "CUDA 12.9" in reason


def test_nvidia_probe_capability_too_low(nvidia, monkeypatch):
    monkeypatch.setattr(torch, "cuda", FakeCuda(capability=(8, 6), name="NVIDIA A40"))
    ok, reason = nvidia.is_available()
    assert not ok
    assert "compute capability 8.6" in reason and "NVIDIA A40" in reason and "below the 9.0" in reason


@pytest.mark.parametrize("capability", [(9, 0), (10, 0), (12, 0)])
def test_nvidia_probe_available(nvidia, monkeypatch, capability):
    monkeypatch.setattr(torch, "cuda", FakeCuda(capability=capability))
    assert nvidia.is_available() == (True, "")


def test_nvidia_probe_never_raises(nvidia, monkeypatch):
    monkeypatch.setattr(torch, "cuda", FakeCuda(raises=RuntimeError("CUDA driver initialization failed")))
    ok, reason = nvidia.is_available()
    assert not ok and "CUDA driver initialization failed" in reason
    details = nvidia.details()
    assert "CUDA driver initialization failed" in details["cuda_device"]


def test_nvidia_details_report_device_and_libraries(nvidia, monkeypatch):
    monkeypatch.setattr(torch, "cuda", FakeCuda(capability=(10, 0), name="NVIDIA B200"))
    details = nvidia.details()
    assert details["cuda_device"] == "0: NVIDIA B200"
    assert details["compute_capability"] == "10.0"
    for lib in ("flash_mla", "deep_gemm", "deep_ep", "triton"):
        assert lib in details and details[lib]


def test_library_probe_reports_version_or_reason(dists, tmp_path, monkeypatch):
    from deepinfer_nvidia_sm100.plugin import probe_library

    libs = tmp_path / "libs"
    libs.mkdir()
    (libs / "fake_lib_ok.py").write_text("__version__ = '1.2.3'\n")
    (libs / "fake_lib_broken.py").write_text(
        "raise OSError('libcuda.so.1: cannot open shared object file')\n"
    )
    (libs / "fake_lib_exits.py").write_text("import sys\nsys.exit('wrong GPU arch')\n")
    monkeypatch.syspath_prepend(str(libs))
    try:
        assert probe_library("fake_lib_ok") == "1.2.3"
        assert probe_library("fake_lib_broken") == (
            "missing: import failed: OSError: libcuda.so.1: cannot open shared object file"
        )
        assert probe_library("fake_lib_exits") == "missing: import failed: SystemExit: wrong GPU arch"
        assert probe_library("fake_lib_absent_xyz") == "missing: not installed"
        assert probe_library("fake_lib_absent_xyz.sub").startswith("missing: ")
    finally:
        for name in ("fake_lib_ok", "fake_lib_broken", "fake_lib_exits"):
            sys.modules.pop(name, None)


def _run_isolated(code: str, extra_path: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with ``extra_path`` first on its path (plus the repo sources)."""
    paths = [extra_path, str(REPO / "backends/nvidia_sm100"), str(REPO / "backends/ascend_950")]
    env = {"PYTHONPATH": os.pathsep.join(paths), "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=300
    )


def test_nvidia_plugin_imports_no_kernel_library_at_import(tmp_path):
    for lib in ("flash_mla", "deep_gemm", "deep_ep", "triton"):
        (tmp_path / f"{lib}.py").write_text(f"raise RuntimeError('{lib} imported at module import')\n")
    result = _run_isolated(
        """
        import sys
        import deepinfer_nvidia_sm100.plugin as p
        info = p.deepinfer_backend_info()
        assert not any(m in sys.modules for m in ("flash_mla", "deep_gemm", "deep_ep", "triton")), sys.modules
        d = info.details()
        print(d["flash_mla"])
        print(info.is_available())
        """,
        str(tmp_path),
    )
    assert result.returncode == 0, result.stderr
    assert "missing: import failed: RuntimeError: flash_mla imported at module import" in result.stdout


def test_ascend_plugin_never_imports_torch_npu_at_import(tmp_path):
    (tmp_path / "torch_npu.py").write_text("raise RuntimeError('torch_npu imported')\n")
    result = _run_isolated(
        """
        import os, sys
        os.environ.pop("ASCEND_HOME_PATH", None); os.environ.pop("ASCEND_TOOLKIT_HOME", None)
        import deepinfer_ascend_950.npu as npu
        import deepinfer_ascend_950.plugin as p
        npu.CANN_DEFAULT = "/nonexistent/ascend-toolkit"
        info = p.deepinfer_backend_info()
        assert "torch_npu" not in sys.modules
        print(info.is_available())
        assert "torch_npu" not in sys.modules  # CANN is checked before torch_npu is imported
        """,
        str(tmp_path),
    )
    assert result.returncode == 0, result.stderr
    assert "CANN toolkit not found" in result.stdout


@pytest.fixture
def ascend(dists, tmp_path, monkeypatch):
    from deepinfer_ascend_950 import npu, plugin

    for var in npu.CANN_ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(npu, "CANN_DEFAULT", str(tmp_path / "no-cann"))
    had_npu, had_module = hasattr(torch, "npu"), "torch_npu" in sys.modules
    yield plugin
    if not had_module:  # forget the fake torch_npu a test imported
        sys.modules.pop("torch_npu", None)
        if not had_npu:
            torch.__dict__.pop("npu", None)


def _fake_torch_npu(monkeypatch, tmp_path, name="Ascend950PR", available=True):
    """A ``torch_npu`` module that installs a fake ``torch.npu`` when imported."""
    npu = types.SimpleNamespace(
        is_available=lambda: available,
        device_count=lambda: 1 if available else 0,
        current_device=lambda: 0,
        get_device_name=lambda device=None: name,
    )
    libs = tmp_path / "npu_libs"
    libs.mkdir(exist_ok=True)
    (libs / "torch_npu.py").write_text(
        "import torch\ntorch.npu = torch._fake_npu\n__version__ = '2.9.0.post1'\n"
    )
    monkeypatch.syspath_prepend(str(libs))
    monkeypatch.setattr(torch, "_fake_npu", npu, raising=False)


def _fake_cann(monkeypatch, tmp_path, version="8.5.RC1"):
    home = tmp_path / "cann"
    (home / "compiler").mkdir(parents=True)
    (home / "compiler" / "version.info").write_text(f"Version={version}\nversion_dir=x\n")
    monkeypatch.setenv("ASCEND_HOME_PATH", str(home))
    return home


def test_ascend_probe_without_torch_npu(ascend, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    ok, reason = ascend.is_available()
    assert not ok and reason.startswith("torch_npu not installed")


def test_ascend_probe_without_cann(ascend, monkeypatch, tmp_path):
    _fake_torch_npu(monkeypatch, tmp_path)
    ok, reason = ascend.is_available()
    assert not ok and reason.startswith("CANN toolkit not found")
    assert ascend.details()["cann"] == "missing: toolkit not found"


def test_ascend_probe_no_npu_device(ascend, monkeypatch, tmp_path):
    _fake_cann(monkeypatch, tmp_path)
    _fake_torch_npu(monkeypatch, tmp_path, available=False)
    ok, reason = ascend.is_available()
    assert not ok and reason.startswith("no NPU device")


def test_ascend_probe_wrong_chip(ascend, monkeypatch, tmp_path):
    _fake_cann(monkeypatch, tmp_path)
    _fake_torch_npu(monkeypatch, tmp_path, name="Ascend910B3")
    ok, reason = ascend.is_available()
    assert not ok and "Ascend910B3" in reason and "Ascend 950" in reason


def test_ascend_probe_available_and_details(ascend, monkeypatch, tmp_path):
    home = _fake_cann(monkeypatch, tmp_path)
    _fake_torch_npu(monkeypatch, tmp_path, name="Ascend950PR")
    assert ascend.is_available() == (True, "")
    details = ascend.details()
    assert details["cann"] == f"8.5.RC1 at {home}"
    assert details["torch_npu"] == "2.9.0.post1"
    assert details["npu_device"] == "0: Ascend950PR"
    assert set(details) >= {"tilelang", "triton"}


def test_ascend_probe_torch_npu_import_failure(ascend, monkeypatch, tmp_path):
    _fake_cann(monkeypatch, tmp_path)
    libs = tmp_path / "bad_npu"
    libs.mkdir()
    (libs / "torch_npu.py").write_text("raise ImportError('libhccl.so: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(libs))
    ok, reason = ascend.is_available()
    assert not ok
    assert reason == "torch_npu failed to import: ImportError: libhccl.so: cannot open shared object file"

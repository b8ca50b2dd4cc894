"""One native body per op, registration fields, and predicates that decide once.

* Every catalogued op has exactly one plain-torch body in ``deepinfer_core.ops.native``; cpu_ref serves
  those bodies as the reference and nvidia_sm100 registers the same ones below its kernels.
* ``syncs_host`` is a registration field, reported by ``OpTable.syncs_host``, not an attribute on a
  function.
* An adapter to an external library is declined by its predicate at build time when the library is
  missing or its self-check fails (run once, cached); once chosen it calls the library, with no fallback.
* A Triton launcher's predicate declines the dtypes it cannot serve, so resolution picks the next
  implementation.
"""

from __future__ import annotations

import inspect
import re
from types import SimpleNamespace

import pytest
import torch

from deepinfer_core import plugins
from deepinfer_core.entrypoints.cli_plugins import resolve_table
from deepinfer_core.ops import native
from deepinfer_core.ops.catalogue import CATALOGUE
from deepinfer_core.ops.registry import (
    CHOSEN,
    DECLINED,
    SHADOWED,
    BuildContext,
    OpRegistry,
    resolve_ops,
)

NVIDIA = "nvidia_sm100"
#: the widths of DeepSeek-V4-Flash the adapters' predicates read (every one a width the libraries take)
V4_FLASH = SimpleNamespace(num_attention_heads=64, head_dim=512, hidden_size=4096, moe_intermediate_size=2048,
                           q_lora_rank=1024, o_groups=8, o_lora_rank=1024, hc_mult=4)


@pytest.fixture
def no_packs(monkeypatch):
    monkeypatch.setenv(plugins.ALLOWLIST_ENV, "")


@pytest.fixture
def nvidia_on_cpu(monkeypatch):
    monkeypatch.setenv("DEEPINFER_NVIDIA_ALLOW_CPU", "1")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def _nvidia_registry() -> OpRegistry:
    from deepinfer_nvidia_sm100 import plugin

    registry = OpRegistry()
    registry.current_provider = f"{plugins.BACKEND_GROUP}:{NVIDIA}"
    plugin.deepinfer_register_ops(registry=registry, backend=plugins.BackendInfo(name=NVIDIA, device_type="cuda"))
    return registry


def _catalogue_params(op: str) -> list[str]:
    """The argument names of the catalogue's signature ``(a: T, b: T, ...) -> ...``."""
    args = CATALOGUE[op].signature.split(") ->")[0].lstrip("(")
    return re.findall(r"(?:^|,\s*)(\w+):", args)


# --- one body per op -------------------------------------------------------------------------------


def test_every_catalogued_op_has_one_native_body_with_its_signature():
    assert set(native.NATIVE_OPS) == set(CATALOGUE)
    for op, fn in native.NATIVE_OPS.items():
        assert fn.__module__ == native.__name__ and fn.__name__ == op
        params = [p.name for p in inspect.signature(fn).parameters.values() if p.kind != p.KEYWORD_ONLY]
        assert params == _catalogue_params(op), op


def test_cpu_ref_serves_the_native_bodies(no_packs):
    from deepinfer_cpu_ref import ops

    table = plugins.build_op_table("cpu_ref", dtype=torch.float64)
    assert {op: impl.fn for op, impl in table.chosen.items()} == native.NATIVE_OPS
    assert {table.provider(op) for op in CATALOGUE} == {f"{plugins.BACKEND_GROUP}:cpu_ref"}
    assert ops.ALL_OPS == native.NATIVE_OPS and ops.rms_norm is native.rms_norm


def test_nvidia_registers_the_same_native_bodies_below_its_kernels():
    from deepinfer_nvidia_sm100.registration import TORCH

    registry = _nvidia_registry()
    for op in CATALOGUE:
        lowest = registry.candidates(op)[-1]
        assert lowest.fn is native.NATIVE_OPS[op] and lowest.priority == TORCH, op
        others = [impl.fn for impl in registry.candidates(op)[:-1]]
        assert not any(fn.__module__ == native.__name__ for fn in others), op


def test_native_register_skips_and_flags():
    registry = OpRegistry()
    native.register(registry, priority=-3, skip=["embedding"])
    assert set(registry.impls) == set(CATALOGUE) - {"embedding"}
    flagged = {op for op, impls in registry.impls.items() if impls[0].syncs_host}
    assert flagged == set(native.SYNCS_HOST) == {"moe_experts", "moe_experts_fp8", "moe_experts_fp4",
                                                 "moe_experts_act_quant", "moe_experts_quant_act",
                                                 "moe_experts_fp4_quant_act"}
    assert {impls[0].priority for impls in registry.impls.values()} == {-3}


# --- syncs_host is a registration field -------------------------------------------------------------


def test_syncs_host_is_a_registration_field_reported_by_the_table():
    registry = OpRegistry()
    native.register(registry, priority=0)
    registry.register("linear", lambda x, w, b=None: x @ w.T, priority=5, syncs_host=True)
    table = resolve_ops(registry, BuildContext(backend="t"))
    assert table.syncs_host(["rms_norm", "moe_experts", "linear", "swiglu"]) == ["moe_experts", "linear"]
    assert table.syncs_host(["embedding", "not_an_op"]) == []
    assert table.syncs_host(reversed(list(CATALOGUE))) == ["moe_experts_fp4_quant_act", "moe_experts_quant_act",
                                                          "moe_experts_act_quant", "moe_experts_fp4",
                                                          "moe_experts_fp8", "moe_experts", "linear"]


def test_no_function_carries_a_syncs_host_attribute(nvidia_on_cpu):
    registries = [_nvidia_registry(), plugins.collect_registry(plugins.load_backend("cpu_ref"))]
    for registry in registries:
        for impls in registry.impls.values():
            for impl in impls:
                assert not hasattr(impl.fn, "syncs_host"), (impl.op, impl.fn)


LOOPS = ["moe_experts", "moe_experts_fp8", "moe_experts_fp4", "moe_experts_act_quant", "moe_experts_quant_act",
         "moe_experts_fp4_quant_act"]


def test_the_tables_of_both_backends_flag_the_moe_loops(nvidia_on_cpu, no_packs):
    for backend in ("cpu_ref", NVIDIA):
        table = plugins.build_op_table(backend, dtype=torch.bfloat16, device=torch.device("cpu"))
        assert table.syncs_host(CATALOGUE) == LOOPS, backend
    bi = plugins.build_op_table("cpu_ref", dtype=torch.float32, batch_invariant=True)
    assert bi.syncs_host(CATALOGUE) == LOOPS


def test_deepinfer_ops_reports_the_fields(no_packs):
    loaded = plugins.load_backend("cpu_ref")
    rows = {r["op"]: r for r in resolve_table(loaded, plugins.collect_registry(loaded), BuildContext("cpu_ref"))}
    assert rows["moe_experts"]["chosen"]["syncs_host"] and not rows["linear"]["chosen"]["syncs_host"]
    assert rows["linear"]["alternatives"][0]["batch_invariant"] is True
    assert rows["rms_norm"]["chosen"]["function"] == "deepinfer_core.ops.native.rms_norm"


# --- resolution explained --------------------------------------------------------------------------


def test_explain_gives_every_candidate_its_verdict():
    def broken(ctx):
        raise RuntimeError("probe exploded")

    registry = OpRegistry()
    registry.register("swiglu", native.swiglu, priority=0)
    registry.register("swiglu", native.swiglu, priority=1)
    registry.register("swiglu", native.swiglu, priority=2, predicate=lambda ctx: False)
    registry.register("swiglu", native.swiglu, priority=3, predicate=broken)
    verdicts = [(impl.priority, verdict) for impl, verdict in registry.explain("swiglu", BuildContext("t"))]
    assert verdicts == [(3, "predicate raised RuntimeError: probe exploded"), (2, DECLINED), (1, CHOSEN),
                        (0, SHADOWED)]
    with pytest.raises(RuntimeError, match="probe exploded"):  # building an engine does not hide it
        registry.select("swiglu", BuildContext("t"))


# --- adapters decide once, at build time ------------------------------------------------------------


@pytest.fixture
def fake_hopper(monkeypatch, nvidia_on_cpu):
    """A device the adapters' probes accept (compute capability 9.0), with no library installed."""
    from deepinfer_nvidia_sm100 import capability

    monkeypatch.setattr(capability, "device_capability", lambda device: (9, 0))
    monkeypatch.setattr(capability, "library_feature", lambda module, attribute: False)
    return capability


def _ctx(model_config=V4_FLASH, **kw) -> BuildContext:
    return BuildContext(backend=NVIDIA, dtype=torch.bfloat16, device=torch.device("cpu"), model_config=model_config,
                        **kw)


def test_adapter_without_its_library_is_declined_at_build_time(fake_hopper):
    from deepinfer_nvidia_sm100 import external

    registry = _nvidia_registry()
    table = resolve_ops(registry, _ctx())
    for adapter in external.ADAPTERS:
        assert table.chosen[adapter.op].fn is not adapter.fn, adapter.op
        verdict = dict((impl.fn, v) for impl, v in registry.explain(adapter.op, _ctx()))[adapter.fn]
        assert verdict == DECLINED
        ok, reason = adapter.usable(torch.device("cpu"), torch.bfloat16, V4_FLASH, True)
        assert not ok and "not importable" in reason


def test_adapter_predicate_runs_its_self_check_once_and_follows_it(fake_hopper, monkeypatch):
    from deepinfer_nvidia_sm100 import external

    monkeypatch.setattr(fake_hopper, "library_feature", lambda module, attribute: True)
    monkeypatch.setattr(fake_hopper, "triton_usable", lambda device=None: (True, ""))  # the hc adapter's epilogue
    for env in (external.DEEPGEMM_MOE_ENV, external.FLASH_MLA_BF16_ENV, external.DEEPGEMM_HC_ENV):
        monkeypatch.setenv(env, "1")
    calls = []
    verdict = {"ok": False}

    def self_check(check, device):
        calls.append(check)
        return (True, "") if verdict["ok"] else (False, f"{check} self-check failed")

    monkeypatch.setattr(external, "_self_check", self_check)
    registry = _nvidia_registry()
    failing = resolve_ops(registry, _ctx())
    assert failing.chosen["sparse_attention"].fn is not external.flash_mla_sparse_attention
    # once per op; the FP8 MoE stops at its first failing check (the masked layout's)
    assert sorted(calls) == ["deep_gemm", "deep_gemm_fp8", "deep_gemm_hc", "deep_gemm_moe_fp8", "flash_mla",
                             "flash_mla_fp8"]

    verdict["ok"] = True
    passing = resolve_ops(registry, _ctx())
    assert {a.op: passing.chosen[a.op].fn for a in external.ADAPTERS} == {a.op: a.fn for a in external.ADAPTERS}

    calls.clear()
    probed = resolve_ops(registry, _ctx(probe_only=True))  # listings: judged on probes, nothing runs
    assert probed.chosen["moe_experts"].fn is external.deep_gemm_moe_experts and calls == []


def test_adapter_declines_widths_it_cannot_take_or_cannot_know(fake_hopper, monkeypatch):
    """No per-call shape test: the model's widths decide at build time (none known: declined)."""
    from deepinfer_nvidia_sm100 import external
    from deepinfer_nvidia_sm100.registration import op_labels

    monkeypatch.setattr(fake_hopper, "library_feature", lambda module, attribute: True)
    monkeypatch.setattr(external, "_self_check", lambda check, device: (True, ""))
    for env in (external.DEEPGEMM_MOE_ENV, external.FLASH_MLA_BF16_ENV, external.DEEPGEMM_HC_ENV):
        monkeypatch.setenv(env, "1")
    registry = _nvidia_registry()
    assert resolve_ops(registry, _ctx()).chosen["linear_fp8"].fn is external.deep_gemm_linear_fp8
    tiny = SimpleNamespace(**{**vars(V4_FLASH), "hidden_size": 64, "num_attention_heads": 8})
    for config in (tiny, None):
        table = resolve_ops(registry, _ctx(model_config=config))
        assert not {table.chosen[a.op].fn for a in external.ADAPTERS} & {a.fn for a in external.ADAPTERS}
    ok, reason = external.ADAPTERS[0].usable(torch.device("cpu"), torch.bfloat16, None, True)
    assert not ok and "widths are unknown" in reason
    # a listing (probes only, no model) shows the adapter as what serves if its self-check passes
    labels = op_labels(registry, _ctx(model_config=None, probe_only=True))
    assert labels["sparse_attention"] == "flash_mla (if its self-check passes, else torch)"
    assert labels["moe_experts"] == "deep_gemm (if its self-check passes, else torch)"


@pytest.mark.parametrize("op, env, fn", [("moe_experts", "DEEPGEMM_MOE_ENV", "deep_gemm_moe_experts"),
                                         ("sparse_attention", "FLASH_MLA_BF16_ENV", "flash_mla_sparse_attention")])
def test_bf16_adapters_slower_than_triton_are_opt_in(op, env, fn, fake_hopper, monkeypatch):
    """Slower than the Triton kernels on an H200 (DeepGEMM's MoE pads every expert to 128 rows; FlashMLA's
    prefill kernel, twice per layer, in prefill and decode): declined, saying so, unless opted in."""
    from deepinfer_nvidia_sm100 import external

    monkeypatch.setattr(fake_hopper, "library_feature", lambda module, attribute: True)
    monkeypatch.setattr(external, "_self_check", lambda check, device: (True, ""))
    monkeypatch.delenv(getattr(external, env), raising=False)
    table = resolve_ops(_nvidia_registry(), _ctx())
    assert table.chosen[op].fn is not getattr(external, fn)
    assert table.chosen["linear_fp8"].fn is external.deep_gemm_linear_fp8
    adapter = next(a for a in external.ADAPTERS if a.fn is getattr(external, fn))
    ok, reason = adapter.usable(torch.device("cpu"), torch.bfloat16, V4_FLASH, True)
    assert not ok and getattr(external, env) in reason
    monkeypatch.setenv(getattr(external, env), "1")
    assert resolve_ops(_nvidia_registry(), _ctx()).chosen[op].fn is getattr(external, fn)


def test_deep_gemm_hc_adapter_is_opt_in_and_takes_only_the_widths_its_kernel_does(fake_hopper, monkeypatch):
    from deepinfer_nvidia_sm100 import external

    monkeypatch.setattr(fake_hopper, "library_feature", lambda module, attribute: True)
    monkeypatch.setattr(fake_hopper, "triton_usable", lambda device=None: (True, ""))
    monkeypatch.setattr(external, "_self_check", lambda check, device: (True, ""))
    adapter = next(a for a in external.ADAPTERS if a.fn is external.deep_gemm_hc_pre)
    v4 = SimpleNamespace(hc_mult=4, hidden_size=4096)
    monkeypatch.delenv(external.DEEPGEMM_HC_ENV, raising=False)
    ok, reason = adapter.usable(torch.device("cpu"), torch.bfloat16, v4, True)
    assert not ok and external.DEEPGEMM_HC_ENV in reason
    monkeypatch.setenv(external.DEEPGEMM_HC_ENV, "1")
    assert adapter.usable(torch.device("cpu"), torch.bfloat16, v4, True) == (True, "")
    for config in (SimpleNamespace(hc_mult=2, hidden_size=4096), SimpleNamespace(hc_mult=4, hidden_size=4001),
                   SimpleNamespace(hc_mult=6, hidden_size=4096)):  # 8 mixes fit; 16004 columns and 48 mixes not
        ok, reason = adapter.usable(torch.device("cpu"), torch.bfloat16, config, True)
        assert ok == (config.hc_mult == 2), reason
    assert not adapter.usable(torch.device("cpu"), torch.float32, v4, True)[0]
    monkeypatch.setattr(fake_hopper, "triton_usable", lambda device=None: (False, "no triton"))
    assert "Triton" in adapter.usable(torch.device("cpu"), torch.bfloat16, v4, True)[1]


def test_self_check_is_cached_per_device():
    from deepinfer_nvidia_sm100 import external

    external._self_check.cache_clear()
    first = external._self_check("flash_mla", "cpu")
    again = external._self_check("flash_mla", "cpu")
    assert first == again and not first[0] and "flash_mla" in first[1]
    assert external._self_check.cache_info().hits == 1


def test_chosen_adapter_calls_its_library_without_a_fallback():
    """Called where the library is missing, an adapter raises: it never serves another implementation."""
    from deepinfer_nvidia_sm100 import external

    q, kv = torch.randn(2, 64, 512).bfloat16(), torch.randn(8, 512).bfloat16()
    idx = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ImportError):
        external.flash_mla_sparse_attention(q, kv, idx, torch.zeros(64), 0.05)


# --- launchers: the predicate declines what they cannot serve --------------------------------------


def test_triton_predicates_decline_dtypes_the_kernels_do_not_take(monkeypatch, nvidia_on_cpu):
    from deepinfer_nvidia_sm100 import capability, registration

    monkeypatch.setattr(capability, "triton_usable", lambda device=None: (True, ""))
    monkeypatch.setenv(registration.FP8_TRITON_ENV, "1")
    registry = _nvidia_registry()
    for dtype, served_by_kernels in ((torch.bfloat16, True), (torch.float32, True), (torch.float64, False)):
        ctx = BuildContext(backend=NVIDIA, dtype=dtype, device=torch.device("cpu"))
        assert registration.triton_applies(ctx) is served_by_kernels
        assert registration.triton_fp8_applies(ctx) is served_by_kernels
        table = resolve_ops(registry, ctx)
        for op in ("rms_norm", "hc_pre", "moe_experts", "linear_fp8"):
            assert (table.chosen[op].fn is native.NATIVE_OPS[op]) is not served_by_kernels, (op, dtype)



def test_listing_says_why_an_adapter_declined(fake_hopper, monkeypatch):
    """`deepinfer ops` prints the adapter's own reason beside "declined by its predicate"."""
    from deepinfer_nvidia_sm100 import external

    monkeypatch.setenv(external.FLASH_MLA_BF16_ENV, "1")

    from deepinfer_core.entrypoints.cli_plugins import resolve_table

    loaded = plugins.load_backend(NVIDIA)
    for config, why in ((None, "widths are unknown"), (V4_FLASH, "not importable")):
        rows = {r["op"]: r for r in resolve_table(loaded, _nvidia_registry(), _ctx(model_config=config))}
        flash = [a for a in rows["sparse_attention"]["alternatives"]
                 if a["function"].endswith(external.flash_mla_sparse_attention.__qualname__)]
        assert len(flash) == 1 and flash[0]["status"] == DECLINED and why in flash[0]["reason"], flash
    assert all("reason" not in a for a in rows["rms_norm"]["alternatives"])  # no reason to give: none printed

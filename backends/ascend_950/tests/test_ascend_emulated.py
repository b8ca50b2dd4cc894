"""The ascend_950 backend's TileLang kernels, executed by the CPU emulator, against cpu_ref.

Under ``DEEPINFER_ASCEND_EMULATE=1`` the backend's TileLang ops serve a CPU engine: the op wrappers of
``tilelang_ops`` run as on an NPU (gathers, padding, chunking, the torch parts around each kernel) and the
kernels' own tile programs run in :mod:`deepinfer_ascend_950.emulator`. The conformance suite's cases
(``tiny`` preset, and the kernels at DeepSeek-V4-Flash widths) check them against cpu_ref. The second half
shows that the emulator catches what a kernel can get wrong: an uncleared accumulator, rows a clamped copy
never loaded, a wrong tile. Neither TileLang's lowering nor the chip is exercised here.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("tilelang", reason="TileLang (with its Ascend backend) is not installed")

from deepinfer_ascend_950 import emulator, npu, registration, tilelang_ops  # noqa: E402

from deepinfer_core.ops.registry import BuildContext, resolve_ops  # noqa: E402
from deepinfer_core.plugins import collect_registry, load_backend  # noqa: E402
from deepinfer_core.testing import conformance as conf  # noqa: E402

BACKEND = "ascend_950"
KERNEL_OPS = sorted(registration.tilelang_kernel_ops())
CASES = [(op, dt) for op in KERNEL_OPS for dt in registration.TILELANG_DTYPES[op]]
#: V4-Flash widths for the kernels (64 heads x 512, indexer 64 x 128, hc_mult 4 over 4096), small pools
WIDE = dict(tokens=3, hidden=4096, heads=64, head_dim=512, rope_dim=64, kv_pool=160, window_pool=48, window=16,
            index_topk=40, index_heads=64, index_dim=128, index_candidates=70)


#: the FP8 GEMMs at 4096 x 4096 (8 heads keep q_b's N at 4096: the emulator runs each 64 x 128 tile)
WIDE_OPS = {"linear_fp8": dict(WIDE, heads=8), "moe_experts_fp8": dict(WIDE, heads=8),
            "moe_experts_fp4": dict(WIDE, tokens=1, moe_inter=2048)}


def _dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@pytest.fixture(scope="module")
def emulated():
    mp = pytest.MonkeyPatch()
    mp.setenv(npu.EMULATE_ENV, "1")
    registry = collect_registry(load_backend(BACKEND, require_available=False))
    tables = {}

    def table(dtype):
        if dtype not in tables:
            ctx = BuildContext(backend=BACKEND, dtype=dtype, device=torch.device("cpu"))
            tables[dtype] = resolve_ops(registry, ctx)
        return tables[dtype]

    yield table
    mp.undo()


@pytest.fixture(scope="module")
def reference():
    return conf.reference_op_table()


#: op -> the kernels its wrapper must have run (a wrapper that fell back to native would pass vacuously)
KERNELS = {"hc_pre": {"hc_split_sinkhorn"}, "sparse_attention": {"sparse_attention_sinks"},
           "compress_windows": {"compress_windows"}, "indexer_topk": {"indexer_scores"}, "hc_post": {"hc_post"},
           "hc_head": {"hc_head_collapse"}, "linear_fp8": {"act_quant_fp8", "fp8_gemm"},
           "moe_experts_fp8": {"act_quant_fp8", "fp8_expert_gemm"},
           "moe_experts_fp4": {"fp4_expert_gemm", "act_quant_sim"}, "act_quant_sim": {"act_quant_sim"},
           "moe_route": {"sqrt_softplus"}, "kv_fp8_pack": {"kv_fp8_quant"},
           "sparse_attention_fp8": {"kv_fp8_dequant", "sparse_attention_sinks"}}


def _conform(op, table, reference, preset, dtype):
    assert table.chosen[op].fn is registration.kernel_ops()[op], f"{op} is not served by its TileLang kernel"
    ran, real = set(), tilelang_ops.compiled

    def spy(name, **params):
        ran.add(name)
        return real(name, **params)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tilelang_ops, "compiled", spy)
        results = conf.check_op(op, table, reference, preset, dtype, backend=BACKEND)
    assert ran == KERNELS[op], f"{op} ran {sorted(ran)}"
    failed = [r for r in results if not r.passed]
    assert results and not failed, "\n\n".join(str(r) for r in failed)


@pytest.mark.parametrize("op,dtype", CASES, ids=[f"{op}-{_dtype_id(dt)}" for op, dt in CASES])
def test_kernel_conforms_at_tiny(emulated, reference, op, dtype):
    _conform(op, emulated(dtype), reference, "tiny", dtype)


@pytest.mark.parametrize("op", [pytest.param(op, marks=pytest.mark.slow) if op in WIDE_OPS else op
                                for op in KERNEL_OPS])
def test_kernel_conforms_at_v4_flash_widths(emulated, reference, op):
    dtype = registration.TILELANG_DTYPES[op][0]
    preset = dataclasses.replace(conf.PRESETS["tiny"], name="wide", **WIDE_OPS.get(op, WIDE))
    _conform(op, emulated(dtype), reference, preset, dtype)


#: a model that routes as DeepSeek-V4 does: the TileLang moe_route serves only such a model
V4_ROUTING = SimpleNamespace(scoring_func="sqrtsoftplus")


@pytest.fixture(scope="module")
def emulated_v4_routing():
    mp = pytest.MonkeyPatch()
    mp.setenv(npu.EMULATE_ENV, "1")
    registry = collect_registry(load_backend(BACKEND, require_available=False))
    yield lambda dtype: resolve_ops(registry, BuildContext(backend=BACKEND, dtype=dtype, device=torch.device("cpu"),
                                                           model_config=V4_ROUTING))
    mp.undo()


@pytest.mark.parametrize("dtype", registration.TILELANG_DTYPES["moe_route"], ids=_dtype_id)
def test_sqrtsoftplus_routing_kernel_conforms_at_tiny(emulated_v4_routing, reference, dtype):
    _conform("moe_route", emulated_v4_routing(dtype), reference, "tiny", dtype)


def test_sqrtsoftplus_routing_kernel_conforms_over_v4_flash_experts(emulated_v4_routing, reference):
    preset = dataclasses.replace(conf.PRESETS["tiny"], name="wide", n_experts=256, top_k=6, route_tokens=20)
    _conform("moe_route", emulated_v4_routing(torch.bfloat16), reference, preset, torch.bfloat16)


def test_routing_kernel_only_for_a_sqrtsoftplus_model(emulated):
    assert emulated(torch.bfloat16).chosen["moe_route"].fn is not tilelang_ops.moe_route
    registration.self_check.cache_clear()
    assert registration.self_check("moe_route", "cpu", torch.bfloat16) == (True, "")


def test_listing_names_the_emulation(emulated):
    registry = collect_registry(load_backend(BACKEND, require_available=False))
    labels = registration.op_labels(registry, BuildContext(backend=BACKEND, dtype=torch.bfloat16,
                                                           device=torch.device("cpu"), probe_only=True))
    assert {labels[op] for op in KERNEL_OPS} == {"tilelang (emulated on the CPU)"}


# --- the emulator catches kernel bugs ---------------------------------------------------------------


def _build(source: str, **params):
    """A kernel from source text (TileLang reads a prim_func's source from its file)."""
    import importlib.util
    import sys
    import tempfile
    from pathlib import Path

    path = Path(tempfile.mkdtemp()) / "kernel_under_test.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"kernel_under_test_{abs(hash(source))}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.build(**params)


ROW_SUM = '''
import tilelang.ascend.language as T

def build(clear: bool, block: int):
    n = T.dynamic("n")

    @T.prim_func
    def row_sum(x: T.Tensor[(n, 16), T.float32], out: T.Tensor[(n,), T.float32]):
        with T.Kernel(T.ceildiv(n, block)) as bx:
            x_ub = T.alloc_shared((block, 16), T.float32)
            acc = T.alloc_shared((block,), T.float32)
            T.copy(x[bx * block, 0], x_ub)
            with T.SimtVF(threads=16):
                if clear:
                    for i in T.Parallel(block):
                        acc[i] = 0.0
                for i, j in T.Parallel(block, 16):
                    x_ub[i, j] = x_ub[i, j] * 2.0
                for j in T.serial(16):
                    for i in T.Parallel(block):
                        acc[i] = acc[i] + x_ub[i, j]
            T.copy(acc, out[bx * block])

    return row_sum
'''


def test_emulator_runs_a_correct_kernel_with_a_partial_last_block():
    x = torch.randn(13, 16)
    out = torch.empty(13)
    emulator.compile(_build(ROW_SUM, clear=True, block=4))(x, out)
    torch.testing.assert_close(out, 2 * x.sum(-1))


def test_emulator_catches_an_uncleared_accumulator():
    out = torch.zeros(8)
    emulator.compile(_build(ROW_SUM, clear=False, block=4))(torch.randn(8, 16), out)
    assert torch.isnan(out).all()  # on-chip memory starts as garbage


def test_emulator_rejects_wrong_arguments():
    kernel = emulator.compile(_build(ROW_SUM, clear=True, block=4))
    with pytest.raises(TypeError, match="float32"):
        kernel(torch.randn(8, 16, dtype=torch.bfloat16), torch.empty(8))
    with pytest.raises(TypeError, match="shape"):
        kernel(torch.randn(8, 15), torch.empty(8))


def test_emulator_drops_stores_past_the_end_and_reads_garbage_there():
    """A partial last block reads NaN past the tensor's end: rows that are never stored must be the only
    ones that see it (the padded rows of the Sinkhorn kernel's last token block are such rows)."""
    from deepinfer_ascend_950.kernels.hc_sinkhorn import hc_split_sinkhorn

    g = torch.Generator().manual_seed(0)
    mixes, scale, base = torch.randn(5, 24, generator=g), torch.rand(3, generator=g), torch.randn(24, generator=g)
    pre, post, comb = torch.zeros(5, 4), torch.zeros(5, 4), torch.zeros(5, 4, 4)
    emulator.compile(hc_split_sinkhorn(hc=4, sinkhorn_iters=3, eps=1e-6, token_block=4))(
        mixes, scale, base, pre, post, comb)
    assert torch.isfinite(comb).all() and torch.isfinite(pre).all()


@pytest.mark.parametrize("op", KERNEL_OPS)
def test_engine_build_self_check_passes_on_the_emulated_kernels(emulated, op):
    """The one-off check an engine build runs on the device (kernel vs native body), run here."""
    registration.self_check.cache_clear()
    assert registration.self_check(op, "cpu", registration.TILELANG_DTYPES[op][0]) == (True, "")

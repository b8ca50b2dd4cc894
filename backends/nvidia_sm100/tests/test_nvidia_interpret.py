"""The nvidia_sm100 backend's code on the CPU: its Triton kernels under Triton's interpreter, the core's
native bodies it registers below them, its registration, adapters, topology parsing and hooks.

``DEEPINFER_NVIDIA_ALLOW_CPU=1`` (a test-only switch) makes the backend available on the CPU; with
``TRITON_INTERPRET=1`` too, its Triton kernels serve there and run in Triton's interpreter. Those tests
are skipped when triton is not installed; everything else here needs neither triton nor a GPU, and the
default run never imports triton (checked in a subprocess below).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from deepinfer_core.ops import native
from deepinfer_core.ops.catalogue import CATALOGUE
from deepinfer_core.ops.registry import BuildContext, OpImpl, OpRegistry, OpTable
from deepinfer_core.plugins import load_backend
from deepinfer_core.testing import conformance as conf

BACKEND = "nvidia_sm100"
PROVIDER = f"deepinfer.backends:{BACKEND}"
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
KERNEL_DTYPES = DTYPES[:3]
TRITON_OPS = ["compress_windows", "hc_collapse", "hc_head", "hc_post", "hc_pre", "indexer_scores", "indexer_topk",
              "moe_experts", "rms_norm", "rotary_emb", "sparse_attention"]
#: Triton kernels serving by default too, tested in their own files (test_nvidia_fp4_moe.py, test_nvidia_fp8_kv.py,
#: gpu/test_gpu_engram.py)
FP4_FP8_KV_OPS = ["moe_experts_fp4", "moe_experts_fp4_quant_act", "moe_experts_quant_act", "moe_experts_act_quant",
                  "sparse_attention_fp8", "engram_lookup"]
REPO = Path(__file__).resolve().parents[3]
NATIVE = "deepinfer_core.ops.native"  # the module of the torch bodies below the kernels

def _triton_installed() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


needs_triton = pytest.mark.skipif(
    not _triton_installed(),
    reason="triton is not installed: the Triton kernels cannot run under TRITON_INTERPRET=1",
)


def _kernel_module(op: str) -> str:
    return "hc_ops" if op.startswith("hc_") else "triton_ops"


def _dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _env(interpret: bool) -> pytest.MonkeyPatch:
    mp = pytest.MonkeyPatch()
    mp.setenv("DEEPINFER_NVIDIA_ALLOW_CPU", "1")
    if interpret:
        mp.setenv("TRITON_INTERPRET", "1")
        mp.setenv("DEEPINFER_NVIDIA_FP8_TRITON", "1")
    else:
        mp.delenv("TRITON_INTERPRET", raising=False)
    return mp


@pytest.fixture(scope="module")
def reference():
    return conf.reference_op_table()


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def torch_only():
    """Op tables per dtype of the backend on the CPU without the interpreter: plain torch serves."""
    mp = _env(interpret=False)
    tables = {}

    def table(dtype):
        if dtype not in tables:
            tables[dtype] = conf.candidate_op_table(BACKEND, dtype, torch.device("cpu"))
        return tables[dtype]

    yield table
    mp.undo()


def _conform(op, table, reference, preset, dtype):
    results = conf.check_op(op, table, reference, preset, dtype, backend=BACKEND)
    assert results and not any(r.fallback for r in results), f"{op} fell back to cpu_ref"
    failed = [r for r in results if not r.passed]
    assert not failed, "\n\n".join(str(r) for r in failed)


# --- Triton kernels under the interpreter ------------------------------------------------------------
#
# Triton decides at import time whether its own @jit library functions (tl.sum, tl.max, ...) are
# interpreted, and other tests of a session may import triton first (torch probes for it): the
# interpreted cases therefore run in one fresh process with TRITON_INTERPRET=1 set from the start,
# and each test below reports its case from there.

#: the real head count and head width (64 x 512, several head and D tiles), indexer 64 x 128; pools
#: and token counts kept small for the interpreter
WIDE = dict(tokens=3, heads=64, head_dim=512, rope_dim=64, kv_pool=96, window_pool=48, window=16, index_topk=40,
            index_heads=64, index_dim=128, index_candidates=70, hidden=256, moe_inter=96, local_experts=5,
            top_k=3, route_tokens=8)
#: 2 * 20 tokens * 4 slots = 160 (token, expert) pairs: the 64-row blocks of the grouped GEMM
BIG_MOE = dict(tokens=20, top_k=4, hidden=64)

_WORKER = textwrap.dedent(
    """
    import dataclasses, json, sys, traceback
    import torch
    from deepinfer_core.testing import conformance as conf

    torch.set_num_threads(1)
    jobs = json.loads(sys.argv[1])
    reference = conf.reference_op_table()
    device = conf.backend_device("nvidia_sm100")
    tables = {}

    def table(dtype):
        if dtype not in tables:
            tables[dtype] = conf.candidate_op_table("nvidia_sm100", getattr(torch, dtype), device)
        return tables[dtype]

    def nan_rows():
        t = table("float32")
        q = torch.randn(2, 64, 512)
        kv = torch.full((40, 512), float("nan"))
        kv[5] = torch.randn(512)
        idx = torch.tensor([[5, -1, -1], [-1, -1, -1]])
        out = t.sparse_attention(q, kv, idx, torch.zeros(64), 512**-0.5, None, None)
        assert not torch.isnan(out).any(), "NaN from an unused row"
        assert torch.equal(out[1], torch.zeros_like(out[1])), "a query without keys is not 0"
        s = (q[0] @ kv[5]) * 512**-0.5  # one key and a sink of logit 0: kv[5] * e^s / (e^s + 1)
        assert torch.allclose(out[0], kv[5] * torch.sigmoid(s).unsqueeze(-1), atol=1e-5)

    def wide_rms_norm():
        x = torch.randn(3, 5000, dtype=torch.bfloat16)
        w = torch.rand(5000) + 0.5
        got = table("bfloat16").rms_norm(x, w, 1e-6).double()
        err = (got - reference.rms_norm(x.double(), w.double(), 1e-6)).abs().max().item()
        assert err < 5e-2, err

    def fp8_rounding():
        # every E4M3 binade (subnormals included) and exact ties: the kernel's rounding must be torch's
        from deepinfer_core.quant.fp8 import dequantize_act_fp8, quantize_act_fp8, quantize_fp8_block
        x = torch.randn(48, 384) * torch.logspace(-9, 3, 48).unsqueeze(1)
        x[5] = 0
        x[6, :8] = torch.tensor([448.0, 1.0625, 1.1875, -3 * 2.0**-10, 5 * 2.0**-10, 0.5, 2.0**-7, 17.0])
        w, s = quantize_fp8_block(torch.eye(384))
        got = table("float32").linear_fp8(x, w, s)
        want = dequantize_act_fp8(*quantize_act_fp8(x))
        err = ((got - want).abs() / want.abs().clamp(min=1e-30)).max().item()
        assert err < 1e-5, err

    def swiglu_quantize():
        # SwiGLU in float32 then quantised, one launch: the reference's E4M3 values, but for the odd one a
        # float32 rounding of the sigmoid moves across a rounding tie (one E4M3 step at most)
        from deepinfer_core.quant.fp8 import dequantize_act_fp8, quantize_act_fp8
        from deepinfer_core.ops import native
        from deepinfer_nvidia_sm100 import fp8_ops
        gu = (torch.randn(37, 2 * 320) * torch.logspace(-3, 1, 37).unsqueeze(1)).bfloat16()
        gu[4] = 0
        gu[5, :3] = 1e4  # past the clamp
        q, s = fp8_ops.swiglu_quantize(gu, 10.0)
        want_q, want_s = quantize_act_fp8(native.swiglu(gu.float(), 10.0))
        assert q.shape == want_q.shape and s.shape == want_s.shape == (37, 3)
        torch.testing.assert_close(s, want_s, rtol=1e-6, atol=0)
        got, want = dequantize_act_fp8(q, s), dequantize_act_fp8(want_q, want_s)
        assert (q.view(torch.uint8) != want_q.view(torch.uint8)).float().mean() < 1e-3
        step = want.abs() / 8 + want_s.repeat_interleave(128, -1)[:, :320] * 2.0**-9
        assert ((got - want).abs() <= step).all()

    def masked_layout():
        # the one-launch layout of the masked MoE against the torch one: ids outside [0, G), a token's
        # repeated expert (its weights summed in slot order), more pairs than one 64-pair block
        from deepinfer_nvidia_sm100 import external, fp8_ops
        g = torch.Generator().manual_seed(1)
        for tokens, k, groups in [(1, 6, 256), (37, 8, 16), (5, 3, 4)]:
            ids = torch.randint(0, groups, (tokens, k), generator=g)
            ids[0, -1], ids[-1, 0] = -1, groups
            weights = torch.rand(tokens, k, generator=g)
            want = external.masked_layout(ids.int(), weights, groups, 128)
            dest, counts, merged, token = fp8_ops.masked_layout(ids.int(), weights, groups, 128)
            assert torch.equal(dest, want[0]) and torch.equal(counts, want[1]), (tokens, k, groups)
            torch.testing.assert_close(merged, want[2], rtol=1e-6, atol=0)
            assert torch.equal(token, torch.arange(tokens * k) // k)

    def quantize_into_slabs():
        # rows quantised straight into slab rows with MN-major scales per slab, bit for bit the reference's
        from deepinfer_core.quant.fp8 import quantize_act_fp8
        from deepinfer_nvidia_sm100 import fp8_ops
        x = torch.randn(10, 300) * 3
        src = torch.arange(30) // 3
        dst = torch.randperm(64)[:30]
        dst[::7] = 64  # past the slabs: skipped
        q = torch.zeros(64, 300, dtype=torch.uint8).view(torch.float8_e4m3fn)
        s = fp8_ops.mn_major_scales(16, 3, x.device, slabs=4).fill_(-1.0)
        fp8_ops.quantize_act_rows(x, src, dst, q, s)
        want_q, want_s = quantize_act_fp8(x)
        keep = dst < 64
        flat = s.reshape(64, 3)
        assert torch.equal(q.view(torch.uint8)[dst[keep]], want_q.view(torch.uint8)[src[keep]])
        assert torch.equal(flat[dst[keep]], want_s[src[keep]])
        assert (flat[~torch.isin(torch.arange(64), dst[keep])] == -1).all()

    def split_attention():
        # the columns split over programs and merged with the sinks: every split count (more splits than
        # column steps, splits of -1 only, ranges across the two lists), 64 x 512 and 16 heads x two
        # value tiles, against the float64 body; a query without keys still gives 0
        from deepinfer_core.ops import native
        from deepinfer_nvidia_sm100 import triton_ops
        g = torch.Generator().manual_seed(3)
        for heads, d in [(64, 512), (16, 512)]:
            q = torch.randn(3, heads, d, generator=g)
            kv, ekv = torch.randn(96, d, generator=g), torch.randn(48, d, generator=g)
            idx = torch.randint(-1, 96, (3, 130), generator=g)
            idx[1, 32:96] = -1
            idx[2] = -1
            eidx = torch.randint(-1, 48, (3, 70), generator=g)
            eidx[2] = -1
            sinks = torch.randn(heads, generator=g)
            want = native.sparse_attention(q.double(), kv.double(), idx, sinks.double(), d**-0.5, ekv.double(), eidx)
            assert torch.equal(want[2], torch.zeros_like(want[2]))
            for splits in (None, 1, 2, 3, 5, 7, 64):
                got = triton_ops.sparse_attention(q, kv, idx, sinks, d**-0.5, ekv, eidx, splits=splits)
                err = (got.double() - want).abs().max().item()
                assert err < 1e-4, (heads, splits, err)
            assert triton_ops.attention_splits(3, 200, 32) == 4 and triton_ops.attention_splits(65, 640, 32) == 1

    def hc_slices():
        # hc_pre / hc_head with each token's collapse over several programs: the same bits as one program a
        # token, and the float64 body's values (1536 channels: three 512-channel slices)
        from deepinfer_core.ops import native
        from deepinfer_nvidia_sm100 import hc_ops
        g = torch.Generator().manual_seed(5)
        n, d = 4, 1536
        for dtype in (torch.float32, torch.bfloat16):
            streams = (torch.randn(3, n, d, generator=g) * 2).to(dtype)
            fn = torch.randn((2 + n) * n, n * d, generator=g) * (n * d) ** -0.5
            base, scale = torch.randn((2 + n) * n, generator=g) * 0.5, 0.5 + torch.rand(3, generator=g)
            args = (streams, fn, base, scale, 20, 1e-6, 1e-6)
            one = hc_ops._collapse(*args, head=False, slices=1)
            for slices in (None, 2, 3, 7):
                got = hc_ops._collapse(*args, head=False, slices=slices)
                assert all(torch.equal(a, b) for a, b in zip(got, one)), (dtype, slices)
                head = hc_ops._collapse(*args, head=True, slices=slices)[2]
                assert torch.equal(head, hc_ops._collapse(*args, head=True, slices=1)[2])
            want = native.hc_pre(streams.double(), fn.double(), base.double(), scale.double(), 20, 1e-6, 1e-6)
            tol = 1e-4 if dtype == torch.float32 else 5e-2
            for a, b in zip(one, want):
                assert (a.double() - b).abs().max() < tol, dtype

    def select_topk():
        # one sort in registers against the core's stable selection: ties (many equal scores, 0.0 and
        # -0.0), -inf scores and invalid candidates, NaN, widths up to the kernel's limit, topk above
        # and below the width
        from deepinfer_core.ops import native
        from deepinfer_nvidia_sm100 import triton_ops
        g = torch.Generator().manual_seed(7)
        for width, topk in [(1, 4), (37, 512), (64, 16), (1000, 512), (2048, 512), (2049, 512)]:
            scores = torch.randint(-3, 4, (3, width), generator=g).float() * 0.5
            scores[0] = torch.randn(width, generator=g)
            scores[1, ::5] = -0.0
            cand = torch.randint(-1, 900, (3, width), generator=g)
            cand[2, : width // 2] = -1
            scores[cand < 0] = float("-inf")
            scores[2, width // 3] = float("nan")
            got = triton_ops.select_topk(scores, cand, 800, topk)
            want = native.select_topk(scores, (cand >= 0) & (cand < 800), cand, topk)
            assert torch.equal(got, want), (width, topk)

    checks = {"select_topk": select_topk, "hc_slices": hc_slices, "split_attention": split_attention,
              "nan_rows": nan_rows, "wide_rms_norm": wide_rms_norm, "fp8_rounding": fp8_rounding,
              "swiglu_quantize": swiglu_quantize, "masked_layout": masked_layout,
              "quantize_into_slabs": quantize_into_slabs}
    out = {"__device__": str(device)}
    for key, job in jobs.items():
        try:
            if job["check"]:
                checks[job["check"]]()
                out[key] = {"ok": True, "message": "", "module": ""}
                continue
            t = table(job["dtype"])
            preset = dataclasses.replace(conf.PRESETS["tiny"], name=job["name"], **job["overrides"])
            results = conf.check_op(job["op"], t, reference, preset, getattr(torch, job["dtype"]),
                                    backend="nvidia_sm100")
            bad = [str(r) for r in results if not r.passed]
            bad += [f"{r.op}[{r.case}] fell back to cpu_ref" for r in results if r.fallback]
            out[key] = {"ok": bool(results) and not bad, "message": "\\n\\n".join(bad),
                        "module": t.chosen[job["op"]].fn.__module__, "provider": t.provider(job["op"]),
                        "name": t.chosen[job["op"]].fn.__name__}
        except Exception:
            out[key] = {"ok": False, "message": traceback.format_exc(), "module": ""}
    print("RESULTS " + json.dumps(out))
    """
)


def _job(op=None, dtype=None, name="tiny", overrides=None, check=None) -> dict:
    return {"op": op, "dtype": dtype, "name": name, "overrides": overrides or {}, "check": check}


JOBS = {f"tiny/{op}/{_dtype_id(dt)}": _job(op, _dtype_id(dt)) for op in sorted(CATALOGUE) for dt in DTYPES}
JOBS.update({f"wide/{op}/{d}": _job(op, d, "wide", WIDE) for op in TRITON_OPS for d in ("bfloat16", "float32")})
JOBS["big_moe"] = _job("moe_experts", "bfloat16", "big_moe", BIG_MOE)
JOBS["nan_rows"] = _job(check="nan_rows")
JOBS["split_attention"] = _job(check="split_attention")
JOBS["hc_slices"] = _job(check="hc_slices")
JOBS["select_topk"] = _job(check="select_topk")
JOBS["wide_rms_norm"] = _job(check="wide_rms_norm")
#: the block-FP8 ops (``fp8_ops``: a Triton launcher and a torch stand-in each). Triton 3.6's interpreter
#: gets E4M3 dots and float-to-E4M3 rounding wrong, so there the kernels multiply the same exact E4M3
#: values in float32 (``FP8_DOT`` off); their quantisation is checked bit for bit (``fp8_rounding``)
FP8_OPS = ["linear_fp8", "moe_experts_fp8"]
#: several 128-channel groups with a partial last one, 160 (token, expert) pairs: the 64-row MoE blocks
FP8_WIDE = dict(tokens=20, top_k=4, hidden=384, q_lora=320, moe_inter=256, local_experts=5)
JOBS.update({f"wide/{op}/{d}": _job(op, d, "fp8_wide", FP8_WIDE) for op in FP8_OPS for d in ("bfloat16", "float32")})
JOBS["fp8_rounding"] = _job(check="fp8_rounding")
JOBS["swiglu_quantize"] = _job(check="swiglu_quantize")
JOBS["masked_layout"] = _job(check="masked_layout")
JOBS["quantize_into_slabs"] = _job(check="quantize_into_slabs")


@pytest.fixture(scope="module")
def interpreted() -> dict:
    """Results of every interpreted job, from one fresh process."""
    env = {**os.environ, "DEEPINFER_NVIDIA_ALLOW_CPU": "1", "TRITON_INTERPRET": "1", "DEEPINFER_NVIDIA_FP8_TRITON": "1"}
    done = subprocess.run([sys.executable, "-c", _WORKER, json.dumps(JOBS)], capture_output=True, text=True,
                          env=env, timeout=1800)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULTS ")), None)
    assert done.returncode == 0 and line, f"the interpreter run failed:\n{done.stderr[-4000:]}"
    results = json.loads(line[len("RESULTS ") :])
    assert results["__device__"] == "cpu"
    return results


def _report(results: dict, key: str) -> dict:
    result = results[key]
    assert result["ok"], f"{key}:\n{result['message']}"
    return result


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("op", sorted(CATALOGUE))
def test_interpreted_op_matches_cpu_ref(op, dtype, interpreted):
    result = _report(interpreted, f"tiny/{op}/{_dtype_id(dtype)}")
    assert result["provider"] == PROVIDER
    if op in TRITON_OPS and dtype in KERNEL_DTYPES:
        assert result["module"] == f"deepinfer_nvidia_sm100.{_kernel_module(op)}", op
    if op == "moe_route" and dtype in KERNEL_DTYPES:  # the batch-invariant kernel serves by default too
        assert result["module"] == "deepinfer_nvidia_sm100.invariant_ops", op
    if op in FP8_OPS:
        assert result["module"] == ("deepinfer_nvidia_sm100.fp8_ops" if dtype in KERNEL_DTYPES else NATIVE), op
        assert result["name"] == op, op


@needs_triton
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("op", TRITON_OPS)
def test_interpreted_kernels_at_real_widths(op, dtype, interpreted):
    assert _report(interpreted, f"wide/{op}/{dtype}")["module"] == f"deepinfer_nvidia_sm100.{_kernel_module(op)}"


@needs_triton
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("op", FP8_OPS)
def test_interpreted_fp8_kernels_over_several_groups(op, dtype, interpreted):
    assert _report(interpreted, f"wide/{op}/{dtype}")["name"] == op


@needs_triton
def test_interpreted_fp8_quantisation_rounds_like_torch(interpreted):
    _report(interpreted, "fp8_rounding")


@needs_triton
def test_interpreted_swiglu_quantisation_matches_torch(interpreted):
    _report(interpreted, "swiglu_quantize")


@needs_triton
def test_interpreted_masked_moe_layout_matches_torch(interpreted):
    _report(interpreted, "masked_layout")


@needs_triton
def test_interpreted_quantisation_into_slab_rows(interpreted):
    _report(interpreted, "quantize_into_slabs")


@needs_triton
def test_interpreted_moe_with_many_pairs_and_rms_norm_beyond_one_block(interpreted):
    _report(interpreted, "big_moe")
    _report(interpreted, "wide_rms_norm")


@needs_triton
def test_interpreted_sparse_attention_never_reads_nan_rows(interpreted):
    _report(interpreted, "nan_rows")


@needs_triton
def test_interpreted_select_topk_is_the_stable_selection(interpreted):
    _report(interpreted, "select_topk")


@needs_triton
def test_interpreted_hc_pre_split_over_channels_keeps_its_bits(interpreted):
    _report(interpreted, "hc_slices")


@needs_triton
def test_interpreted_split_sparse_attention_matches_cpu_ref(interpreted):
    _report(interpreted, "split_attention")


# --- the native torch bodies below the kernels (no triton needed) -------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("op", sorted(CATALOGUE))
def test_torch_op_matches_cpu_ref(op, dtype, torch_only, reference, one_thread):
    table = torch_only(dtype)
    assert table.chosen[op].fn.__module__ == NATIVE, op
    _conform(op, table, reference, "tiny", dtype)


# --- registration, availability, hooks ---------------------------------------------------------------


def _registry_for(name: str) -> OpRegistry:
    from deepinfer_nvidia_sm100 import plugin

    from deepinfer_core.hookspecs import BackendInfo

    registry = OpRegistry()
    plugin.deepinfer_register_ops(registry=registry, backend=BackendInfo(name=name, device_type="x"))
    return registry


def test_ops_are_registered_only_for_this_backend():
    assert _registry_for("cpu_ref").impls == {}
    from deepinfer_nvidia_sm100 import invariant_ops
    from deepinfer_nvidia_sm100.registration import INVARIANT

    registry = _registry_for(BACKEND)
    assert set(registry.impls) == set(CATALOGUE)
    # batch-invariant mode's implementations apart, at INVARIANT, declared invariant
    invariant = {op: [i for i in impls if i.priority == INVARIANT] for op, impls in registry.impls.items()}
    assert {op for op, impls in invariant.items() if impls} == set(invariant_ops.ALL_OPS)
    assert all(i.batch_invariant and i.fn is invariant_ops.ALL_OPS[i.op] for impls in invariant.values() for i in impls)
    default = {op: [i for i in impls if i.priority != INVARIANT] for op, impls in registry.impls.items()}
    for op, impls in default.items():
        priorities = sorted(i.priority for i in impls)
        assert priorities[0] == 1 and max(priorities) <= 3, op  # a kernel pack at 10 overrides them
    assert INVARIANT < 10
    assert {op for op, impls in default.items() if len(impls) > 1} == {*TRITON_OPS, *FP8_OPS, *FP4_FP8_KV_OPS,
                                                                       *invariant_ops.DEFAULT_OPS}


def test_cpu_switch_controls_availability_and_device(monkeypatch):
    from deepinfer_nvidia_sm100 import plugin

    monkeypatch.delenv("DEEPINFER_NVIDIA_ALLOW_CPU", raising=False)
    if not torch.cuda.is_available():
        assert plugin.is_available()[0] is False
        assert plugin.details()["ops"].startswith("not resolved")
    monkeypatch.setenv("DEEPINFER_NVIDIA_ALLOW_CPU", "1")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert plugin.is_available() == (True, "")
    assert plugin.deepinfer_init_device(local_rank=0) == torch.device("cpu")
    details = plugin.details()
    assert {f"op.{op}" for op in CATALOGUE} <= set(details)
    assert set(details[f"op.{op}"] for op in CATALOGUE) == {"torch"}
    comm = plugin.deepinfer_make_communicator(group=None, device=torch.device("cpu"))
    assert (comm.rank, comm.world_size) == (0, 1)
    topo = plugin.deepinfer_discover_topology()
    assert topo.num_devices >= 1
    assert plugin.deepinfer_plan_parallel(topology=topo, parallel_config=None).device_of_rank == {0: 0}


def test_default_run_never_imports_triton(tmp_path):
    """Registering and resolving every op (CPU switch on, no interpreter) leaves triton unimported,
    even where importing it would fail."""
    (tmp_path / "triton.py").write_text("raise RuntimeError('triton imported')\n")
    code = textwrap.dedent(
        """
        import os, sys
        os.environ["DEEPINFER_NVIDIA_ALLOW_CPU"] = "1"
        os.environ.pop("TRITON_INTERPRET", None)
        import torch
        from deepinfer_core.plugins import build_op_table, load_backend
        table = build_op_table("nvidia_sm100", dtype=torch.bfloat16, device=torch.device("cpu"))
        info = load_backend("nvidia_sm100").info
        print(info.details()["op.sparse_attention"], info.details()["triton"])
        x = torch.randn(2, 8)
        table.rms_norm(x, None, 1e-6)
        assert "triton" not in sys.modules, "triton was imported"
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[0] == "torch" and "triton imported" in done.stdout


def plan(device, dtype):
    """op -> the implementation (``torch``, ``triton``, a library) the core's resolution picks."""
    from deepinfer_nvidia_sm100.registration import op_labels

    return op_labels(_registry_for(BACKEND), BuildContext(backend=BACKEND, dtype=dtype, device=device))


def test_plan_prefers_kernels_where_they_run(monkeypatch):
    from deepinfer_nvidia_sm100 import capability

    monkeypatch.setenv("DEEPINFER_NVIDIA_ALLOW_CPU", "1")
    monkeypatch.setattr(capability, "triton_usable", lambda device=None: (True, ""))
    for env in ("DEEPINFER_NVIDIA_FP8_TRITON", "DEEPINFER_NVIDIA_FP4_TRITON", "DEEPINFER_NVIDIA_FP8_KV_TRITON"):
        monkeypatch.delenv(env, raising=False)
    default = set(TRITON_OPS) | set(FP4_FP8_KV_OPS) | set(FP8_OPS) | {"moe_route"}  # the routing kernel too
    chosen = plan(torch.device("cpu"), torch.bfloat16)
    assert {op for op, impl in chosen.items() if impl == "triton"} == default
    monkeypatch.setenv("DEEPINFER_NVIDIA_FP8_TRITON", "0")  # the FP8 GEMM and MoE to the torch bodies
    chosen = plan(torch.device("cpu"), torch.bfloat16)
    assert {op for op, impl in chosen.items() if impl == "triton"} == default - set(FP8_OPS)
    assert set(plan(torch.device("cpu"), torch.float64).values()) == {"torch"}


# --- optional library adapters, run against stand-ins of the libraries -----------------------------


def _fake_sparse_fwd(q, kv, indices, sm_scale, d_v):
    """FlashMLA's documented semantics: (out, max_logits, lse) over the valid indices; lse = +inf and
    out = 0 for a query with no valid index."""
    idx = indices[:, 0].long()
    valid = (idx >= 0) & (idx < kv.shape[0])
    keys = kv[:, 0][idx.clamp(min=0)].float().masked_fill(~valid.unsqueeze(-1), 0)  # never read
    logits = torch.einsum("thd,tkd->thk", q.float(), keys) * sm_scale
    logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(logits, -1)
    lonely = torch.isneginf(lse)
    p = torch.exp(logits - lse.masked_fill(lonely, 0).unsqueeze(-1)).masked_fill(lonely.unsqueeze(-1), 0)
    out = torch.einsum("thk,tkd->thd", p, keys[..., :d_v])
    return out.to(q.dtype), logits.amax(-1), lse.masked_fill(lonely, float("inf"))


def test_flash_mla_adapter_merges_pools_and_sink():
    from deepinfer_nvidia_sm100 import external

    wide = dataclasses.replace(conf.PRESETS["tiny"], name="wide", **WIDE)
    for case in conf.make_cases("sparse_attention", wide, torch.float32):
        q, kv, idx, sinks, scale, ekv, eidx = case.args
        got = external.flash_mla_attention_with(_fake_sparse_fwd, q, kv, idx, sinks, scale, ekv, eidx)
        want = native.sparse_attention(q.double(), kv.double(), idx, sinks.double(), scale,
                                       None if ekv is None else ekv.double(), eidx)
        assert not torch.isnan(got).any()
        assert (got.double() - want).abs().max() < 1e-4, case.name


class _FakeFlashMLA:
    """FlashMLA's sparse decode on FP8 entries: the pages decoded, then the core's sparse_attention; its
    layout demands checked (one-token pages at a 16-byte-aligned stride, int32 indices padded to 64)."""

    def __init__(self, rope_dim: int, rope_dtype: torch.dtype):
        self.rope_dim, self.rope_dtype, self.calls = rope_dim, rope_dtype, 0

    @staticmethod
    def get_mla_metadata():
        return object(), None

    def flash_mla_with_kvcache(self, q, k_cache, block_table, cache_seqlens, head_dim_v, meta, num_splits,
                               softmax_scale=None, causal=False, is_fp8_kvcache=False, indices=None, attn_sink=None,
                               extra_k_cache=None, extra_indices_in_kvcache=None):
        from deepinfer_core.quant.kv_fp8 import unpack_kv_fp8

        self.calls += 1
        b, s_q, h, d = q.shape
        assert s_q == 1 and is_fp8_kvcache and not causal and block_table is None and cache_seqlens is None
        assert attn_sink.dtype == torch.float32 and meta is not None and num_splits is None

        def pool(cache, idx):
            assert cache.dim() == 4 and cache.shape[1:3] == (1, 1) and cache.stride(0) % 16 == 0
            assert idx.dtype == torch.int32 and idx.shape[:2] == (b, 1) and idx.shape[-1] % 64 == 0
            rows = unpack_kv_fp8(cache.view(cache.shape[0], -1), d, self.rope_dim, self.rope_dtype, torch.float64)
            return rows, idx.view(b, -1).long()

        kv, idx = pool(k_cache, indices)
        ekv = eidx = None
        if extra_k_cache is not None:
            ekv, eidx = pool(extra_k_cache, extra_indices_in_kvcache)
        out = native.sparse_attention(q.view(b, h, d).double(), kv, idx, attn_sink.double(), softmax_scale, ekv, eidx)
        return out.to(q.dtype).view(b, 1, h, d), None


def test_flash_mla_fp8_decode_adapter_matches_the_reference():
    from deepinfer_nvidia_sm100 import external

    wide = dataclasses.replace(conf.PRESETS["tiny"], name="wide", **WIDE)
    cases = conf.make_cases("sparse_attention_fp8", wide, torch.bfloat16)
    assert cases
    for case in cases:
        q, kv, idx, sinks, scale, rope_dim, rope_dtype, ekv, eidx = case.args
        fake = _FakeFlashMLA(rope_dim, rope_dtype)
        got = external.flash_mla_fp8_attention_with(fake, q, kv, idx, sinks, scale, ekv, eidx)
        want = native.sparse_attention_fp8(q.double(), kv, idx, sinks.double(), scale, rope_dim, rope_dtype, ekv, eidx)
        assert fake.calls == 1 and got.dtype == q.dtype and not torch.isnan(got).any(), case.name
        assert (got.double() - want).abs().max() < 2e-2, case.name  # bfloat16 output


def test_flash_mla_fp8_adapter_serves_decode_sizes_and_leaves_the_rest_to_triton(monkeypatch):
    from deepinfer_nvidia_sm100 import external, triton_ops

    args = external._attention_fp8_check_inputs(torch.device("cpu"))
    fake, triton_calls = _FakeFlashMLA(*external.FLASH_MLA_ROPE), []
    monkeypatch.setattr(external, "_library", lambda name: fake)
    monkeypatch.setattr(triton_ops, "sparse_attention_fp8", lambda *a: triton_calls.append(a[0].shape[0]))
    got = external.flash_mla_sparse_attention_fp8(*args)
    want = native.sparse_attention_fp8(args[0].double(), *args[1:3], args[3].double(), *args[4:])
    assert fake.calls == 1 and (got.double() - want).abs().max() < 2e-2
    many = args[0].repeat(external.FLASH_MLA_DECODE_MAX_TOKENS, 1, 1)[: external.FLASH_MLA_DECODE_MAX_TOKENS + 1]
    external.flash_mla_sparse_attention_fp8(many, args[1], args[2][:1].expand(len(many), -1), *args[3:7],
                                            args[7], args[8][:1].expand(len(many), -1))
    external.flash_mla_sparse_attention_fp8(args[0].float(), *args[1:])  # not bfloat16
    assert triton_calls == [external.FLASH_MLA_DECODE_MAX_TOKENS + 1, args[0].shape[0]] and fake.calls == 1
    none = external.flash_mla_sparse_attention_fp8(args[0][:0], args[1], args[2][:0], *args[3:8], args[8][:0])
    assert none.shape == (0, *args[0].shape[1:]) and fake.calls == 1 and len(triton_calls) == 2


def _fake_grouped_gemm(a, b, d, m_indices):
    """DeepGEMM's contiguous grouped GEMM: d[r] = a[r] @ b[m_indices[r]].T; rows with -1 are padding."""
    for r in range(a.shape[0]):
        g = int(m_indices[r])
        if g >= 0:
            d[r] = (a[r].float() @ b[g].float().T).to(d.dtype)


def test_deep_gemm_adapter_matches_the_reference():
    from deepinfer_nvidia_sm100 import external

    for case in conf.make_cases("moe_experts", "tiny", torch.float32):
        x, w13, w2, ids, weights, limit = case.args
        got = external.deep_gemm_moe_with(_fake_grouped_gemm, 8, x, w13, w2, ids, weights, limit)
        want = native.moe_experts(x.double(), w13.double(), w2.double(), ids, weights.double(), limit)
        assert (got.double() - want).abs().max() < 1e-4


def _fake_fp8_gemm(a, b, d, m_indices=None):
    """DeepGEMM's block-FP8 GEMMs: d[r] = (a[r] dequantised) @ (b or b[m_indices[r]] dequantised).T; rows
    with m_index -1 are padding."""
    from deepinfer_core.quant.fp8 import dequantize_act_fp8, dequantize_fp8_block

    x = dequantize_act_fp8(*a, dtype=torch.float64)
    for r in range(x.shape[0]):
        g = None if m_indices is None else int(m_indices[r])
        if g is None or g >= 0:
            w = dequantize_fp8_block(*(b if g is None else (b[0][g], b[1][g])), dtype=torch.float64)
            d[r] = (x[r] @ w.T).to(d.dtype)


def _fake_hc_prenorm_gemm(a, b, d, sqr_sum, num_splits=None):
    """DeepGEMM's ``tf32_hc_prenorm_gemm``: d = a . b^T and sqr_sum = the rows' squared sums, or with
    ``num_splits`` each over its share of K (the caller sums the parts); float64 here."""
    assert a.dtype == torch.bfloat16 and b.dtype == torch.float32 and a.is_contiguous() and b.is_contiguous()
    parts = 1 if num_splits is None else num_splits
    assert a.shape[1] % (64 * parts) == 0 and (num_splits is None) == (d.dim() == 2)
    for i, (x, w) in enumerate(zip(a.double().chunk(parts, dim=1), b.double().chunk(parts, dim=1))):
        (d if num_splits is None else d[i]).copy_(x @ w.T)
        (sqr_sum if num_splits is None else sqr_sum[i]).copy_(x.square().sum(-1))


@pytest.mark.parametrize("m", [1, 7, 64, 300, 4096])
def test_deep_gemm_hc_mixing_gemm_splits_k_for_few_rows(m):
    """At V4-Flash's mHC widths (4 streams x 4096, 24 mixes): the float32 mixes a . fn^T, split along K
    into as many parts as fill an H200's SMs when the rows are few, summed."""
    from deepinfer_nvidia_sm100 import external

    g = torch.Generator().manual_seed(m)
    a = torch.randn(m, 4 * 4096, generator=g).bfloat16()
    fn = torch.randn(24, 4 * 4096, generator=g) * 0.01
    splits = external._hc_splits(m, a.shape[1])
    assert splits == {1: 64, 7: 64, 64: 64, 300: 16, 4096: 2}[m]  # 256 K-tiles: a divisor of them
    got = external.deep_gemm_hc_mixes_with(_fake_hc_prenorm_gemm, a, fn)
    assert got.dtype == torch.float32 and got.shape == (m, 24)
    torch.testing.assert_close(got.double(), a.double() @ fn.double().T, rtol=1e-5, atol=1e-5)


def _write_rows(q, s, rows, hq, hs):
    """Rows ``rows`` of E4M3 ``q`` [R, K] and of scales ``s`` ([R, G], or [slabs, M, G] whose row r is row
    r % M of slab r // M), of any strides, in torch ops."""
    q.view(torch.uint8)[rows] = hq.view(torch.uint8)
    if s.dim() == 2:
        s[rows] = hs
    else:
        s[rows // s.shape[1], rows % s.shape[1]] = hs


def test_deep_gemm_fp8_adapters_quantise_with_the_triton_kernel_on_a_gpu(monkeypatch):
    """Where the backend's Triton kernels run (a CUDA device), DeepGEMM's operands are quantised by the
    one-launch kernels straight into the GEMMs' layouts (MN-major scales, the rows of each expert's slab),
    not by the torch function and copies; elsewhere (here) by the torch function. Both give the same
    results, the kernels stood in for by torch ops that honour the layouts they are given."""
    from deepinfer_nvidia_sm100 import external, fp8_ops

    from deepinfer_core.quant.fp8 import quantize_act_fp8

    case = conf.make_cases("linear_fp8", "tiny", torch.bfloat16)[0]
    moe = conf.make_cases("moe_experts_fp8", "tiny", torch.bfloat16)[0]
    assert not external._triton_quantises(case.args[0].device)
    calls, swiglus, combines = [], [], []

    def laid_out(q, s, mn_major):
        if not mn_major:
            return q, s
        t = fp8_ops.mn_major_scales(*s.shape, s.device)
        assert t.stride(0) == 1 and t.stride(1) % 4 == 0
        return q, t.copy_(s)

    def quantize(x2, mn_major=False):
        calls.append(x2.shape)
        return laid_out(*quantize_act_fp8(x2), mn_major)

    def quantize_rows(x2, src, dst, q, s):
        calls.append(src.shape)
        keep = dst < len(q)
        _write_rows(q, s, dst[keep], *quantize_act_fp8(x2[src[keep]]))

    def swiglu(gu, limit, mn_major=False):
        swiglus.append(gu.shape)
        return laid_out(*quantize_act_fp8(native.swiglu(gu.float(), limit)), mn_major)

    def swiglu_rows(gu, limit, rows, q, s):
        swiglus.append(rows.shape)
        keep = rows[rows < len(gu)]
        _write_rows(q, s, keep, *quantize_act_fp8(native.swiglu(gu[keep].float(), limit)))

    monkeypatch.setattr(fp8_ops, "quantize_act", quantize)
    external.deep_gemm_linear_fp8_with(_fake_fp8_gemm, *case.args)
    assert calls == []
    runs = {
        "linear": lambda: external.deep_gemm_linear_fp8_with(_fake_fp8_gemm, *case.args),
        "masked": lambda: external.deep_gemm_moe_fp8_masked_with(_fake_masked_fp8_gemm, *moe.args),
        "contiguous": lambda: external.deep_gemm_moe_fp8_with(_fake_fp8_gemm, 8, *moe.args),
    }
    want = {name: run() for name, run in runs.items()}
    def layout(ids, weights, groups, max_m):
        return (*external.masked_layout(ids, weights, groups, max_m), torch.arange(ids.numel()) // ids.shape[-1])

    for name, fn in [("quantize_act_rows", quantize_rows), ("swiglu_quantize", swiglu),
                     ("swiglu_quantize_rows", swiglu_rows), ("masked_layout", layout)]:
        monkeypatch.setattr(fp8_ops, name, fn)
    monkeypatch.setattr(fp8_ops, "combine_rows", lambda *a: combines.append(a[3]) or external.combine_rows_torch(*a))
    monkeypatch.setattr(external, "_triton_quantises", lambda device: True)
    got = {name: run() for name, run in runs.items()}
    assert len(calls) == 3  # the linear's activations, then each MoE's, quantised into its layout
    assert len(swiglus) == 2 and len(combines) == 2  # each MoE's h, and its sum per token: one launch each
    for name in runs:
        assert torch.equal(got[name], want[name]), name


def test_deep_gemm_fp8_adapters_match_the_reference(reference):
    from deepinfer_nvidia_sm100 import external

    for case in conf.make_cases("linear_fp8", "tiny", torch.bfloat16):
        x, w, s = case.args
        got = external.deep_gemm_linear_fp8_with(_fake_fp8_gemm, x, w, s)
        assert got.dtype == x.dtype and got.shape == (*x.shape[:-1], w.shape[0])
        conf.assert_close(got, reference.linear_fp8(x.double(), w, s), dtype=torch.bfloat16, name=case.name)
    for case in conf.make_cases("moe_experts_fp8", "tiny", torch.bfloat16):
        got = external.deep_gemm_moe_fp8_with(_fake_fp8_gemm, 8, *case.args)
        args64 = [a.double() if isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 else a for a in case.args]
        want = reference.moe_experts_fp8(*args64)
        # the library rounds gate/up and the down output to bfloat16 (outputs here reach ~1600): judged
        # against the output's scale
        assert (got.double() - want).abs().max() <= 0.02 * want.abs().max(), case.name
        assert torch.nn.functional.cosine_similarity(got.double().flatten(), want.flatten(), dim=0) > 0.9999


def _fake_masked_fp8_gemm(a, b, d, masked_m, expected_m, disable_ue8m0_cast=False):
    """DeepGEMM's masked grouped FP8 GEMM: d[g, :masked_m[g]] = a[g, :masked_m[g]] @ b[g].T (dequantised);
    the rows past ``masked_m[g]`` are not computed (NaN here, so that nothing may read them)."""
    from deepinfer_core.quant.fp8 import dequantize_act_fp8, dequantize_fp8_block

    assert masked_m.dtype == torch.int32 and expected_m >= 1 and a[0].dim() == 3 and a[1].dim() == 3
    assert a[0].shape[1] % 128 == 0 and d.shape[1] == a[0].shape[1]  # whole tiles of up to 128 rows per slab
    for g in range(a[0].shape[0]):
        m = int(masked_m[g])
        d[g, m:] = float("nan")
        if m:
            x = dequantize_act_fp8(a[0][g, :m], a[1][g, :m], dtype=torch.float64)
            d[g, :m] = (x @ dequantize_fp8_block(b[0][g], b[1][g], dtype=torch.float64).T).to(d.dtype)


def test_deep_gemm_masked_fp8_moe_matches_the_reference(reference):
    from deepinfer_nvidia_sm100 import external

    for case in conf.make_cases("moe_experts_fp8", "tiny", torch.bfloat16):
        got = external.deep_gemm_moe_fp8_masked_with(_fake_masked_fp8_gemm, *case.args)
        args64 = [a.double() if isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 else a for a in case.args]
        want = reference.moe_experts_fp8(*args64)
        assert not torch.isnan(got).any(), case.name
        assert (got.double() - want).abs().max() <= 0.02 * want.abs().max(), case.name
        assert torch.nn.functional.cosine_similarity(got.double().flatten(), want.flatten(), dim=0) > 0.9999


def test_masked_layout_gives_each_routed_pair_its_own_row_of_its_experts_slab():
    from deepinfer_nvidia_sm100.external import masked_layout

    g = torch.Generator().manual_seed(0)
    tokens, k, groups = 13, 4, 6
    ids = torch.stack([torch.randperm(groups + 2, generator=g)[:k] for _ in range(tokens)]) - 1  # -1 and 6: not local
    weights = torch.rand(tokens, k, generator=g)
    dest, masked_m, merged = masked_layout(ids, weights, groups, tokens)
    flat = ids.reshape(-1)
    local = (flat >= 0) & (flat < groups)
    assert masked_m.dtype == torch.int32
    assert masked_m.tolist() == [int((flat == e).sum()) for e in range(groups)]
    assert (dest[~local] == groups * tokens).all() and torch.equal(merged, weights.reshape(-1))
    kept = dest[local]
    assert len(set(kept.tolist())) == len(kept)  # no two pairs share a row
    assert ((kept // tokens) == flat[local]).all()  # in their expert's slab
    for e in range(groups):  # its first masked_m rows, in the pairs' order
        assert (dest[flat == e] % tokens).tolist() == list(range(int(masked_m[e])))


def test_masked_layout_computes_a_tokens_repeated_expert_once_with_the_weights_summed():
    from deepinfer_nvidia_sm100.external import masked_layout

    tokens, groups = 3, 4
    ids = torch.tensor([[2, 2, 2], [1, 3, 1], [0, 1, 2]])  # 4 pairs on expert 2, more than the 3 tokens
    weights = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [0.7, 0.8, 0.9]])
    dest, masked_m, merged = masked_layout(ids, weights, groups, tokens)
    assert masked_m.tolist() == [1, 2, 2, 1]  # at most `tokens` rows per expert
    trash = groups * tokens
    assert dest.view(tokens, 3)[:, 1:].tolist()[0] == [trash, trash] and int(dest.view(tokens, 3)[1, 2]) == trash
    assert torch.allclose(merged.view(tokens, 3), torch.tensor([[0.6, 0, 0], [1.0, 0.5, 0], [0.7, 0.8, 0.9]]))


def test_deep_gemm_masked_fp8_moe_with_repeated_experts_matches_the_reference(reference):
    from deepinfer_nvidia_sm100 import external

    x, w13, s13, w2, s2, ids, weights, limit = external._moe_fp8_check_inputs(torch.device("cpu"))
    ids = ids.clone()
    ids[4] = ids[4, 0]  # one expert three times
    ids[5, 1] = ids[5, 2]
    got = external.deep_gemm_moe_fp8_masked_with(_fake_masked_fp8_gemm, x, w13, s13, w2, s2, ids, weights, limit)
    want = reference.moe_experts_fp8(x.double(), w13, s13, w2, s2, ids, weights.double(), limit)
    assert (got.double() - want).abs().max() <= 0.02 * want.abs().max()


@pytest.mark.parametrize("contiguous", [False, True, None], ids=["triton-above", "contiguous-above", "by-rows"])
def test_deep_gemm_fp8_moe_takes_the_masked_layout_for_decode_sizes(monkeypatch, reference, contiguous):
    """Up to MASKED_MAX_TOKENS tokens the masked GEMM; above, the Triton FP8 MoE or DeepGEMM's contiguous
    GEMM: forced off or on, or (unset) the contiguous one where the experts average CONTIGUOUS_MIN_ROWS rows
    (4 experts, 3 slots: from 86 tokens) and it passed its self-check."""
    from types import SimpleNamespace

    from deepinfer_nvidia_sm100 import external, fp8_ops

    calls = []
    masked = lambda *a, **kw: calls.append("masked") or _fake_masked_fp8_gemm(*a, **kw)  # noqa: E731
    contiguous_gemm = lambda *a: calls.append("contiguous") or _fake_fp8_gemm(*a)  # noqa: E731
    triton = lambda *a: calls.extend(["triton"] * 2) or reference.moe_experts_fp8(*a)  # noqa: E731
    monkeypatch.setattr(external, "_masked_fp8_gemm", lambda: masked)
    monkeypatch.setattr(external, "_library",
                        lambda name: SimpleNamespace(m_grouped_fp8_gemm_nt_contiguous=contiguous_gemm))
    monkeypatch.setattr(external, "_deep_gemm_alignment", lambda: 8)
    monkeypatch.setattr(external, "_contiguous_fp8_moe", lambda: contiguous)
    monkeypatch.setattr(external, "_CONTIGUOUS_OK", {"cpu": True})
    monkeypatch.setattr(fp8_ops, "moe_experts_fp8", triton)
    assert external.CONTIGUOUS_MIN_ROWS * 4 == 86 * 3 - 2
    for tokens in (external.MASKED_MAX_TOKENS, external.MASKED_MAX_TOKENS + 1, 85, 86):
        calls.clear()
        args = external._moe_fp8_check_inputs(torch.device("cpu"), tokens=tokens)
        got = external.deep_gemm_moe_experts_fp8(*args)
        want = reference.moe_experts_fp8(*[a.double() if isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16
                                           else a for a in args])
        above = {False: "triton", True: "contiguous", None: "contiguous" if tokens >= 86 else "triton"}[contiguous]
        assert calls == ["masked" if tokens <= external.MASKED_MAX_TOKENS else above] * 2
        assert got.shape == (tokens, args[0].shape[1])
        assert (got.double() - want).abs().max() <= 0.02 * want.abs().max()  # the self-check's inputs, bf16 out
    monkeypatch.setattr(external, "_CONTIGUOUS_OK", {"cpu": False})  # its self-check failed: never
    calls.clear()
    external.deep_gemm_moe_experts_fp8(*external._moe_fp8_check_inputs(torch.device("cpu"), tokens=86))
    assert calls == ["triton"] * 2


def test_adapters_decline_without_their_library_or_a_gpu():
    from deepinfer_nvidia_sm100 import external

    for adapter in external.ADAPTERS:
        ok, reason = adapter.usable(torch.device("cpu"), torch.bfloat16, None, True)
        assert not ok and reason


def test_expert_layout_places_each_pair_once():
    from deepinfer_nvidia_sm100.triton_ops import expert_layout

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(-1, 7, (37, 3), generator=g)
    pairs, block = 37 * 3, 16
    rows, block_expert = expert_layout(ids, 7, block)
    assert rows.numel() % block == 0 and block_expert.numel() == rows.numel() // block
    flat = ids.flatten()
    placed = rows[rows < pairs]
    assert sorted(placed.tolist()) == [p for p in range(pairs) if 0 <= flat[p] < 7]
    for b, expert in enumerate(block_expert.tolist()):
        chunk = rows[b * block : (b + 1) * block]
        chunk = chunk[chunk < pairs]
        if expert < 0:
            assert chunk.numel() == 0
        else:
            assert chunk.numel() > 0 and (flat[chunk] == expert).all()
            assert torch.equal(chunk, chunk.sort().values), "pairs keep their order within an expert"


# --- topology helpers --------------------------------------------------------------------------------

TOPO = """\
\tGPU0\tGPU1\tGPU2\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNV18\tSYS\tPIX\t0-47\t0\t\tN/A
GPU1\tNV18\t X \tNV18\tSYS\t0-47\t0\t\tN/A
GPU2\tSYS\tNV18\t X \tSYS\t48-95\t1\t\tN/A
NIC0\tPIX\tSYS\tSYS\t X

Legend:

  X    = Self
  NV#  = Connection traversing a bonded set of # NVLinks
"""


def test_nvlink_peers_from_nvidia_smi_topo():
    from deepinfer_nvidia_sm100.topology import parse_topo_matrix

    assert parse_topo_matrix(TOPO) == {0: [1], 1: [0, 2], 2: [1]}
    # as nvidia-smi prints it on a terminal-less H200 pair: the header underlined with ANSI codes
    underlined = (
        "\t\x1b[4mGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n"
        "GPU0\t X \tNV18\t0-31\t0\t\tN/A\nGPU1\tNV18\t X \t0-31\t0\t\tN/A\n"
    )
    assert parse_topo_matrix(underlined) == {0: [1], 1: [0]}
    assert parse_topo_matrix("No devices were found") == {}


def test_numa_node_from_sysfs(tmp_path):
    from deepinfer_nvidia_sm100.topology import normalize_bus_id, numa_node

    (tmp_path / "0000:1b:00.0").mkdir()
    (tmp_path / "0000:1b:00.0" / "numa_node").write_text("1\n")
    assert normalize_bus_id("00000000:1B:00.0") == "0000:1b:00.0"
    assert numa_node("00000000:1B:00.0", tmp_path) == 1
    assert numa_node("0000:2c:00.0", tmp_path) == -1
    assert numa_node(None, tmp_path) == -1


def test_backend_is_installed_with_its_entry_point():
    loaded = load_backend(BACKEND, require_available=False)
    assert loaded.info.name == BACKEND and loaded.info.device_type == "cuda"


def test_op_table_accepts_the_nvidia_functions_directly():
    """The functions are plain callables with the catalogue signatures (the hot path calls them)."""
    registered = _registry_for(BACKEND).impls  # the lowest priority of each op: the native body
    table = OpTable({op: OpImpl(op, min(impls, key=lambda i: i.priority).fn, 0, "t")
                     for op, impls in registered.items()})
    assert set(table.chosen) == set(CATALOGUE)
    assert (REPO / "backends/nvidia_sm100/README.md").is_file()

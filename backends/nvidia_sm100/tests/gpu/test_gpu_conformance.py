"""Every op of nvidia_sm100 on the GPU against the cpu_ref reference (float64 on the CPU).

The cases are the conformance suite's (``deepinfer_core.testing.conformance``): NaN in every pool row no
index references, -1 slots and whole -1 rows, -inf gates, -1 expert ids with nonzero weights. They run
at the ``tiny`` preset (bfloat16 and float32) and at the ``v4_flash`` preset (the real widths: hidden
4096, 64 heads x 512, 256 experts top-6, indexer top-512) in bfloat16. No op may fall back to cpu_ref,
and each op must be served by the implementation the capability probes choose.
"""

from __future__ import annotations

import pytest
import torch
from gpu_support import BACKEND, gpu_marks, run_without_host_sync

from deepinfer_core.ops import native
from deepinfer_core.ops.catalogue import CATALOGUE
from deepinfer_core.testing import conformance as conf

pytestmark = gpu_marks()

OPS = sorted(CATALOGUE)
RUNS = [("tiny", torch.bfloat16), ("tiny", torch.float32), ("v4_flash", torch.bfloat16)]


@pytest.fixture(scope="module")
def reference():
    return conf.reference_op_table()


@pytest.fixture(scope="module")
def tables(device):
    made = {}

    def get(dtype):
        if dtype not in made:
            made[dtype] = conf.candidate_op_table(BACKEND, dtype, device)
        return made[dtype]

    return get


@pytest.mark.parametrize("preset, dtype", RUNS, ids=[f"{p}-{str(d)[6:]}" for p, d in RUNS])
@pytest.mark.parametrize("op", OPS)
def test_op_matches_cpu_ref(op, preset, dtype, tables, reference, device):
    results = conf.check_op(op, tables(dtype), reference, preset, dtype, device=device, backend=BACKEND)
    assert results, f"no cases for {op}"
    assert not any(r.fallback for r in results), f"{op} fell back to cpu_ref"
    failed = [r for r in results if not r.passed]
    assert not failed, "\n\n".join(str(r) for r in failed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
def test_each_op_is_served_by_the_planned_implementation(dtype, tables, device):
    from deepinfer_nvidia_sm100.registration import op_labels

    from deepinfer_core.ops.registry import BuildContext
    from deepinfer_core.plugins import collect_registry, load_backend

    expected = op_labels(collect_registry(load_backend(BACKEND)), BuildContext(BACKEND, dtype, device))
    ours = "deepinfer_nvidia_sm100."
    modules = {"torch": {native.__name__},
               "triton": {ours + "triton_ops", ours + "hc_ops", ours + "fp8_ops", ours + "invariant_ops",
                          ours + "engram_ops"},
               "flash_mla": {ours + "external"}, "deep_gemm": {ours + "external"}}
    table = tables(dtype)
    for op in CATALOGUE:
        fn = table.chosen[op].fn
        assert table.provider(op) == f"deepinfer.backends:{BACKEND}", op
        assert fn.__module__ in modules[expected[op]], (op, expected[op], fn)
    kernels = {op for op, impl in expected.items() if impl in ("triton", "flash_mla", "deep_gemm")}
    own_kernels = {"sparse_attention", "indexer_topk", "compress_windows", "rms_norm", "rotary_emb",
                   "moe_experts", "hc_pre", "hc_post", "hc_head"}
    assert own_kernels <= kernels, expected


def test_sparse_attention_never_reads_minus_one_rows(device):
    """Pools entirely NaN except the referenced rows, 64 heads x 512, window + compressed indices."""
    from deepinfer_nvidia_sm100 import triton_ops

    g = torch.Generator().manual_seed(5)
    tokens, heads, d = 7, 64, 512
    kv = torch.full((300, d), float("nan"))
    ekv = torch.full((130, d), float("nan"))
    idx = torch.full((tokens, 128), -1, dtype=torch.long)
    eidx = torch.full((tokens, 512), -1, dtype=torch.long)
    for t in range(tokens):
        rows = torch.randperm(298, generator=g)[: 20 * t] + 1
        idx[t, torch.randperm(128, generator=g)[: min(128, rows.numel())]] = rows[:128]
        erows = torch.randperm(128, generator=g)[: 17 * t] + 1
        eidx[t, torch.randperm(512, generator=g)[: erows.numel()]] = erows
    used = idx[idx >= 0].unique()
    kv[used] = torch.randn(used.numel(), d, generator=g)
    eused = eidx[eidx >= 0].unique()
    ekv[eused] = torch.randn(eused.numel(), d, generator=g)
    q = torch.randn(tokens, heads, d, generator=g)
    sinks = torch.randn(heads, generator=g)
    want = native.sparse_attention(q.double(), kv.double(), idx, sinks.double(), d**-0.5,
                                   ekv.double(), eidx)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        args = [a.to(device) for a in (q.to(dtype), kv.to(dtype), idx, sinks)]
        got = triton_ops.sparse_attention(*args, d**-0.5, ekv.to(dtype).to(device), eidx.to(device)).cpu()
        assert not torch.isnan(got).any(), dtype
        assert torch.equal(got[0], torch.zeros_like(got[0])), "a token with no key attends only to the sink"
        err = (got.double() - want).abs().max().item()
        assert err < tol, (dtype, err)


def test_moe_experts_large_batch_uses_big_blocks(device):
    """Prefill-sized routing (hundreds of (token, expert) pairs, 64-row blocks) against the reference."""
    from deepinfer_nvidia_sm100 import triton_ops

    g = torch.Generator().manual_seed(6)
    tokens, d, inter, experts, k = 300, 256, 128, 16, 6
    x = torch.randn(tokens, d, generator=g)
    w13 = torch.randn(experts, 2 * inter, d, generator=g) * d**-0.5
    w2 = torch.randn(experts, d, inter, generator=g) * inter**-0.5
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    ids[::7, 2] = -1
    weights = torch.rand(tokens, k, generator=g)
    want = native.moe_experts(x.double(), w13.double(), w2.double(), ids, weights.double(), 10.0)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 5e-2)):
        args = [a.to(device) for a in (x.to(dtype), w13.to(dtype), w2.to(dtype), ids, weights)]
        got = triton_ops.moe_experts(*args, 10.0).cpu().double()
        cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0).item()
        err = (got - want).abs().max().item()
        assert err < tol * max(1.0, want.abs().max().item()) and cos > 0.9995, (dtype, err, cos)


def test_triton_ops_never_sync_with_the_host(device):
    """The Triton launchers (sorting and the MoE layout included) queue work without waiting for the
    device: CUDA-graph capturable, and no stall per layer."""
    from deepinfer_nvidia_sm100 import triton_ops

    calls = []
    for op in ("sparse_attention", "indexer_topk", "compress_windows", "moe_experts", "rms_norm", "rotary_emb"):
        case = conf.make_cases(op, "tiny", torch.bfloat16)[0]
        calls.append((op, tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in case.args)))
    for op, args in calls:  # compile (and autotune nothing) outside the checked region
        triton_ops.ALL_OPS[op](*args)
    run_without_host_sync(lambda: [triton_ops.ALL_OPS[op](*args) for op, args in calls])
    torch.cuda.synchronize()

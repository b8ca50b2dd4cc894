"""The ascend_950 MoE adapters over torch_npu's fused operators, against cpu_ref, through fakes.

``npu_moe_gating_top_k`` and ``npu_grouped_matmul`` are replaced by fakes that implement the formulas of
torch_npu's documentation (the gating operator's equivalent computation; the grouped matmul's
single-x / single-weight / single-y mode with per-group row counts, rows past the last group left
uncomputed as NaN). The conformance suite's MoE cases then run through the adapters. This proves the
adapters' layout, sorting, masking and renormalisation, not the real operators on an Ascend 950.
"""

from __future__ import annotations

import sys

import pytest
import torch
from deepinfer_ascend_950 import npu, npu_ops, registration

from deepinfer_core.ops import native
from deepinfer_core.ops.registry import BuildContext, resolve_ops
from deepinfer_core.testing import conformance as conf

try:
    from test_ascend_backend import NPU_DEVICE, clean, install_fake_torch_npu, registry  # noqa: F401
except ImportError:  # tests/ imported as a package
    from tests.test_ascend_backend import NPU_DEVICE, clean, install_fake_torch_npu, registry  # noqa: F401

CALLS: list[str] = []


def fake_moe_gating_top_k(x, k, *, bias=None, k_group=1, group_count=1, group_select_mode=0, renorm=0,
                          norm_type=0, out_flag=False, routed_scaling_factor=1.0, eps=1e-20):
    CALLS.append("npu_moe_gating_top_k")
    assert group_count == 1 and k_group == 1 and renorm == 0 and x.dim() == 2 and x.shape[-1] <= 2048
    xf = x.float()
    scores = torch.softmax(xf, dim=-1) if norm_type == 0 else torch.sigmoid(xf)
    choice = scores + bias.float() if bias is not None else scores
    idx = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :k]
    y = scores.gather(1, idx)
    if norm_type == 1:
        y = y / (y.sum(-1, keepdim=True) + eps)
    return (y * routed_scaling_factor).to(x.dtype), idx.int(), scores if out_flag else None


def fake_grouped_matmul(x, weight, *, group_list=None, split_item=0, group_type=-1, group_list_type=0, **kw):
    CALLS.append("npu_grouped_matmul")
    assert len(x) == 1 and len(weight) == 1 and split_item == 3 and group_type == 0 and group_list_type == 1
    (a,), (w,) = x, weight
    assert w.dim() == 3 and w.shape[1] == a.shape[1] and group_list.numel() == w.shape[0]
    y = torch.full((a.shape[0], w.shape[2]), float("nan"), dtype=a.dtype)
    start = 0
    for e, count in enumerate(group_list.tolist()):
        y[start : start + count] = (a[start : start + count].float() @ w[e].float()).to(a.dtype)
        start += count
    return [y]


def install(monkeypatch, tmp_path):
    install_fake_torch_npu(monkeypatch, tmp_path)
    module = sys.modules["torch_npu"]
    monkeypatch.setattr(module, "npu_moe_gating_top_k", fake_moe_gating_top_k, raising=False)
    monkeypatch.setattr(module, "npu_grouped_matmul", fake_grouped_matmul, raising=False)
    npu._probe.cache_clear()


def test_an_npu_with_the_operators_picks_the_adapters(monkeypatch, tmp_path):
    install(monkeypatch, tmp_path)
    ctx = BuildContext(backend="ascend_950", device=NPU_DEVICE, dtype=torch.bfloat16, probe_only=True)
    table = resolve_ops(registry(), ctx)
    assert table.moe_route is npu_ops.moe_route and table.moe_experts is npu_ops.moe_experts
    assert table.syncs_host(["moe_experts"]) == []  # no read-back: capturable in an ACL graph
    labels = registration.op_labels(registry(), ctx)
    assert labels["moe_experts"] == "torch_npu.npu_grouped_matmul"


def test_without_the_operators_the_native_bodies_serve(monkeypatch, tmp_path):
    install_fake_torch_npu(monkeypatch, tmp_path)
    ctx = BuildContext(backend="ascend_950", device=NPU_DEVICE, dtype=torch.bfloat16, probe_only=True)
    table = resolve_ops(registry(), ctx)
    assert table.moe_route is native.moe_route and table.moe_experts is native.moe_experts


@pytest.mark.parametrize("op", ["moe_route", "moe_experts"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_adapters_conform_through_documented_fakes(monkeypatch, tmp_path, op, dtype):
    install(monkeypatch, tmp_path)
    ctx = BuildContext(backend="ascend_950", device=NPU_DEVICE, dtype=dtype, probe_only=True)
    table = resolve_ops(registry(), ctx)
    CALLS.clear()
    results = conf.check_op(op, table, conf.reference_op_table(), "tiny", dtype, backend="ascend_950")
    failed = [r for r in results if not r.passed]
    assert results and not failed, "\n\n".join(str(r) for r in failed)
    want = {"moe_route": {"npu_moe_gating_top_k"}, "moe_experts": {"npu_grouped_matmul"}}[op]
    assert set(CALLS) == want  # the operator served, not the native body


def test_route_keeps_v4_scoring_and_hash_routing_native(monkeypatch, tmp_path):
    install(monkeypatch, tmp_path)
    logits = torch.randn(6, 16)
    CALLS.clear()
    for args in ((logits, "sqrtsoftplus", 2, None, None, 1.5),
                 (logits, "sigmoid", 2, None, torch.randint(0, 16, (6, 2)), 1.0)):
        weights, ids = npu_ops.moe_route(*args)
        want_w, want_ids = native.moe_route(*args)
        assert torch.equal(ids, want_ids) and torch.allclose(weights, want_w)
    assert CALLS == []


def test_experts_drop_invalid_pairs_even_when_the_operator_leaves_nan(monkeypatch, tmp_path):
    install(monkeypatch, tmp_path)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 32, generator=g)
    w13, w2 = torch.randn(3, 16, 32, generator=g) * 0.2, torch.randn(3, 32, 8, generator=g) * 0.3
    ids = torch.tensor([[0, -1], [-1, -1], [2, 2], [1, 5]])  # -1 and 5: experts of other ranks
    weights = torch.rand(4, 2, generator=g) + 0.1
    got = npu_ops.moe_experts(x, w13, w2, ids, weights, 10.0)
    assert torch.isfinite(got).all() and torch.equal(got[1], torch.zeros(32))
    torch.testing.assert_close(got, native.moe_experts(x, w13, w2, ids, weights, 10.0), rtol=1e-5, atol=1e-5)

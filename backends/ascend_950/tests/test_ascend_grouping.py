"""The ascend_950 grouped MoE path: the device-side tile plan, and no host read-back around the kernels.

The grouped expert wrappers must be capturable in an ACL graph: nothing may wait for a value on the
host. Here that is checked by dispatching the wrapper (its kernels stubbed: they run on the device)
under a mode that records every aten op, and failing on those that read a value back
(``_local_scalar_dense``, which ``.item()``/``bool()``/``int()`` go through) or whose output size
depends on the data (``nonzero``, ``bincount``, ``unique``, ``masked_select``: the device must tell the
host). The same detector sees the native body's per-expert loop (its ``bincount``).
"""

from __future__ import annotations

import pytest
import torch
from deepinfer_ascend_950 import grouping
from torch.utils._python_dispatch import TorchDispatchMode

READ_BACKS = {"_local_scalar_dense", "nonzero", "bincount", "equal", "unique", "_unique2", "masked_select"}


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def _ids(tokens: int, k: int, experts: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, experts, (tokens, k), generator=g)
    ids[torch.rand(tokens, k, generator=g) < 0.3] = -1  # routed to another rank
    return ids


@pytest.mark.parametrize("tokens,k,experts,block_m", [(1, 6, 4, 64), (37, 6, 8, 64), (200, 2, 3, 32), (5, 2, 8, 64)])
def test_plan_places_every_pair_once_in_a_tile_of_its_expert(tokens, k, experts, block_m):
    ids = _ids(tokens, k, experts, seed=tokens)
    p = grouping.plan(ids, experts, block_m)
    flat, pairs = ids.reshape(-1), tokens * k
    assert p.tile_expert.numel() == grouping.max_tiles(pairs, experts, block_m)
    valid = p.row_pair < pairs
    assert sorted(p.row_pair[valid].tolist()) == [i for i in range(pairs) if flat[i] >= 0]
    row_expert = p.tile_expert.long().repeat_interleave(block_m)
    assert torch.equal(row_expert[valid], flat[p.row_pair[valid]])
    assert torch.equal(p.row_token[valid], p.row_pair[valid] // k) and (p.row_token[~valid] == tokens).all()
    used = p.tile_expert >= 0
    assert used.sum() == sum(-(-int((flat == e).sum()) // block_m) for e in range(experts))
    assert not used[int(used.sum()):].any()  # used tiles first, in expert order
    assert torch.equal(p.tile_expert[used], p.tile_expert[used].sort().values)


def test_rows_gathered_and_combined_back_to_their_tokens():
    ids = _ids(9, 3, 4, seed=1)
    p = grouping.plan(ids, 4, 32)
    x = torch.randn(9, 16)
    rows = grouping.gather_rows(x, p)
    assert (rows[p.row_pair == p.pairs] == 0).all()
    weights = torch.rand(9, 3)
    got = grouping.combine(rows * grouping.row_weights(weights, p)[:, None], p, torch.float32)
    want = x * (weights * (ids >= 0)).sum(-1, keepdim=True)
    torch.testing.assert_close(got, want)


def _case(op: str, name: str):
    from deepinfer_core.testing.conformance import make_cases

    return next(c for c in make_cases(op, "tiny", torch.bfloat16) if c.name == name)


def _stub_kernel(name, **params):
    def run(*args):
        args[-1].zero_()  # a device kernel: its work is not a host read-back

    return run


@pytest.mark.parametrize("op,name", [("moe_experts_fp4", "w4a16"), ("moe_experts_fp4", "w4a8_deepseek"),
                                     ("moe_experts_fp8", "ep_local"), ("moe_experts_fp8", "ragged")])
def test_grouped_experts_never_read_back_to_the_host(monkeypatch, op, name):
    from deepinfer_ascend_950 import registration, tilelang_ops

    from deepinfer_core.ops import native

    case = _case(op, name)
    monkeypatch.setattr(tilelang_ops, "compiled", _stub_kernel)
    with _Recorder() as rec:
        registration.tilelang_kernel_ops()[op](*case.args)
    assert rec.ops and not rec.ops & READ_BACKS, sorted(rec.ops & READ_BACKS)
    with _Recorder() as rec:
        native.NATIVE_OPS[op](*case.args)
    assert "bincount" in rec.ops  # the detector sees the per-expert loop's counts

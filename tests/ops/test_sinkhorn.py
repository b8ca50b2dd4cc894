"""hc_mixes' Sinkhorn normalisation on the CPU runs in numpy for n <= 4 streams: bit for bit torch's
``comb / (comb.sum(dim) + eps)`` iterations, at every stream count, dtype and row count it serves, and
torch's own path everywhere else (n > 4, bfloat16, tensors that require grad)."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.ops.native import _sinkhorn

EPS = 1e-6


def _torch_sinkhorn(comb: torch.Tensor, iters: int, eps: float = EPS) -> torch.Tensor:
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_numpy_path_equals_torchs_iterations(n, dtype):
    g = torch.Generator().manual_seed(n)
    for rows in (1, 3, 16, 257):
        for iters in (1, 2, 20):
            logits = torch.randn(rows, n, n, generator=g, dtype=torch.float64) * 4
            comb = (logits.softmax(-1) + EPS).to(dtype)
            want = _torch_sinkhorn(comb.clone(), iters)
            got = _sinkhorn(comb.clone(), iters, EPS)
            assert got.dtype == dtype and torch.equal(got, want), (rows, iters)


def test_a_tensor_that_requires_grad_takes_torchs_path():
    comb = (torch.rand(2, 4, 4).softmax(-1) + EPS).requires_grad_()
    out = _sinkhorn(comb * 1, 20, EPS)
    assert out.requires_grad and torch.equal(out.detach(), _torch_sinkhorn(comb.detach(), 20))

"""benchmarks/bench_spec_decode.py: forced acceptance reaches the all-greedy verification path too."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from deepinfer_core.worker import spec_model_runner

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def bsd(monkeypatch):
    sys.path.insert(0, str(BENCHMARKS))
    import bench_spec_decode

    for name in ("rejection_sample", "greedy_verify"):  # force_acceptance replaces them
        monkeypatch.setattr(spec_model_runner, name, getattr(spec_model_runner, name))
    return bench_spec_decode


@pytest.mark.parametrize("rate, accepted", [(1.0, [3, 2]), (0.0, [0, 0])])
def test_forced_acceptance_covers_greedy_verification(bsd, rate, accepted):
    bsd.force_acceptance(rate)
    logits = torch.zeros(2, 4, 10)
    logits[..., 7] = 1.0  # the target's argmax is 7 everywhere: the drafts (1, 2, 3) would all be rejected
    drafts, num = torch.tensor([[1, 2, 3], [4, 5, 0]]), torch.tensor([3, 2])
    out = spec_model_runner.greedy_verify(logits, drafts, num)
    assert out.num_accepted.tolist() == accepted
    for row, n, d in zip(out.output_token_ids.tolist(), accepted, drafts.tolist()):
        assert row[:n] == d[:n] and row[n] == 7 and all(t == -1 for t in row[n + 1:])

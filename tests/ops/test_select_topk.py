"""``select_topk`` against the first ``topk`` of a stable descending sort, on both of its paths.

Rows up to ``SORT_ALL_WIDTH_PER_PICK * topk`` wide are sorted whole; wider rows go through the partial
selection. Scores drawn from a few values make ties common, so the earlier-candidate rule is exercised."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.ops import native


def reference(scores, valid, candidates, topk):
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :topk]
    chosen = torch.where(valid.gather(1, order), candidates.gather(1, order), torch.full_like(order, -1))
    missing = topk - chosen.shape[1]
    return torch.cat([chosen, chosen.new_full((chosen.shape[0], missing), -1)], dim=1) if missing else chosen


@pytest.mark.parametrize("width_per_pick", [None, 0])  # the default threshold, and partial selection always
@pytest.mark.parametrize("width", [1, 7, 8, 31, 32, 33, 100, 257])
def test_select_topk_is_the_stable_sorts_prefix(monkeypatch, width, width_per_pick):
    if width_per_pick is not None:
        monkeypatch.setattr(native, "SORT_ALL_WIDTH_PER_PICK", width_per_pick)
    g = torch.Generator().manual_seed(width)
    topk, rows = 8, 6
    scores = torch.randint(0, 4, (rows, width), generator=g).float()
    valid = torch.rand(rows, width, generator=g) > 0.3
    scores = scores.masked_fill(~valid, float("-inf"))
    candidates = torch.randint(0, 10_000, (rows, width), generator=g)
    assert torch.equal(native.select_topk(scores, valid, candidates, topk),
                       reference(scores, valid, candidates, topk))


def test_threshold_picks_the_path(monkeypatch):
    """Rows at most 4 * topk wide take the whole sort (no torch.topk), wider ones the selection."""
    calls = []
    real = torch.topk
    monkeypatch.setattr(torch, "topk", lambda *a, **k: calls.append(1) or real(*a, **k))
    scores = torch.randn(2, 32)
    native.select_topk(scores, torch.ones_like(scores, dtype=torch.bool), torch.arange(32).expand(2, 32), 8)
    assert not calls
    scores = torch.randn(2, 33)
    native.select_topk(scores, torch.ones_like(scores, dtype=torch.bool), torch.arange(33).expand(2, 33), 8)
    assert calls

"""DeepSeek's EPLB policy: the published example exactly, valid placements, and balance on skewed loads."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.parallel.eplb_policy import balanced_packing, gpu_loads, rebalance_experts, replicate_experts

EXAMPLE = torch.tensor([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                        [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
EXAMPLE_PHY2LOG = [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                   [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]


def test_the_published_example_exactly():
    phy2log, log2phy, logcnt = rebalance_experts(EXAMPLE, 16, 4, 2, 8)
    assert phy2log.tolist() == EXAMPLE_PHY2LOG
    assert logcnt.sum(-1).tolist() == [16, 16]
    for layer in range(2):
        for expert in range(12):
            slots = [s for s in log2phy[layer, expert].tolist() if s >= 0]
            assert len(slots) == logcnt[layer, expert] and all(phy2log[layer, s] == expert for s in slots)


def test_global_policy_when_groups_do_not_divide_over_nodes():
    phy2log, _, logcnt = rebalance_experts(EXAMPLE, 16, 3, 2, 8)  # 3 groups over 2 nodes: global
    assert sorted(set(phy2log[0].tolist())) == list(range(12)) and logcnt.sum(-1).tolist() == [16, 16]


def test_packing_fills_every_pack_evenly_and_replicas_go_to_the_busiest():
    pack, rank = balanced_packing(torch.tensor([[9.0, 1, 8, 2, 7, 3]]), 3)
    assert torch.bincount(pack[0]).tolist() == [2, 2, 2] and sorted(rank[0].tolist()) == [0, 0, 0, 1, 1, 1]
    phy2log, _, count = replicate_experts(torch.tensor([[10.0, 1, 1]]), 5)
    assert phy2log[0].tolist()[3:] == [0, 0] and count[0].tolist() == [3, 1, 1]
    with pytest.raises(ValueError, match="do not split evenly"):
        balanced_packing(torch.ones(1, 5), 2)


def test_skewed_load_balances(capsys):
    gen = torch.Generator().manual_seed(0)
    load = (torch.rand(4, 64, generator=gen) ** 8 * 1000).round()  # a few very hot experts
    gpus, replicas = 8, 80
    before = load.view(4, gpus, -1).sum(-1)  # experts 8 per GPU in id order, no replicas
    phy2log, _, logcnt = rebalance_experts(load, replicas, 8, 1, gpus)
    after = gpu_loads(load, phy2log, logcnt, gpus)
    ratio_before = (before.max(-1).values / before.mean(-1)).mean().item()
    ratio_after = (after.max(-1).values / after.mean(-1)).mean().item()
    print(f"max/mean GPU load: {ratio_before:.3f} before, {ratio_after:.3f} after EPLB ({replicas} slots, {gpus} GPUs)")
    assert ratio_after < ratio_before and ratio_after < 1.2

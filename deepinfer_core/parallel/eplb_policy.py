"""DeepSeek's EPLB rearrangement policy: which logical expert each physical expert slot serves.

Given the measured load of every logical expert (per MoE layer), ``rebalance_experts`` adds redundant
replicas of the busiest experts and places all physical experts on GPUs so that the GPUs' loads even out.
Hierarchical when the expert groups divide evenly over the nodes (groups are packed onto nodes first,
so the tokens of a group stay on one node; replicas are made and packed onto GPUs inside each node),
global otherwise (one group, one node).
"""

from __future__ import annotations

import torch


def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Put the ``n`` items of each row into ``num_packs`` packs of ``n / num_packs`` items each: heaviest
    first, each into the lightest pack that still has room. Returns (pack of each item, its rank in the pack)."""
    rows, n = weight.shape
    if n % num_packs:
        raise ValueError(f"{n} items do not split evenly into {num_packs} packs")
    per_pack = n // num_packs
    if per_pack == 1:
        ids = torch.arange(n, dtype=torch.long).expand(rows, n).clone()
        return ids, torch.zeros_like(ids)
    pack = torch.full((rows, n), -1, dtype=torch.long)
    rank = torch.full((rows, n), -1, dtype=torch.long)
    for r in range(rows):
        loads, counts = [0.0] * num_packs, [0] * num_packs
        for item in weight[r].float().sort(descending=True).indices.tolist():
            best = min((p for p in range(num_packs) if counts[p] < per_pack), key=loads.__getitem__)
            pack[r, item], rank[r, item] = best, counts[best]
            loads[best] += float(weight[r, item])
            counts[best] += 1
    return pack, rank


def replicate_experts(weight: torch.Tensor, num_physical: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``num_physical`` slots for ``num_logical`` experts: one each, then one more replica at a time to the
    expert with the highest load per replica. Returns (logical expert of each slot, the slot's replica
    rank, replicas per logical expert)."""
    rows, num_logical = weight.shape
    if num_physical < num_logical:
        raise ValueError(f"{num_physical} physical experts cannot hold {num_logical} logical ones")
    phy2log = torch.arange(num_physical, dtype=torch.long).repeat(rows, 1)
    rank = torch.zeros((rows, num_physical), dtype=torch.long)
    count = torch.ones((rows, num_logical), dtype=torch.long)
    row = torch.arange(rows)
    for slot in range(num_logical, num_physical):
        busiest = (weight / count).max(dim=-1).indices
        phy2log[:, slot] = busiest
        rank[:, slot] = count[row, busiest]
        count[row, busiest] += 1
    return phy2log, rank, count


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv.scatter_(1, perm, torch.arange(perm.size(1), dtype=torch.long).expand(perm.shape))
    return inv


def _hierarchical(weight: torch.Tensor, num_physical: int, num_groups: int, num_nodes: int,
                  num_gpus: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    layers, num_logical = weight.shape
    if num_logical % num_groups or num_groups % num_nodes or num_gpus % num_nodes or num_physical % num_gpus:
        raise ValueError(f"{num_logical} experts in {num_groups} groups do not spread evenly over {num_nodes} "
                         f"nodes, {num_gpus} GPUs and {num_physical} physical experts")
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    per_gpu = num_physical // num_gpus
    per_node_logical = num_logical // num_nodes
    # 1. expert groups onto nodes; "mlog" numbers the logical experts node by node
    group_pack, group_rank = balanced_packing(weight.unflatten(-1, (num_groups, group_size)).sum(-1), num_nodes)
    log2mlog = (((group_pack * groups_per_node + group_rank) * group_size).unsqueeze(-1)
                + torch.arange(group_size)).flatten(-2)
    mlog2log = _inverse(log2mlog)
    # 2. replicas inside each node
    node_load = weight.gather(-1, mlog2log).view(-1, per_node_logical)
    phy2mlog, phy_rank, mlog_count = replicate_experts(node_load, num_physical // num_nodes)
    # 3. a node's physical experts onto its GPUs, by load per replica
    per_replica = (node_load / mlog_count).gather(-1, phy2mlog)
    gpu_pack, gpu_rank = balanced_packing(per_replica, num_gpus // num_nodes)
    pphy2phy = _inverse(gpu_pack * per_gpu + gpu_rank)
    pphy2mlog = phy2mlog.gather(-1, pphy2phy)
    offsets = torch.arange(0, num_logical, per_node_logical).view(1, -1, 1)
    pphy2mlog = (pphy2mlog.view(layers, num_nodes, -1) + offsets).flatten(-2)
    phy2log = mlog2log.gather(-1, pphy2mlog)
    replica_rank = phy_rank.gather(-1, pphy2phy).view(layers, -1)
    log_count = mlog_count.view(layers, -1).gather(-1, log2mlog)
    return phy2log, replica_rank, log_count


def rebalance_experts(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                      num_gpus: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight[layers, logical]`` loads -> (``phy2log[layers, num_replicas]``, ``log2phy[layers, logical,
    max replicas]`` (-1 where an expert has fewer), ``logcnt[layers, logical]``)."""
    weight = weight.float().cpu()
    layers, num_logical = weight.shape
    if num_groups % num_nodes == 0:
        phy2log, rank, count = _hierarchical(weight, num_replicas, num_groups, num_nodes, num_gpus)
    else:
        phy2log, rank, count = _hierarchical(weight, num_replicas, 1, 1, num_gpus)
    width = num_replicas - num_logical + 1
    log2phy = torch.full((layers, num_logical, width), -1, dtype=torch.long)
    log2phy.view(layers, -1).scatter_(-1, phy2log * width + rank,
                                      torch.arange(num_replicas, dtype=torch.long).expand(layers, -1))
    return phy2log, log2phy, count


def gpu_loads(weight: torch.Tensor, phy2log: torch.Tensor, logcnt: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """Load of each GPU [layers, num_gpus] when a logical expert's tokens split evenly over its replicas."""
    per_replica = (weight.float() / logcnt).gather(-1, phy2log)
    return per_replica.view(weight.shape[0], num_gpus, -1).sum(-1)

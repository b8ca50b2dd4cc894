"""Expert-parallel dispatch and combine at fixed shapes, for a forward inside a decode graph.

The eager all-to-all (:class:`~deepinfer_core.parallel.ep.AllToAllDispatcher`) first exchanges how many
(token, expert) pairs go to each rank and then sends exactly those rows: the sizes come from the data, the
host reads them, and a captured graph can hold neither. Here every rank sends ``capacity`` rows to every
peer, whatever the routing: a token's top-k experts are distinct, so at most ``min(top_k, slots per rank)``
of its pairs go to one rank and ``capacity = tokens * min(top_k, slots per rank)`` always suffices. Every
shape follows from the token count alone, which the ranks agree on before the step (they replay graphs
of the same batch size, :mod:`.batch_sync`); positions come from a cumulative sum, never a count read back.

Unused rows carry slot -1 (the MoE ops skip them: their output rows are zero) and weight 0. A rank receives
its peers' rows in the order the eager path sends them (by source rank, each in its pairs' order), so its
experts see their rows in the same order, and ``combine`` adds a token's terms in ascending expert id as
the eager path does: the output is the eager step's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class PaddedHandle:
    position: torch.Tensor  # [T * k] the send row of each (token, k) pair
    num_tokens: int
    top_k: int
    topk_ids: torch.Tensor  # [T, k] logical ids: a token's terms are summed in ascending id


def capacity_of(num_tokens: int, top_k: int, slots_per_rank: int) -> int:
    """Rows each rank sends each peer for a forward of ``num_tokens`` tokens (the same on every rank)."""
    return num_tokens * min(top_k, slots_per_rank)


def _exchange(disp: Any, send: torch.Tensor) -> torch.Tensor:
    """Equal splits: ``send``'s ``world`` row blocks go one to each rank, in rank order."""
    if disp.world == 1:
        return send
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send.contiguous(), group=getattr(disp.comm, "group", None))
    return recv


def padded_dispatch(disp: Any, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PaddedHandle]:
    """``(recv_x, recv_local_slot_ids, recv_weights, handle)``, each ``world * capacity`` rows (slot -1:
    an unused row). ``disp``: the all-to-all dispatcher (its expert map, layer, world and rank)."""
    num_tokens, top_k = topk_ids.shape
    per, world = disp.experts_per_rank, disp.world
    cap = capacity_of(num_tokens, top_k, per)
    flat = topk_ids.reshape(-1)
    if disp.expert_map is not None:
        flat = disp.expert_map.physical(disp.layer, flat)
    dest = torch.div(flat, per, rounding_mode="floor")
    # a pair's rank among the earlier pairs to its destination: a running count, no count on the host
    to_rank = (dest.unsqueeze(1) == torch.arange(world, device=dest.device)).long()
    earlier = (to_rank.cumsum(0) - to_rank).gather(1, dest.unsqueeze(1)).squeeze(1)
    position = dest * cap + earlier
    rows = torch.div(torch.arange(flat.numel(), device=flat.device), top_k, rounding_mode="floor")
    send_x = x.new_zeros((world * cap, x.shape[-1]))
    send_x[position] = x[rows]
    send_ids = flat.new_full((world * cap,), -1)
    send_ids[position] = flat - dest * per  # the slot among the destination's
    send_w = topk_weights.new_zeros((world * cap,))
    send_w[position] = topk_weights.reshape(-1)
    recv_x, recv_ids, recv_w = (_exchange(disp, t) for t in (send_x, send_ids, send_w))
    return recv_x, recv_ids, recv_w, PaddedHandle(position, num_tokens, top_k, topk_ids)


def padded_combine(disp: Any, y: torch.Tensor, handle: PaddedHandle) -> torch.Tensor:
    """Weighted expert outputs ``y`` (rows as dispatched, unused ones zero) summed per home token."""
    back = _exchange(disp, y)
    pairs = back[handle.position].view(handle.num_tokens, handle.top_k, back.shape[-1])
    return sum_in_expert_order(pairs, handle.topk_ids)


def sum_in_expert_order(pairs: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """``pairs[T, k, hidden]`` summed over k onto zeros in ascending expert id, the order the one-process
    MoE ops add a token's terms in (so the sum is theirs bit for bit)."""
    slots = torch.sort(topk_ids, dim=1, stable=True).indices
    pairs = pairs.gather(1, slots.unsqueeze(-1).expand_as(pairs))
    out = pairs.new_zeros((pairs.shape[0], pairs.shape[-1]))
    for k in range(pairs.shape[1]):
        out += pairs[:, k]
    return out

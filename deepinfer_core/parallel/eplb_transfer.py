"""Moving routed-expert weights between ranks when EPLB changes a layer's slot layout.

Every rank computes the same plan from the old and new ``phy2log`` rows: a new slot takes its logical
expert from a slot of its own rank when one held it, else from the lowest old slot holding it (on
whichever rank); the rows then travel in one ``all_to_all_single`` per tensor (as bytes, so any dtype,
FP8 and FP4 included, goes through gloo, NCCL or HCCL alike). Weights are copied, never recomputed, so
the outputs do not change. The new rows are written into the stacks' own storage: a decode graph captured
before the rearrangement reads the moved weights when replayed after it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from deepinfer_core.model.records import Experts, Linear


@dataclass
class TransferPlan:
    """For one layer and this rank: where each new local slot comes from, and which old local slots go
    to each peer (in the order the peer expects them)."""

    local_src: dict[int, int]  # new local slot -> old local slot on this rank
    recv_from: list[list[int]]  # per peer: the new local slots filled from it, in order
    send_to: list[list[int]]  # per peer: the old local slots it receives, in order


def plan_transfer(old: list[int], new: list[int], rank: int, world: int) -> tuple[TransferPlan, int]:
    """This rank's plan, and the number of slots that cross between ranks in all (the same on every rank)."""
    per = len(old) // world
    first_holder: dict[int, int] = {}
    for slot, e in enumerate(old):
        first_holder.setdefault(e, slot)
    recv_from: list[list[int]] = [[] for _ in range(world)]
    send_to: list[list[int]] = [[] for _ in range(world)]
    local_src: dict[int, int] = {}
    crossing = 0
    for dst in range(world):
        held = {}
        for j in range(per):
            held.setdefault(old[dst * per + j], j)
        for j in range(per):
            e = new[dst * per + j]
            if e in held:
                if dst == rank:
                    local_src[j] = held[e]
                continue
            src_slot = first_holder[e]
            src = src_slot // per
            crossing += 1
            if dst == rank:
                recv_from[src].append(j)
            if src == rank:
                send_to[dst].append(src_slot - rank * per)
    return TransferPlan(local_src, recv_from, send_to), crossing


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """[slots, ...] as raw bytes [slots, n]."""
    return t.contiguous().view(t.shape[0], -1).view(torch.uint8)


def move_stack(t: torch.Tensor, plan: TransferPlan, group: object | None, exchange: bool) -> torch.Tensor:
    """The new local stack of one tensor [slots, ...] under ``plan``; ``exchange``: some slot crosses
    between ranks (then every rank takes part in the all-to-all, with or without rows of its own)."""
    rows = _as_rows(t)
    out = torch.empty_like(rows)
    for j, src in plan.local_src.items():
        out[j] = rows[src]
    if exchange:
        send_idx = [i for peer in plan.send_to for i in peer]
        send = rows[torch.tensor(send_idx, dtype=torch.long, device=t.device)]
        recv_slots = [j for peer in plan.recv_from for j in peer]
        recv = rows.new_empty((len(recv_slots), rows.shape[1]))
        dist.all_to_all_single(recv, send, [len(p) for p in plan.recv_from], [len(p) for p in plan.send_to],
                               group=group)
        if recv_slots:
            out[torch.tensor(recv_slots, dtype=torch.long, device=t.device)] = recv
    return out.view(t.dtype).view(t.shape)


def move_experts(experts: Experts, old: list[int], new: list[int], rank: int, world: int,
                 group: object | None) -> int:
    """Rearrange one layer's local stacks from layout ``old`` to ``new`` in place (every rank calls it with
    the same rows); returns the number of slots that crossed between ranks."""
    plan, crossing = plan_transfer(old, new, rank, world)
    if crossing == 0 and all(plan.local_src.get(j) == j for j in range(len(old) // world)):
        return 0
    for name in ("w13", "w2"):
        lin: Linear = getattr(experts, name)
        for t in (lin.weight, lin.scale):
            if t is not None:
                _write_in_place(t, move_stack(t, plan, group, crossing > 0))
    return crossing


def _write_in_place(t: torch.Tensor, new: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError("an expert stack must be contiguous to be rearranged in place")
    _as_rows(t).copy_(_as_rows(new))

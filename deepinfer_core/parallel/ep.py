"""Expert-parallel dispatch and combine over ``torch.distributed.all_to_all_single`` (any backend:
gloo, NCCL, HCCL). Physical expert slots are sharded contiguously: rank ``r`` owns slots
``[r * P / world, (r + 1) * P / world)``; without EPLB a slot is its logical expert, with it the
dispatcher's :class:`~deepinfer_core.parallel.expert_map.ExpertMap` turns the router's logical ids into
slots (``layer``, the MoE layer being run, is set by the EPLB recorder just before each dispatch).

Also the model side of expert parallelism: :func:`shard_experts` keeps a rank's own experts and hands the
model its dispatcher, :func:`dummy_moe_step` joins every MoE layer's collectives with no tokens (a rank
with nothing scheduled, so that its peers never wait forever).

Expert groups: the target's MoE layers dispatch through ``model.ep``. A drafter whose MoE has experts of
its own (``drafter.num_experts``: DeepSeek-V4.1's DSpark stages, another count and top-k than the
target's) is a second group, with a dispatcher over its own expert count (``drafter.ep``), its own slot
map and its own load; a drafter without (V4's MTP block) shares the target's dispatcher and slices."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from deepinfer_core.comm import Communicator
from deepinfer_core.model.records import Experts, Linear, records
from deepinfer_core.parallel.ep_padded import PaddedHandle, padded_combine, padded_dispatch, sum_in_expert_order
from deepinfer_core.parallel.expert_map import ExpertMap
from deepinfer_core.parallel.fixed_shapes import FixedShapeCollective


@dataclass
class _Handle:
    order: torch.Tensor  # the (token, k) pairs in send order
    send_counts: list[int]
    recv_counts: list[int]
    num_tokens: int
    top_k: int
    topk_ids: torch.Tensor  # [T, k] global expert ids: a token's terms are summed in ascending id


class AllToAllDispatcher(FixedShapeCollective):
    """Each (token, k) pair travels to the rank of its expert and its weighted output comes back.

    Eagerly the rows sent are exactly the pairs (their counts exchanged first); inside :meth:`graph_shapes`
    every rank sends a fixed capacity per peer (:mod:`.ep_padded`), the shapes a captured graph holds."""

    expert_map: ExpertMap | None = None  # EPLB: logical -> physical slots (None: a slot per logical expert)
    layer: int | None = None  # the MoE layer of the map being dispatched (None: an MTP layer)

    def __init__(self, communicator: Communicator, num_experts: int, hidden_size: int):
        world = communicator.world_size
        if num_experts % world:
            raise ValueError(f"{num_experts} routed experts cannot be split evenly over {world} ranks")
        self.comm, self.num_experts, self.hidden_size = communicator, num_experts, hidden_size
        self.world, self.rank = world, communicator.rank
        self.experts_per_rank = num_experts // world

    @property
    def local_experts(self) -> range:
        return range(self.rank * self.experts_per_rank, (self.rank + 1) * self.experts_per_rank)

    def _exchange(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        recv = send.new_empty((sum(recv_counts), *send.shape[1:]))
        if self.world == 1:
            return recv.copy_(send)
        group = getattr(self.comm, "group", None)
        dist.all_to_all_single(recv, send.contiguous(), recv_counts, send_counts, group=group)
        return recv

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, _Handle]:
        """``(recv_x, recv_local_slot_ids, recv_weights, handle)``: the rows this rank's experts compute
        (``topk_ids``: logical experts)."""
        if self.fixed_shapes:
            return padded_dispatch(self, x, topk_ids, topk_weights)
        num_tokens, top_k = topk_ids.shape
        flat = topk_ids.reshape(-1)
        if self.expert_map is not None:
            flat = self.expert_map.physical(self.layer, flat)
        dest = torch.div(flat, self.experts_per_rank, rounding_mode="floor")
        order = torch.argsort(dest, stable=True)
        send_counts = torch.bincount(dest, minlength=self.world)
        recv_counts = self._exchange(send_counts, [1] * self.world, [1] * self.world)
        sc, rc = send_counts.tolist(), recv_counts.tolist()
        rows = torch.div(order, top_k, rounding_mode="floor")
        recv_x = self._exchange(x[rows], sc, rc)
        recv_ids = self._exchange(flat[order], sc, rc) - self.rank * self.experts_per_rank
        recv_w = self._exchange(topk_weights.reshape(-1)[order], sc, rc)
        return recv_x, recv_ids, recv_w, _Handle(order, sc, rc, num_tokens, top_k, topk_ids)

    def combine(self, y: torch.Tensor, handle: _Handle | PaddedHandle) -> torch.Tensor:
        """Weighted expert outputs ``y`` (rows as dispatched) summed back per home token: [T, hidden].

        A token's terms are added one by one onto zeros in ascending expert id, as the one-process MoE
        ops add them, so the sum is the same bit for bit."""
        if isinstance(handle, PaddedHandle):
            return padded_combine(self, y, handle)
        back = self._exchange(y, handle.recv_counts, handle.send_counts)
        pairs = torch.empty_like(back)
        pairs[handle.order] = back
        return sum_in_expert_order(pairs.view(handle.num_tokens, handle.top_k, back.shape[-1]), handle.topk_ids)


def attach_expert_map(dispatcher, num_layers: int, num_logical: int) -> ExpertMap:
    """Give ``dispatcher`` (over ``dispatcher.num_experts`` physical slots) the initial EPLB slot map."""
    if not hasattr(dispatcher, "expert_map"):
        raise ValueError(f"{type(dispatcher).__name__} cannot map logical experts to physical slots, which "
                         "EPLB needs")
    dispatcher.expert_map = ExpertMap.create(num_layers, num_logical, dispatcher.num_experts, dispatcher.world)
    return dispatcher.expert_map


def shard_experts(model, dispatcher, drafter_dispatcher=None) -> None:
    """Keep only ``dispatcher.local_experts`` of every routed-expert stack of ``model``'s target group (main
    layers, and a drafter's without experts of its own) and let its MoE layers dispatch through
    ``dispatcher``; likewise the drafter's own group with ``drafter_dispatcher`` (None: left whole).

    The stacks are sliced after a full load (the other experts' memory is released, the peak is the
    whole model's); loading only the local experts is the loader's part."""
    place_experts(model, list(dispatcher.local_experts), dispatcher.num_experts)
    model.ep = dispatcher
    if drafter_dispatcher is not None:
        place_stacks(drafter_stacks(model), list(drafter_dispatcher.local_experts), drafter_dispatcher.num_experts)
        model.drafter.ep = drafter_dispatcher


def place_experts(model, rows: list[int], expected: int) -> None:
    """Re-stack every routed-expert stack of ``model``'s target group as ``stack[rows]``: a rank's physical
    slots out of the experts it loaded (``expected`` of them in every stack)."""
    place_stacks(target_stacks(model), rows, expected)


def place_stacks(stacks: list[Experts], rows: list[int], expected: int) -> None:
    """Re-stack each of ``stacks`` as ``stack[rows]`` (each must hold ``expected`` experts)."""
    index = torch.tensor(rows, dtype=torch.long)
    for ex in stacks:
        if ex.w13.weight.shape[0] != expected:
            raise ValueError(f"an expert stack holds {ex.w13.weight.shape[0]} experts, the dispatcher "
                             f"shards {expected}")
        for name in ("w13", "w2"):
            lin: Linear = getattr(ex, name)
            scale = None if lin.scale is None else take_rows(lin.scale, index)
            setattr(ex, name, replace(lin, weight=take_rows(lin.weight, index), scale=scale))


def own_drafter_experts(cfg: Any, args: Any) -> int | None:
    """The routed experts of a drafter's own group that expert parallel shards over the ranks: DSpark's
    stages (another count than the target's) with speculative decoding on; None without (a drafter that
    never runs keeps its experts whole, one of the target's count is sharded with the target's)."""
    from deepinfer_core.spec_decode.config import SpeculativeConfig

    moe_config = getattr(cfg, "drafter_moe_config", None)
    if moe_config is None or SpeculativeConfig.from_arg(getattr(args, "speculative_config", None)) is None:
        return None
    num = moe_config()[0]
    return None if num == cfg.n_routed_experts else num


def drafter_experts(model) -> int | None:
    """The routed experts of ``model``'s drafter's own group (None: no drafter, or one that shares the
    target's experts' dispatcher)."""
    return getattr(getattr(model, "drafter", None), "num_experts", None)


def expert_stacks(model) -> list[Experts]:
    """The routed-expert stacks a rank shards: its target's layers' and its drafter's (a checkpoint's
    drafter weights no drafter runs are left whole)."""
    return target_stacks(model) + drafter_stacks(model)


def target_stacks(model) -> list[Experts]:
    """The stacks that dispatch through ``model.ep``: the main layers', and a drafter's without experts of
    its own."""
    stacks = [block.moe.experts for block in model.weights.layers]
    return stacks if drafter_experts(model) is not None else stacks + _drafter_records(model)


def drafter_stacks(model) -> list[Experts]:
    """The stacks of a drafter's own expert group, in the order of its MoE layers (empty where it has
    none)."""
    if drafter_experts(model) is None:
        return []
    return [moe.experts for moe in model.drafter.moe_layers()]


def _drafter_records(model) -> list[Experts]:
    drafter = getattr(model, "drafter", None)
    if drafter is None:
        return []
    return [ex for ex in records(drafter.weights, leaves=(Experts,)) if isinstance(ex, Experts)]


def take_rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t[index]`` along the first dim, through a byte view (FP8/FP4 dtypes have no indexing kernels)."""
    rows = t.contiguous().view(t.shape[0], -1).view(torch.uint8)
    return rows[index.to(t.device)].view(t.dtype).view(len(index), *t.shape[1:])


def graph_collectives(model) -> list[Any]:
    """The model's collectives with a fixed-shape mode (``graph_shapes()``, ``graph_safe``) that a decode
    graph's forward runs in: its expert dispatcher and the lookup of Engram tables sharded over the ranks."""
    return [c for c in (getattr(model, "ep", None), getattr(model, "engram_lookup", None)) if c is not None]


@torch.inference_mode()
def dummy_moe_step(model) -> None:
    """Every MoE layer of the forward with no tokens: the rank takes part in each dispatch and combine,
    and in the lookup collective of Engram tables sharded over the ranks, in the forward's order (a
    speculative step's drafting follows: the proposer's ``dummy_step``)."""
    sharded = getattr(model, "engram_lookup", None)
    for block in model.weights.layers:
        if sharded is not None and getattr(block, "engram", None) is not None:
            cols = (model.cfg.engram_max_ngram_size - 1) * model.cfg.engram_n_heads
            sharded(block.engram, torch.empty((0, cols), dtype=torch.long, device=model.device))
        dummy_moe(model, block.moe)


def dummy_moe(model, moe) -> None:
    """One MoE layer with no tokens (its collectives only)."""
    h = torch.empty((0, model.cfg.hidden_size), dtype=model.dtype, device=model.device)
    model.moe(moe, h, torch.empty((0,), dtype=torch.long, device=model.device))

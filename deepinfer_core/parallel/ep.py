"""Expert-parallel dispatch and combine over ``torch.distributed.all_to_all_single`` (any backend:
gloo, NCCL, HCCL). Routed experts are sharded contiguously: rank ``r`` owns experts
``[r * E / world, (r + 1) * E / world)``.

Also the model side of expert parallelism: :func:`shard_experts` keeps a rank's own experts and hands the
model its dispatcher, :func:`dummy_moe_step` joins every MoE layer's collectives with no tokens (a rank
with nothing scheduled, so that its peers never wait forever)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from deepinfer_core.comm import Communicator
from deepinfer_core.model.weights import Experts, Linear, records


@dataclass
class _Handle:
    order: torch.Tensor  # the (token, k) pairs in send order
    send_counts: list[int]
    recv_counts: list[int]
    num_tokens: int
    top_k: int
    topk_ids: torch.Tensor  # [T, k] global expert ids: a token's terms are summed in ascending id


class AllToAllDispatcher:
    """Each (token, k) pair travels to the rank of its expert and its weighted output comes back."""

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
        dist.all_to_all_single(recv, send.contiguous(), recv_counts, send_counts, group=getattr(self.comm, "group", None))
        return recv

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, _Handle]:
        """``(recv_x, recv_local_expert_ids, recv_weights, handle)``: the rows this rank's experts compute."""
        num_tokens, top_k = topk_ids.shape
        flat = topk_ids.reshape(-1)
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

    def combine(self, y: torch.Tensor, handle: _Handle) -> torch.Tensor:
        """Weighted expert outputs ``y`` (rows as dispatched) summed back per home token: [T, hidden].

        A token's terms are added one by one onto zeros in ascending expert id, as the one-process MoE
        ops add them, so the sum is the same bit for bit."""
        back = self._exchange(y, handle.recv_counts, handle.send_counts)
        pairs = torch.empty_like(back)
        pairs[handle.order] = back
        pairs = pairs.view(handle.num_tokens, handle.top_k, back.shape[-1])
        slots = torch.sort(handle.topk_ids, dim=1, stable=True).indices
        pairs = pairs.gather(1, slots.unsqueeze(-1).expand_as(pairs))
        out = pairs.new_zeros((handle.num_tokens, pairs.shape[-1]))
        for k in range(handle.top_k):
            out += pairs[:, k]
        return out


def shard_experts(model, dispatcher) -> None:
    """Keep only ``dispatcher.local_experts`` of every routed-expert stack of ``model`` (main layers and
    MTP blocks) and let its MoE layers dispatch through ``dispatcher``.

    The stacks are sliced after a full load (the other experts' memory is released, the peak is the
    whole model's); loading only the local experts is the loader's part."""
    local = dispatcher.local_experts
    w = model.weights
    for ex in records([*w.layers, *w.mtp], leaves=(Experts,)):
        if not isinstance(ex, Experts):
            continue
        if ex.w13.weight.shape[0] != dispatcher.num_experts:
            raise ValueError(f"an expert stack holds {ex.w13.weight.shape[0]} experts, the dispatcher "
                             f"shards {dispatcher.num_experts}")
        for name in ("w13", "w2"):
            lin: Linear = getattr(ex, name)
            scale = None if lin.scale is None else lin.scale[local.start:local.stop].clone()
            setattr(ex, name, replace(lin, weight=lin.weight[local.start:local.stop].clone(), scale=scale))
    model.ep = dispatcher


@torch.inference_mode()
def dummy_moe_step(model) -> None:
    """Every MoE layer of the forward, with no tokens: the rank takes part in each dispatch and combine."""
    w = model.weights
    h = torch.empty((0, model.cfg.hidden_size), dtype=model.dtype, device=model.device)
    ids = torch.empty((0,), dtype=torch.long, device=model.device)
    for block in w.layers:
        model.moe(block.moe, h, ids)

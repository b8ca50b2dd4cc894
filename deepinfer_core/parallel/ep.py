"""Expert-parallel dispatch and combine over ``torch.distributed.all_to_all_single`` (any backend:
gloo, NCCL, HCCL). Routed experts are sharded contiguously: rank ``r`` owns experts
``[r * E / world, (r + 1) * E / world)``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from deepinfer_core.comm import Communicator


@dataclass
class _Handle:
    order: torch.Tensor  # the (token, k) pairs in send order
    send_counts: list[int]
    recv_counts: list[int]
    num_tokens: int
    top_k: int


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
        return recv_x, recv_ids, recv_w, _Handle(order, sc, rc, num_tokens, top_k)

    def combine(self, y: torch.Tensor, handle: _Handle) -> torch.Tensor:
        """Weighted expert outputs ``y`` (rows as dispatched) summed back per home token: [T, hidden]."""
        back = self._exchange(y, handle.recv_counts, handle.send_counts)
        out = torch.empty_like(back)
        out[handle.order] = back
        return out.view(handle.num_tokens, handle.top_k, -1).sum(dim=1)

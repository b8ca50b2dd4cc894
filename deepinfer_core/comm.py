"""Communicator and expert-parallel dispatcher protocols (implemented by backends)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist


@runtime_checkable
class Communicator(Protocol):
    rank: int
    world_size: int

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor: ...

    def barrier(self) -> None: ...


@runtime_checkable
class EPDispatcher(Protocol):
    def dispatch(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
        """Send each token to the ranks owning its experts: (recv_x, recv_ids, recv_weights, handle)."""

    def combine(self, y: torch.Tensor, handle: Any) -> torch.Tensor:
        """Return expert outputs to the tokens' home ranks, summed per token."""


class TorchDistributedCommunicator:
    """Collectives over a ``torch.distributed`` group (gloo on CPU, NCCL/HCCL on devices)."""

    def __init__(self, group: Any = None):
        self.group = group
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor.unsqueeze(0)
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(out, tensor, group=self.group)
        return torch.stack(out)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.world_size > 1:
            dist.broadcast(tensor, src=src, group=self.group)
        return tensor

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)

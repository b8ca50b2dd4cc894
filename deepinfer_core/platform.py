"""The device seam: what the core needs of a device beyond tensor ops (graphs, memory, events, copies).

A backend returns its :class:`Platform` from ``deepinfer_platform``; the base class describes a host
device (no graphs, synchronous copies, the KV budget from ``CacheConfig.cpu_kv_cache_bytes``). The
engine, model and sampler never branch on the device type: they ask the platform.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from deepinfer_core.config import CacheConfig

GraphKey = tuple[int, int]  # (batch size, context bucket) of a captured decode graph


class Event(Protocol):
    def record(self) -> None: ...

    def synchronize(self) -> None: ...


class Graph(Protocol):
    """A captured forward: ``replay()`` reruns it; ``output`` is the buffer it writes."""

    output: torch.Tensor

    def replay(self) -> None: ...


class Platform:
    """A host device: everything runs in program order on the CPU."""

    supports_graphs = False
    pin_memory = False  # whether host staging buffers should be page-locked
    measures_memory = False  # whether ``peak_memory_of`` and ``memory_budget`` read the device

    def __init__(self, device: torch.device):
        self.device = device

    @property
    def default_dtype(self) -> torch.dtype:
        return torch.float32

    def synchronize(self) -> None:
        """Wait for all work queued on the device."""

    def new_event(self) -> Event | None:
        """An event recorded after queued work, or ``None`` where work completes in program order."""
        return None

    def to_host(self, tensors: Sequence[torch.Tensor | None]) -> tuple[list[torch.Tensor | None], Event | None]:
        """Start copying ``tensors`` to the host; the event (if any) says when the copies are done."""
        return [t.cpu() if t is not None else None for t in tensors], None

    def upload(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` (a host tensor) on the device, copied without blocking the host where possible."""
        return flat.to(self.device)

    def peak_memory_of(self, fn: Callable[[], Any]) -> int:
        """Device bytes ``fn`` allocates at its peak beyond what is allocated now (0: not measured)."""
        return 0

    def memory_budget(self, cache_config: CacheConfig, reserved_bytes: int = 0) -> int:
        """Bytes the KV pools and state slots may take (after weights and ``reserved_bytes``)."""
        return cache_config.cpu_kv_cache_bytes

    def capture_graphs(self, keys: Sequence[GraphKey], forward: Callable[[GraphKey], torch.Tensor]
                       ) -> dict[GraphKey, Graph]:
        """Capture ``forward(key)`` for every key, a (batch size, context bucket) pair (largest first, one
        memory pool)."""
        raise NotImplementedError(f"{type(self).__name__} cannot capture graphs")

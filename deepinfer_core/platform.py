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


class SideStream:
    """Work started ahead of the layers that read it (``run``), and joined where it is read (``join``). On a
    host device it runs at once, in program order."""

    def run(self, fn: Callable[[], torch.Tensor]) -> Any:
        """Start ``fn`` (its inputs: anything queued so far); a handle for :meth:`join`."""
        return fn()

    def join(self, handle: Any) -> torch.Tensor:
        """The result of a :meth:`run`, ready for work queued from now on."""
        return handle


class _DeviceSideStream(SideStream):
    """A second stream of the device: ``run`` forks from the current stream, ``join`` waits for that one run
    only (an event), so each result is awaited where it is read. Fork and join are stream dependencies, so
    a graph captures the overlap (every run is joined before the forward ends)."""

    def __init__(self, module: Any, device: torch.device):
        self.module, self.stream = module, module.Stream(device)

    def run(self, fn: Callable[[], torch.Tensor]) -> Any:
        mod = self.module
        current = mod.current_stream()
        self.stream.wait_stream(current)
        with mod.stream(self.stream):
            out = fn()
            done = mod.Event()
            done.record()
        if out.device.type != "cpu":  # freed by the current stream: the block waits for its reads there
            out.record_stream(current)
        return out, done

    def join(self, handle: Any) -> torch.Tensor:
        out, done = handle
        self.module.current_stream().wait_event(done)
        return out


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

    def side_stream(self) -> SideStream:
        """Where a model starts reads that later layers consume (Engram rows), overlapping the layers between."""
        return SideStream()

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


class _CapturedGraph:
    def __init__(self, graph: Any, output: torch.Tensor):
        self.graph, self.output = graph, output

    def replay(self) -> None:
        self.graph.replay()


class AcceleratorPlatform(Platform):
    """A device driven through a ``torch.cuda``-shaped module (``torch.cuda``, ``torch.npu``): its events,
    streams, pinned asynchronous copies, memory statistics and graphs. A backend names the module and its
    graph class; the core never imports either."""

    supports_graphs = True
    pin_memory = True
    measures_memory = True
    graph_class_name = "CUDAGraph"  # the module's graph class (``NPUGraph`` on torch.npu)

    def __init__(self, device: torch.device, module: Any):
        super().__init__(device)
        self.module = module

    @property
    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def synchronize(self) -> None:
        self.module.synchronize(self.device)

    def new_event(self) -> Any:
        return self.module.Event()

    def to_host(self, tensors):
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                if t is not None else None for t in tensors]
        event = self.module.Event()
        event.record()
        return host, event

    def upload(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.pin_memory().to(self.device, non_blocking=True)

    def side_stream(self) -> SideStream:
        return _DeviceSideStream(self.module, self.device)

    def peak_memory_of(self, fn: Callable[[], Any]) -> int:
        mod = self.module
        mod.synchronize(self.device)
        mod.reset_peak_memory_stats(self.device)
        base = mod.memory_allocated(self.device)
        fn()
        mod.synchronize(self.device)
        peak = mod.max_memory_allocated(self.device) - base
        mod.empty_cache()
        return peak

    def memory_budget(self, cache_config: CacheConfig, reserved_bytes: int = 0) -> int:
        mod = self.module
        total = mod.get_device_properties(self.device).total_memory
        allocated = mod.memory_allocated(self.device)
        return int(total * cache_config.gpu_memory_utilization) - allocated - reserved_bytes

    def capture_graphs(self, keys: Sequence[GraphKey], forward: Callable[[GraphKey], torch.Tensor]
                       ) -> dict[GraphKey, Graph]:
        """Largest first into one pool; each key runs twice on a side stream first (kernels compile,
        allocations settle)."""
        mod = self.module
        mod.synchronize(self.device)
        pool, graphs = None, {}
        side = mod.Stream(self.device)
        for key in sorted(keys, reverse=True):
            side.wait_stream(mod.current_stream())
            with mod.stream(side):
                for _ in range(2):
                    forward(key)
            mod.current_stream().wait_stream(side)
            graph = getattr(mod, self.graph_class_name)()
            with mod.graph(graph, pool=pool):
                output = forward(key)
            pool = graph.pool()
            graphs[key] = _CapturedGraph(graph, output)
        mod.synchronize(self.device)
        return graphs


"""The CUDA device seam: CUDA graphs, CUDA events, pinned asynchronous copies, CUDA memory statistics."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from deepinfer_core.config import CacheConfig
from deepinfer_core.platform import Graph, GraphKey, Platform


class _CapturedGraph:
    def __init__(self, graph: torch.cuda.CUDAGraph, output: torch.Tensor):
        self.graph, self.output = graph, output

    def replay(self) -> None:
        self.graph.replay()


class CudaPlatform(Platform):
    supports_graphs = True
    pin_memory = True
    measures_memory = True

    @property
    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def new_event(self) -> torch.cuda.Event:
        return torch.cuda.Event()

    def to_host(self, tensors):
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                if t is not None else None for t in tensors]
        event = torch.cuda.Event()
        event.record()
        return host, event

    def upload(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.pin_memory().to(self.device, non_blocking=True)

    def peak_memory_of(self, fn: Callable[[], Any]) -> int:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        fn()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        torch.cuda.empty_cache()
        return peak

    def memory_budget(self, cache_config: CacheConfig, reserved_bytes: int = 0) -> int:
        total = torch.cuda.get_device_properties(self.device).total_memory
        allocated = torch.cuda.memory_allocated(self.device)
        return int(total * cache_config.gpu_memory_utilization) - allocated - reserved_bytes

    def capture_graphs(self, keys: Sequence[GraphKey], forward: Callable[[GraphKey], torch.Tensor]
                       ) -> dict[GraphKey, Graph]:
        """Largest first into one pool; each size runs twice on a side stream first (kernels compile,
        allocations settle)."""
        torch.cuda.synchronize(self.device)
        pool, graphs = None, {}
        side = torch.cuda.Stream(self.device)
        for key in sorted(keys, reverse=True):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    forward(key)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                output = forward(key)
            pool = graph.pool()
            graphs[key] = _CapturedGraph(graph, output)
        torch.cuda.synchronize(self.device)
        return graphs

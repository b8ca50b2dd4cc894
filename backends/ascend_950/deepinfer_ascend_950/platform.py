"""The NPU device seam: ACL graphs, NPU events and streams, pinned asynchronous copies, NPU memory
statistics, all through ``torch.npu`` (the namespace torch_npu installs, mirroring ``torch.cuda``:
``NPUGraph``/``graph`` capture ACL graphs, ``Event``/``Stream``/``synchronize``, ``memory_allocated``,
``max_memory_allocated``, ``reset_peak_memory_stats``, ``get_device_properties(...).total_memory``).

Never run on an Ascend 950: the tests drive it with a fake ``torch.npu`` that records the calls, which
proves the order of the calls (warm-up on a side stream, largest size first, one memory pool) and the
arithmetic, not that ACL graph capture of the decode step works on the device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from deepinfer_core.config import CacheConfig
from deepinfer_core.platform import Graph, Platform


def _npu() -> Any:
    npu = getattr(torch, "npu", None)
    if npu is None:
        raise RuntimeError("torch.npu is missing: import torch_npu (with CANN's environment loaded) first")
    return npu


class _CapturedGraph:
    def __init__(self, graph: Any, output: torch.Tensor):
        self.graph, self.output = graph, output

    def replay(self) -> None:
        self.graph.replay()


class NpuPlatform(Platform):
    supports_graphs = True
    pin_memory = True
    measures_memory = True

    @property
    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def synchronize(self) -> None:
        _npu().synchronize(self.device)

    def new_event(self) -> Any:
        return _npu().Event()

    def to_host(self, tensors):
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                if t is not None else None for t in tensors]
        event = _npu().Event()
        event.record()
        return host, event

    def upload(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.pin_memory().to(self.device, non_blocking=True)

    def peak_memory_of(self, fn: Callable[[], Any]) -> int:
        npu = _npu()
        npu.synchronize(self.device)
        npu.reset_peak_memory_stats(self.device)
        base = npu.memory_allocated(self.device)
        fn()
        npu.synchronize(self.device)
        peak = npu.max_memory_allocated(self.device) - base
        npu.empty_cache()
        return peak

    def memory_budget(self, cache_config: CacheConfig, reserved_bytes: int = 0) -> int:
        npu = _npu()
        total = npu.get_device_properties(self.device).total_memory
        return int(total * cache_config.gpu_memory_utilization) - npu.memory_allocated(self.device) - reserved_bytes

    def capture_graphs(self, sizes: Sequence[int], forward: Callable[[int], torch.Tensor]) -> dict[int, Graph]:
        """ACL graphs, largest first into one pool; each size runs twice on a side stream first (kernels
        compile, allocations settle)."""
        npu = _npu()
        npu.synchronize(self.device)
        pool, graphs = None, {}
        side = npu.Stream(self.device)
        for size in sorted(sizes, reverse=True):
            side.wait_stream(npu.current_stream())
            with npu.stream(side):
                for _ in range(2):
                    forward(size)
            npu.current_stream().wait_stream(side)
            graph = npu.NPUGraph()
            with npu.graph(graph, pool=pool):
                output = forward(size)
            pool = graph.pool()
            graphs[size] = _CapturedGraph(graph, output)
        npu.synchronize(self.device)
        return graphs

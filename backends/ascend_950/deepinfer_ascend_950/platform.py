"""The NPU device seam: ACL graphs, NPU events and streams, pinned asynchronous copies, NPU memory
statistics, all through ``torch.npu`` (the namespace torch_npu installs, mirroring ``torch.cuda``:
``NPUGraph``/``graph`` capture ACL graphs, ``Event``/``Stream``/``synchronize``, ``memory_allocated``,
``max_memory_allocated``, ``reset_peak_memory_stats``, ``get_device_properties(...).total_memory``).

Never run on an Ascend 950: the tests drive it with a fake ``torch.npu`` that records the calls, which
proves the order of the calls (warm-up on a side stream, largest size first, one memory pool) and the
arithmetic, not that ACL graph capture of the decode step works on the device.
"""

from __future__ import annotations

from typing import Any

import torch

from deepinfer_core.platform import AcceleratorPlatform


def _npu() -> Any:
    npu = getattr(torch, "npu", None)
    if npu is None:
        raise RuntimeError("torch.npu is missing: import torch_npu (with CANN's environment loaded) first")
    return npu


class NpuPlatform(AcceleratorPlatform):
    """The core's accelerator platform over ``torch.npu``: ACL graphs are ``NPUGraph``."""

    graph_class_name = "NPUGraph"

    def __init__(self, device: torch.device):
        super().__init__(device, _npu())

"""The CUDA device seam: the core's accelerator platform over ``torch.cuda`` (CUDA graphs, CUDA events,
pinned asynchronous copies, CUDA memory statistics)."""

from __future__ import annotations

import torch

from deepinfer_core.platform import AcceleratorPlatform


class CudaPlatform(AcceleratorPlatform):
    graph_class_name = "CUDAGraph"

    def __init__(self, device: torch.device):
        super().__init__(device, torch.cuda)

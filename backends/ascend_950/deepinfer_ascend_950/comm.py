"""Collectives on Ascend: torch.distributed over HCCL.

The core joins the ranks' group with the device's collective library (``hccl`` for ``npu``,
``deepinfer_core.parallel.process_group``); :class:`HcclCommunicator` wraps that group and refuses one
that is not HCCL, which would otherwise fail at the first collective on NPU tensors. Never run across
NPUs here: the tests check the refusal and the one-rank path.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from deepinfer_core.comm import TorchDistributedCommunicator

BACKEND = "hccl"


class HcclCommunicator(TorchDistributedCommunicator):
    def __init__(self, group: Any = None):
        super().__init__(group)
        if self.world_size > 1:
            backend = str(dist.get_backend(group)).lower()
            if backend != BACKEND:
                raise RuntimeError(
                    f"the ranks' process group uses {backend!r}, but NPU tensors need {BACKEND!r}: initialise "
                    "torch.distributed with backend='hccl' (torch_npu registers it)"
                )

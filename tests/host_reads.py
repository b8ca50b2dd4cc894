"""A dispatch mode that counts what a CUDA graph capture refuses: arrays lifted from host data (a copy from
pageable memory) and ops whose output size or value the host must read from the device."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: ops whose output size or value the host must read from the device: a CUDA graph capture fails on them
_SYNCING = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
            torch.ops.aten.masked_select.default, torch.ops.aten.repeat_interleave.Tensor,
            torch.ops.aten._unique2.default, torch.ops.aten.unique_consecutive.default}


class HostReads(TorchDispatchMode):
    """Counts (``lifted``) the arrays built from host data and the device values read on the host while
    it is active: a CUDA graph capture fails on either."""

    def __init__(self):
        super().__init__()
        self.lifted = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _SYNCING:
            self.lifted += 1
        # a Python scalar written into a tensor is lifted as a 0-dim host tensor: its value is baked into the
        # capture (as CUDA graphs do), so only lifted arrays count
        if func is torch.ops.aten.lift_fresh.default and args[0].dim() > 0:
            self.lifted += 1
        return func(*args, **(kwargs or {}))

"""Launcher of the ``engram_lookup`` Triton kernel (:mod:`.engram_kernels`), catalogue signature.

Where the table lives decides how it is read (decided once per table, remembered by its address):

- on the device: read there;
- pinned host memory (``engram_placement="host"`` in one process): read in place by the kernel over
  unified addressing, through a CUDA tensor aliasing the host pointer (``__cuda_array_interface__``);
- a host copy in ``/dev/shm`` shared by a node's ranks: registered with the driver once
  (``cudaHostRegister``, read-only, mapped), then read in place like pinned memory;
- a view of the checkpoint file's mapping (``"file"``): the rows are gathered on the host and copied over
  (the core's native body: a device-to-host copy of the ids, so not graph-safe); registering the mapping would
  pin the whole file in memory, which is what ``file`` exists to avoid.

E8M0 scales only in the kernel; float32 scales go to the native body. No host synchronisation on the
device and pinned paths: the kernel can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools

import torch

from deepinfer_core.model.mapped import residence
from deepinfer_core.ops.native import engram_lookup as native_engram_lookup

#: cudaHostRegisterMapped | cudaHostRegisterReadOnly
_REGISTER_FLAGS = 0x02 | 0x08
#: host tables registered with the driver here, by address, each held so that it stays mapped: its range
#: stays registered while the process lives, and a range unmapped while registered makes a later mapping at
#: that address fail (cudaErrorAlreadyMapped)
_REGISTERED: dict[int, torch.Tensor] = {}


@functools.lru_cache(maxsize=1)
def _kernels():
    from deepinfer_nvidia_sm100 import engram_kernels

    return engram_kernels


class _DeviceAlias:
    """A host buffer the GPU can address, described as CUDA memory so that torch makes a CUDA tensor of it."""

    def __init__(self, t: torch.Tensor):
        self.__cuda_array_interface__ = {"shape": (t.numel() * t.element_size(),), "typestr": "|u1",
                                         "data": (t.data_ptr(), False), "version": 3, "strides": None}


#: (host address, bytes, device) -> its CUDA alias, made once per table
_ALIASES: dict[tuple[int, int, str], torch.Tensor] = {}


def device_view(t: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """``t`` as the device reads it: itself on the device; a uint8 CUDA alias of pinned or registered host
    memory; None for a host tensor the GPU cannot read in place (a file's mapping)."""
    if t.device.type == "cuda":
        return t.view(torch.uint8)
    key = (t.data_ptr(), t.numel() * t.element_size(), str(device))
    if key not in _ALIASES:
        if not t.is_pinned():
            where = residence(t)
            if not where.startswith("/dev/shm/"):
                return None
            if t.data_ptr() not in _REGISTERED:
                err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), key[1], _REGISTER_FLAGS)
                if int(err) != 0:
                    raise RuntimeError(f"cudaHostRegister of the shared Engram table ({where}) failed: {err}")
                _REGISTERED[t.data_ptr()] = t
        with torch.cuda.device(device):
            _ALIASES[key] = torch.as_tensor(_DeviceAlias(t), device=device)
    return _ALIASES[key]


def engram_lookup(ids: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, row_start: int) -> torch.Tensor:
    if scale.dtype != torch.float8_e8m0fnu or ids.device.type != "cuda":
        return native_engram_lookup(ids, weight, scale, row_start)
    rows = device_view(weight, ids.device)
    scales = device_view(scale, ids.device)
    if rows is None or scales is None:  # a file's mapping: gathered on the host
        return native_engram_lookup(ids, weight, scale, row_start)
    tokens, cols = ids.shape
    d = weight.shape[-1]
    out = torch.empty((tokens, cols * d), dtype=torch.float32, device=ids.device)
    if tokens * cols:
        _kernels().engram_lookup_kernel[(tokens * cols,)](
            ids.contiguous(), rows, scales, out, int(row_start), weight.shape[0], D=d, GROUPS=scale.shape[-1],
            BLOCK_D=triton_pow2(d), num_warps=4 if d >= 256 else 1)
    return out


def triton_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


ALL_OPS = {"engram_lookup": engram_lookup}

"""The process group of a multi-rank engine: torch.distributed over the environment torchrun sets
(``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``; the data-parallel front-end sets the same for
the ranks it spawns), with the collective library of the device: gloo on CPU, NCCL on CUDA, HCCL on
Ascend."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

#: device type -> torch.distributed backend (anything else: gloo)
DIST_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
STARTUP_TIMEOUT_S = 600.0  # joining the group: the ranks may load a large model at different speeds
_GROUP = None  # the engine's group: every rank, collectives bounded by the engine's timeout
_HOST_GROUP = None  # the same ranks over gloo, for small host-side agreements (None: _GROUP is gloo already)


def dist_backend(device: torch.device) -> str:
    return DIST_BACKENDS.get(device.type, "gloo")


def world_group() -> object | None:
    """The engine's group of all ranks when this process is one rank of several, else None."""
    if _GROUP is not None:
        return _GROUP
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def host_group() -> object | None:
    """The engine's ranks over gloo (host tensors, no device sync): on the CPU the engine's group itself."""
    return _HOST_GROUP if _HOST_GROUP is not None else world_group()


def init_process_group(device: torch.device, world_size: int, timeout_s: float) -> None:
    """Join the ranks' default group (once per process; the rendezvous waits up to
    ``STARTUP_TIMEOUT_S``), then make the engine's group of all ranks, whose every collective fails after
    ``timeout_s`` instead of waiting forever for a dead or hung peer."""
    global _GROUP, _HOST_GROUP
    if world_size <= 1 or dist.is_initialized():
        return
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if name not in os.environ]
    if missing:
        raise RuntimeError(f"a rank of {world_size} needs {', '.join(missing)} in its environment (set by torchrun "
                           "or by the data-parallel front-end)")
    if int(os.environ["WORLD_SIZE"]) != world_size:
        raise RuntimeError(f"WORLD_SIZE is {os.environ['WORLD_SIZE']} but the engine runs {world_size} ranks")
    kwargs = {}
    if device.type != "cpu":
        kwargs["device_id"] = device
    dist.init_process_group(dist_backend(device), init_method="env://",
                            timeout=timedelta(seconds=max(timeout_s, STARTUP_TIMEOUT_S)), **kwargs)
    _GROUP = dist.new_group(list(range(world_size)), timeout=timedelta(seconds=timeout_s))
    if dist_backend(device) != "gloo":
        _HOST_GROUP = dist.new_group(list(range(world_size)), timeout=timedelta(seconds=timeout_s), backend="gloo")


def destroy_process_group() -> None:
    global _GROUP, _HOST_GROUP
    _GROUP = _HOST_GROUP = None
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()

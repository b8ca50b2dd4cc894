"""Tensors that live outside the process's anonymous memory: views of a safetensors file's mapping, and host
copies in shared memory that every rank of a node maps (one copy per node). Used for tables too large to
copy per process (DeepSeek-V4.1's Engram tables: 203 GB).

- :func:`file_view`: a tensor of a checkpoint file, read in place. The file is mapped read-only
  (``MAP_SHARED``): its pages are the kernel's page cache, shared by every process that maps the file, read
  from disk on first touch (page by page: the mapping is advised random access, no read-ahead), dropped
  under memory pressure, never counted as the process's anonymous memory (a step's lookups map the pages they
  read: ``RssFile``, shared). A write to the view faults (the mapping is read-only): nothing can copy it
  behind our back.
- :func:`shared_host_tensor`: an empty host tensor backed by a file in ``/dev/shm`` that the ranks of a node
  map together; :func:`node_shared` fills it once per node.
- :func:`residence`: where a tensor's bytes are (a device, a file mapping, anonymous memory), from
  ``/proc/self/maps``: what the tests check a placement against.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = ["file_view", "node_shared", "residence", "safetensors_entry", "shared_host_tensor"]

#: safetensors dtype codes -> torch (the ones a mapped table holds)
_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu, "U8": torch.uint8, "I8": torch.int8,
           "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
#: open mappings by file: one mapping per file however many tensors are viewed in it
_MAPS: dict[Path, mmap.mmap] = {}


def safetensors_entry(file: Path, key: str) -> tuple[int, int, torch.dtype, tuple[int, ...]]:
    """(byte offset in ``file``, byte count, dtype, shape) of tensor ``key``, from the file's header."""
    with open(file, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    entry = header[key]
    start, stop = entry["data_offsets"]
    if entry["dtype"] not in _DTYPES:
        raise ValueError(f"{key!r} in {file.name} is {entry['dtype']}, which a file view does not read")
    return 8 + size + start, stop - start, _DTYPES[entry["dtype"]], tuple(entry["shape"])


def file_view(file: str | Path, key: str) -> torch.Tensor:
    """Tensor ``key`` of safetensors ``file`` as a view of the file's read-only mapping (no copy)."""
    file = Path(file).resolve()
    offset, nbytes, dtype, shape = safetensors_entry(file, key)
    if file not in _MAPS:
        with open(file, "rb") as f:
            _MAPS[file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if hasattr(mmap, "MADV_RANDOM"):  # rows are read at random: a fault reads its page, not megabytes ahead
            _MAPS[file].madvise(mmap.MADV_RANDOM)
    with warnings.catch_warnings():  # "not writable": by design, the mapping is read-only
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(_MAPS[file], dtype=torch.uint8, offset=offset, count=nbytes)
    return flat.view(dtype).view(shape)


def shared_host_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, create: bool) -> torch.Tensor:
    """A host tensor backed by ``/dev/shm/<name>`` (created, and sized, when ``create``), mapped shared: every
    process that maps the name sees the same pages."""
    nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
    path = Path("/dev/shm") / name
    if create:
        with open(path, "wb") as f:
            f.truncate(nbytes)
    flat = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
    return flat.view(dtype).view(shape)


def node_shared(name: str, shape: tuple[int, ...], dtype: torch.dtype, fill: Callable[[torch.Tensor], None],
                group: object | None = None) -> torch.Tensor:
    """One host copy per node: the first rank of each node (by host name, over ``group``'s ranks, the world
    by default) creates ``/dev/shm/<name>`` and ``fill``s it; the node's other ranks map it once it is
    filled; the name is then unlinked (the mappings keep the pages until the last rank lets go). Without a
    process group: a private tensor filled here."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        out = torch.empty(shape, dtype=dtype)
        fill(out)
        return out
    hosts: list[str] = [""] * dist.get_world_size(group)
    dist.all_gather_object(hosts, os.uname().nodename, group=group)
    rank = dist.get_rank(group)
    first = hosts.index(hosts[rank]) == rank
    if first:
        out = shared_host_tensor(name, shape, dtype, create=True)
        fill(out)
    dist.barrier(group)  # filled
    if not first:
        out = shared_host_tensor(name, shape, dtype, create=False)
    dist.barrier(group)  # mapped everywhere
    if first:
        (Path("/dev/shm") / name).unlink(missing_ok=True)
    return out


def residence(t: torch.Tensor) -> str:
    """Where ``t``'s bytes are: ``"device:<type>"`` off the host; for a host tensor the file its address is a
    mapping of (``/dev/shm/...`` for shared memory, with `` (deleted)`` once unlinked), or ``"anonymous"``
    (the process's own memory: the heap, or an anonymous mapping); ``"unknown"`` without ``/proc``."""
    if t.device.type != "cpu":
        return f"device:{t.device.type}"
    address = t.untyped_storage().data_ptr()
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return "unknown"
    for line in lines:
        fields = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= address < hi:
            path = fields[5] if len(fields) > 5 else ""
            return path if path.startswith("/") else "anonymous"
    return "unknown"

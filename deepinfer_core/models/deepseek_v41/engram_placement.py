"""Where DeepSeek-V4.1's Engram tables live (the ``engram_placement`` engine argument) and how they are read.

The two tables of the release hold 202.76 GB of FP8 rows (264 B a row with its E8M0 scales), 40% of the
checkpoint; every token reads ``(max_ngram_size - 1) * n_heads`` random rows per Engram layer.

- ``"device"``: read onto the model's device by the loader like every other weight.
- ``"host"``: a host copy, pinned where the device is an accelerator (its kernels read the rows in place over
  unified addressing); under several ranks one copy per node in shared memory
  (:func:`~deepinfer_core.model.mapped.node_shared`). The table is never on the device.
- ``"file"``: a view of the checkpoint's own safetensors mapping (:func:`~deepinfer_core.model.mapped.file_view`):
  never copied, its pages the kernel's page cache (one copy per node whatever the ranks), read on first touch.
  Its values are not scanned at load (that would read the whole table from disk); the scales are mapped
  too where the file holds them as E8M0, else converted (1/33 of the table).

Either way the values looked up are the same bytes, so the three placements give bit-identical logits.
``engram_shard=True`` (several ranks) splits the table's rows over the ranks instead, each rank holding
``1/world`` of them on its placement; :class:`ShardedEngramLookup` is the lookup collective.

The default placement is the memory plan's (:func:`~deepinfer_core.parallel.memory_plan.choose_engram_placement`)
and is logged.
"""

from __future__ import annotations

import hashlib
import logging
import math
from pathlib import Path
from typing import Any

import torch

from deepinfer_core.model.errors import CheckpointError
from deepinfer_core.model.mapped import file_view, node_shared
from deepinfer_core.parallel.fixed_shapes import FixedShapeCollective
from deepinfer_core.quant.fp4 import E8M0_DTYPE, e8m0_from_float

logger = logging.getLogger(__name__)

PLACEMENTS = ("device", "host", "file")
#: rows copied (and scanned for NaN) at a time when a host copy is filled
_CHUNK_ROWS = 1 << 20

__all__ = ["PLACEMENTS", "ShardedEngramLookup", "place_tables", "resolve_placement", "shard_rows", "table_bytes",
           "table_names"]


def table_names(cfg: Any) -> list[str]:
    """The canonical names of ``cfg``'s Engram tables (their scales are ``name + "_scale"`` once loaded)."""
    return [f"layers.{layer}.engram.embed.weight" for layer in cfg.engram_layer_ids]


def table_bytes(cfg: Any) -> int:
    """Bytes of every Engram table as kept: E4M3 rows plus an E8M0 scale per 32 values."""
    hd = cfg.engram_head_dim
    return sum(rows * (hd + math.ceil(hd / 32)) for rows in cfg.engram_num_embeddings)


def shard_rows(rows: int, rank: int, world: int) -> range:
    """The rows rank ``rank`` of ``world`` holds of a table of ``rows`` (DeepSeek's split: ceil(rows / world)
    each, the last rank fewer)."""
    part = -(-rows // world)
    return range(min(rank * part, rows), min((rank + 1) * part, rows))


def resolve_placement(cfg: Any, placement: str | None, device: torch.device | str, other_bytes: int = 0) -> str:
    """``placement`` checked, or the memory plan's choice for ``cfg``'s tables beside ``other_bytes`` of other
    weights on ``device``; logged either way."""
    from deepinfer_core.parallel.memory_plan import choose_engram_placement

    size = table_bytes(cfg)
    if placement is None:
        placement, why = choose_engram_placement(size, torch.device(device), other_bytes)
    elif placement not in PLACEMENTS:
        raise ValueError(f"unknown engram_placement {placement!r}; expected one of {PLACEMENTS}")
    else:
        why = "as asked"
    logger.info("Engram tables (%.2f GB): placement %r (%s)", size / 1e9, placement, why)
    return placement


def _pinned(device: torch.device) -> bool:
    return device.type != "cpu"


def place_tables(cfg: Any, entries: dict[str, Any], placement: str, device: torch.device | str,
                 shard: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """The Engram tables of the checkpoint whose file entries (canonical name -> the loader's entry: ``file``,
    ``key``) are ``entries``, as parameters (``name`` E4M3 rows, ``name + "_scale"`` E8M0 scales) on
    ``placement``; ``shard=(rank, world)``: only that rank's rows. Every placement starts from the file's
    mapping: ``"device"`` copies it to the device, ``"host"`` to host memory, ``"file"`` keeps the view."""
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown engram_placement {placement!r}; expected one of {PLACEMENTS}")
    device = torch.device(device)
    params: dict[str, torch.Tensor] = {}
    for name in table_names(cfg):
        weight_entry, scale_entry = entries[name], entries[name.removesuffix(".weight") + ".scale"]
        weight = file_view(weight_entry.file, weight_entry.key)
        scale = file_view(scale_entry.file, scale_entry.key)
        if weight.dtype != torch.float8_e4m3fn:
            raise CheckpointError(f"Engram table {name} ({weight_entry.file.name}) is {weight.dtype}; a host or "
                                  "file placement reads it as stored, E4M3")
        rows = shard_rows(weight.shape[0], *shard) if shard else range(weight.shape[0])
        weight, scale = weight[rows.start:rows.stop], scale[rows.start:rows.stop]
        if scale.dtype != E8M0_DTYPE:  # small: converted into host memory
            scale = e8m0_from_float(scale.float())
        if placement == "host":
            where = f"{Path(weight_entry.file).resolve()}:{name}:{rows.start}"  # the same on every rank
            tag = "deepinfer-engram-" + hashlib.sha1(where.encode()).hexdigest()[:16]
            weight = _host_copy(tag, weight, device, name)
            scale = _host_copy(tag + "-scale", scale, device, name)
        elif placement == "device":
            weight, scale = _device_copy(weight, device, name), _device_copy(scale, device, name)
        params[name], params[name + "_scale"] = weight, scale
    return params


def _filler(source: torch.Tensor, name: str):
    """Fills a tensor of ``source``'s shape from it chunk by chunk (a file view is read once, never whole
    into a temporary), refusing NaN rows as the loader does."""

    def fill(out: torch.Tensor) -> None:
        for start in range(0, source.shape[0], _CHUNK_ROWS):
            chunk = source[start:start + _CHUNK_ROWS]
            if chunk.dtype == torch.float8_e4m3fn and ((chunk.view(torch.uint8) & 0x7F) == 0x7F).any():
                raise CheckpointError(f"Engram table {name} holds NaN in rows {start}..{start + len(chunk) - 1}")
            out[start:start + _CHUNK_ROWS].copy_(chunk)

    return fill


def _device_copy(source: torch.Tensor, device: torch.device, name: str) -> torch.Tensor:
    out = torch.empty(tuple(source.shape), dtype=source.dtype, device=device)
    _filler(source, name)(out)
    return out


def _host_copy(tag: str, source: torch.Tensor, device: torch.device, name: str) -> torch.Tensor:
    """``source`` (a file view) copied to host memory chunk by chunk, refusing NaN rows as the loader does:
    one copy per node in shared memory under several ranks, else private (pinned for an accelerator)."""

    fill = _filler(source, name)

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return node_shared(tag, tuple(source.shape), source.dtype, fill)  # pinned by the backend's lookup
    out = torch.empty(tuple(source.shape), dtype=source.dtype, pin_memory=_pinned(device))
    fill(out)
    return out


class ShardedEngramLookup(FixedShapeCollective):
    """The lookup collective of tables whose rows are sharded over the ranks of ``group``: every rank's ids
    are gathered, each rank looks its rows up for all of them (``engram_lookup`` with its ``row_start``: the
    others' rows come back all bits clear), and ``all_to_all`` returns each rank the lookups of its own ids,
    summed as int32 bit patterns (one owner a row, zeros elsewhere: exact). Eagerly the ranks may carry
    different token counts (attention data parallel): their counts are gathered and read on the host first.
    Inside :meth:`graph_shapes` (a decode graph's forward, which every rank runs at the same padded count)
    nothing is read back, so a graph captures it."""

    def __init__(self, ops: Any, group: Any, row_start: dict[int, int]):
        self.ops, self.group, self.row_start = ops, group, row_start  # id(table weight) -> its first row

    def __call__(self, engram: Any, rows: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        world = dist.get_world_size(self.group)
        cols, width = rows.shape[1], engram.table.weight.shape[1]
        most = rows.shape[0]
        if not self.fixed_shapes:
            count = torch.tensor([rows.shape[0]], dtype=torch.long, device=rows.device)
            counts = [torch.zeros_like(count) for _ in range(world)]
            dist.all_gather(counts, count, group=self.group)
            most = int(torch.cat(counts).max())
        padded = torch.zeros((most, cols), dtype=rows.dtype, device=rows.device)
        padded[: rows.shape[0]] = rows
        gathered = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(gathered, padded, group=self.group)
        start = self.row_start[id(engram.table.weight)]
        local = self.ops.engram_lookup(torch.cat(gathered), engram.table.weight, engram.table.scale, start)
        received = torch.empty_like(local)
        dist.all_to_all_single(received, local.contiguous(), group=self.group)
        bits = received.view(torch.int32).view(world, most, cols * width).sum(0, dtype=torch.int32)
        return bits.view(torch.float32)[: rows.shape[0]]

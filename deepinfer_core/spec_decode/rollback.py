"""Rollback of rejected draft tokens: an undo log of every cache row a verification's draft tokens write.

Before the verification forward, the rows that draft tokens are about to write are copied aside with the
token that writes each one: window KV slots, compressed entries and indexer keys of windows they close,
boundary records of block ends they cross, and compressor ring rows (the unfinished windows, CSA overlap
included). Once acceptance is known, every row written by a rejected token gets its old value back, so the
cache is exactly as if the step had only computed the accepted tokens. The restore runs on the device
from the acceptance counts, without waiting for the host; after a verification graph, it replays a graph
of its own (``GraphUndo.capture_restores``) instead of launching its copies one by one.

Rows of one pool written by one step are distinct as long as a verification's tokens fall on distinct
ring rows (``SpeculativeConfig`` caps the drafts so); -1 rows (the trash) may repeat and stay trash.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from deepinfer_core.model.cache import ModelCache
from deepinfer_core.model.metadata import ForwardBatch


@dataclass
class _Saved:
    pool: torch.Tensor
    rows: torch.Tensor  # [R] rows of ``pool`` (device)
    owner: torch.Tensor  # [R] batch token that writes each row (device)
    values: torch.Tensor  # [R, D] the rows before the forward


_Rows = list[tuple[object, torch.Tensor, torch.Tensor]]


def _written_rows(host: ForwardBatch, draft: torch.Tensor) -> dict[str, _Rows]:
    """For each kind of write: (key, rows, owner token) restricted to rows draft tokens write (host)."""
    out: dict[str, list] = {"window": [], "entries": [], "ring": [], "boundary": []}
    tokens = torch.arange(len(host.positions))
    keep = draft[tokens]
    out["window"].append((None, host.window_slots[keep], tokens[keep]))
    for key, meta in host.compressors.items():
        rate = key[0]
        fresh_base = len(meta.ring_read)
        if meta.entry_slots.numel():
            owner = meta.cur_idx[:, -1] - fresh_base  # the token that closes the window
            sel = draft[owner]
            out["entries"].append((key, meta.entry_slots[sel], owner[sel]))
        sel = draft[meta.ring_write_src]
        out["ring"].append((key, meta.ring_write[sel], meta.ring_write_src[sel]))
        if meta.boundary_dst.numel():
            owner = meta.boundary_src[:, -1] - fresh_base  # the token at the block's last position
            sel = draft[owner] & (meta.boundary_dst >= 0)
            rows = (meta.boundary_dst[sel].unsqueeze(1) * rate + torch.arange(rate)).flatten()
            out["boundary"].append((key, rows, owner[sel].repeat_interleave(rate)))
    return out


def _every_written_row(batch: ForwardBatch) -> dict[str, _Rows]:
    """:func:`_written_rows` for every token of ``batch`` (on its device), in shapes fixed by the batch's
    layout: what a captured graph saves. Rows no token writes (a window that does not close, a block end
    not crossed) are -1, the trash."""
    out: dict[str, list] = {"window": [], "entries": [], "ring": [], "boundary": []}
    device = batch.positions.device
    out["window"].append((None, batch.window_slots, torch.arange(batch.num_tokens, device=device)))
    for key, meta in batch.compressors.items():
        rate, fresh_base = key[0], meta.ring_read.shape[0]
        if meta.entry_slots.numel():
            out["entries"].append((key, meta.entry_slots, meta.cur_idx[:, -1] - fresh_base))
        out["ring"].append((key, meta.ring_write, meta.ring_write_src))
        if meta.boundary_dst.numel():
            rows = meta.boundary_dst.unsqueeze(1) * rate + torch.arange(rate, device=device)
            rows = torch.where(meta.boundary_dst.unsqueeze(1) >= 0, rows, -1).flatten()
            owner = (meta.boundary_src[:, -1] - fresh_base).repeat_interleave(rate)
            out["boundary"].append((key, rows, owner))
    return out


class CacheUndo:
    """The undo log of one verification step over ``cache`` (the main model's layers only): the rows the
    draft tokens of ``host`` (a host batch) write. :meth:`every_token` saves every token's rows instead,
    from a batch on the device and without the host: what a verification graph captures."""

    def __init__(self, cache: ModelCache, host: ForwardBatch | None, draft: torch.Tensor | None, num_layers: int,
                 device: torch.device | None = None, written: dict[str, _Rows] | None = None,
                 buffers: list[torch.Tensor] | None = None):
        self.saved: list[_Saved] = []
        self.restore_graph: tuple[Any, torch.Tensor] | None = None  # (graph, its rejected mask)
        self.num_tokens = None if host is None else len(host.positions)
        if written is None:  # each kind's rows go to the device once, not once per layer and pool that reads them
            written = {kind: [(key, rows.to(device), owner.to(device)) for key, rows, owner in items if rows.numel()]
                       for kind, items in _written_rows(host, draft).items()}

        def save(pool: torch.Tensor, rows: torch.Tensor, owner: torch.Tensor) -> None:
            values = pool[rows]  # advanced indexing copies (row -1: the trash)
            if buffers is not None:  # into the caller's buffers, in order (shared by every graph of one query length)
                i = len(self.saved)
                if i == len(buffers):
                    buffers.append(torch.empty_like(values))
                values = buffers[i][: rows.shape[0]].copy_(values)
            self.saved.append(_Saved(pool, rows, owner, values))

        layers = range(num_layers)  # each pool these layers write, once however many layers read it
        for _, rows, owner in written["window"]:
            for pid in cache.layout.window_pools_of(layers):
                save(cache.window_pools[pid], rows, owner)
        for pid, branch in cache.layout.pools_of(layers):
            key = (branch.rate, branch.overlap)
            for k, rows, owner in written["entries"]:
                if k == key:
                    save(cache.entry_pools[pid], rows, owner)
            for k, rows, owner in written["ring"]:
                if k == key and cache.state_pools[pid] is not None:
                    for ring in cache.state_pools[pid]:
                        save(ring, rows, owner)
            for k, rows, owner in written["boundary"]:
                if k == key and cache.boundary_pools[pid] is not None:
                    for record in cache.boundary_pools[pid]:
                        save(record, rows, owner)

    @classmethod
    def every_token(cls, cache: ModelCache, batch: ForwardBatch, num_layers: int,
                    buffers: list[torch.Tensor] | None = None) -> CacheUndo:
        """The rows every token of ``batch`` writes, saved without the host (capturable); with ``buffers``
        the values go to those tensors (appended when missing: the largest batch must come first)."""
        undo = cls(cache, None, None, num_layers, written=_every_written_row(batch), buffers=buffers)
        undo.num_tokens = batch.num_tokens
        return undo

    def restore(self, rejected: torch.Tensor) -> None:
        """Put back every saved row whose writing token is ``rejected`` (bool [T], device)."""
        if self.restore_graph is None:
            self.restore_rows(rejected)
            return
        graph, mask = self.restore_graph
        with torch.inference_mode():  # the mask was made in the capture's
            mask.copy_(rejected)
        graph.replay()

    def restore_rows(self, rejected: torch.Tensor) -> None:
        """:meth:`restore` by its copies. A row to keep is sent to row -1, the pool's trash, so each pool
        costs one write (the targets are worked out once per set of rows, which every layer's pools of a
        kind share)."""
        targets: dict[int, torch.Tensor] = {}
        for s in self.saved:
            target = targets.get(id(s.rows))
            if target is None:
                target = targets[id(s.rows)] = torch.where(rejected[s.owner], s.rows, -1)
            s.pool[target] = s.values


class GraphUndo:
    """The verification graphs' prologue (``GraphRunner(prologue=...)``): every token's cache rows saved
    inside the graph, before its forward, so that the host neither lays them out nor launches the copies.
    Inside a capture the values go to buffers every graph of one query length shares (the largest batch
    is captured first); decode graphs (query length 1) save nothing."""

    def __init__(self, cache: ModelCache, num_layers: int):
        self.cache, self.num_layers = cache, num_layers
        self.buffers: dict[int, list[torch.Tensor]] = {}

    def __call__(self, batch: ForwardBatch, query_len: int, shared: bool) -> CacheUndo | None:
        if query_len == 1:
            return None
        buffers = self.buffers.setdefault(query_len, []) if shared else None
        return CacheUndo.every_token(self.cache, batch, self.num_layers, buffers)

    def capture_restores(self, platform: Any, undos: dict[Any, CacheUndo | None]) -> None:
        """Per verification graph (key -> the undo log its capture returned), a graph of that log's
        restore from a mask of its own; the warm-up runs' all-False mask sends every row to the trash."""
        undos = {key: undo for key, undo in undos.items() if undo is not None and undo.saved}
        masks = {key: torch.zeros(undo.num_tokens, dtype=torch.bool, device=undo.saved[0].pool.device)
                 for key, undo in undos.items()}
        graphs = platform.capture_graphs(list(undos), lambda key: undos[key].restore_rows(masks[key])) if undos else {}
        for key, undo in undos.items():
            undo.restore_graph = (graphs[key], masks[key])

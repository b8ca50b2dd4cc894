"""The model's cache tensors: paged pools and per-sequence state slots, one set per pool of the model's
:class:`~deepinfer_core.model.cache_layout.CacheLayout` (a pool several layers read is allocated once).

* window pool (every layer): ``[num_window_blocks * block_size, head_dim]``, one row per source token;
  only blocks the sliding window still covers need to be resident.
* compressed pool (CSA/HCA layers): ``[num_blocks * block_size // rate, head_dim]``, one row per
  compressed entry, kept for the whole sequence; CSA layers also keep indexer keys the same way.
* state slots (CSA/HCA layers): the projected ``kv`` and ``gate`` (position bias added) of the last
  ``rows`` source tokens, where rows = 2 x rate with overlapping windows (CSA) and rate without (HCA),
  at least ``MIN_RING_ROWS`` (``cache_layout.ring_rows``).
* boundary records (overlapping compressors only), one per compressed block: the first-half
  features of the last window before the block's end, which the next window mixes in. With them a
  prefix-cache hit at a block boundary restores the compressor state exactly.

A block id addresses the same span of ``block_size`` source tokens in every layer of its pool.
Every pool has one extra block (and every ring one extra slot) after the last the block manager hands
out: the trash. A write to row, block or slot -1 lands there by negative indexing (windows that close
before a request's ``write_from``, the padding rows of a captured graph), so no write needs a
data-dependent mask; reads treat -1 as "no row".

Entry dtypes, widths and the block size come from a :class:`~deepinfer_core.model.kv_cache_spec.KVCacheSpec`
(by default the model's dtype: :meth:`KVCacheSpec.default`). In its ``fp8_ds`` layout the window and
compressed pools are uint8 ``[rows, entry_bytes]``, one DeepSeek FP8 entry a row
(:mod:`deepinfer_core.quant.kv_fp8`); a NaN ``fill`` then fills them with 0xFF bytes, which read as NaN.
"""

from __future__ import annotations

import torch

from deepinfer_core.config import ModelConfig
from deepinfer_core.model.cache_layout import BranchSpec, LayerCache, cache_layout, check_block_size
from deepinfer_core.model.kv_cache_spec import KVCacheSpec, check_kv_cache_spec, state_dtype

#: the V4 family's name for a branch's geometry (kept for the code that reads it)
CompressorSpec = BranchSpec


def _spec(cfg: ModelConfig, block_size: int, dtype: torch.dtype, spec: KVCacheSpec | None) -> KVCacheSpec:
    if spec is None:
        check_block_size(cfg, block_size)
        return KVCacheSpec.default(cfg, block_size, dtype)
    check_kv_cache_spec(spec, cfg, block_size)
    return spec


def branch_bytes_per_block(branch: BranchSpec, spec: KVCacheSpec) -> int:
    """Bytes one block costs in one branch pool: its entries and, with overlap, its boundary records."""
    if branch.kv_entry:
        out = spec.compressed_bytes_per_block(branch.rate)
    elif spec.is_fp4:  # packed indexer keys
        out = spec.compressed_bytes_per_block(branch.rate, indexer=True)
    else:  # dense values of the branch's own width (indexer keys: index_head_dim)
        out = spec.block_size // branch.rate * branch.dim * spec.dtype.itemsize
    if branch.stateful and branch.overlap:  # the boundary records
        out += 2 * branch.rate * branch.dim * spec.state_dtype.itemsize
    return out


def layer_bytes_per_block(layer: LayerCache, spec: KVCacheSpec) -> tuple[int, int]:
    """(compressed-pool bytes, window-pool bytes) that one block costs in the pools one layer owns."""
    comp = sum(branch_bytes_per_block(layer.specs[kind], spec) for kind in layer.owned)
    return comp, spec.window_bytes_per_block


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype,
                    spec: KVCacheSpec | None = None) -> tuple[int, int]:
    """(compressed-pool bytes, window-pool bytes) that one block costs across all pools (each once), in
    the layout of ``spec`` (default: ``dtype`` entries)."""
    spec = _spec(cfg, block_size, dtype, spec)
    layout = cache_layout(cfg)
    comp = sum(branch_bytes_per_block(branch, spec) for branch in layout.branch_pools)
    return comp, len(layout.window_owners) * spec.window_bytes_per_block


def bytes_per_state_slot(cfg: ModelConfig, dtype: torch.dtype, spec: KVCacheSpec | None = None) -> int:
    elt = (spec.state_dtype if spec is not None else state_dtype(dtype)).itemsize
    return sum(2 * b.rows * b.source_dim * elt for b in cache_layout(cfg).branch_pools if b.stateful)


class ModelCache:
    """Allocates and owns every cache tensor; the engine's BlockManager decides which rows are whose."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        num_window_blocks: int,
        num_state_slots: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        fill: float = 0.0,
        spec: KVCacheSpec | None = None,
    ):
        self.kv_spec = spec = _spec(cfg, block_size, dtype, spec)
        self.block_size = block_size
        self.num_blocks, self.num_window_blocks, self.num_state_slots = num_blocks, num_window_blocks, num_state_slots
        self.layout = cache_layout(cfg)
        self.specs = self.layout.layers
        num_blocks, num_window_blocks, num_state_slots = num_blocks + 1, num_window_blocks + 1, num_state_slots + 1
        sdt = spec.state_dtype

        def pool(rows: int, dim: int, dt: torch.dtype = spec.dtype) -> torch.Tensor:
            return torch.full((rows, dim), fill, dtype=dt, device=device)

        def kv_pool(rows: int, width: int | None = None) -> torch.Tensor:
            if not spec.is_packed:
                return pool(rows, spec.head_dim)
            byte = 0xFF if fill != fill else int(fill)  # 0xFF: NaN codes, scales and RoPE values
            return torch.full((rows, width or spec.entry_bytes), byte, dtype=torch.uint8, device=device)

        def entry_pool(rows: int, branch: BranchSpec) -> torch.Tensor:
            if branch.kv_entry:
                return kv_pool(rows, spec.compressed_entry_bytes)
            if spec.is_fp4:  # packed indexer keys
                return kv_pool(rows, spec.index_entry_bytes)
            return pool(rows, branch.dim)

        layout = self.layout
        self.window_pools = [kv_pool(num_window_blocks * block_size) for _ in layout.window_owners]
        self.window_kv = [self.window_pools[layer.window] for layer in layout.layers]
        # per branch pool (allocated once, however many layers read it): entries, ring, boundary records
        self.entry_pools: list[torch.Tensor] = []
        self.state_pools: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        self.boundary_pools: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        for branch in layout.branch_pools:
            rows = num_blocks * block_size // branch.rate
            self.entry_pools.append(entry_pool(rows, branch))
            state = boundary = None
            if branch.stateful:
                shape = (num_state_slots * branch.rows, branch.source_dim)
                state = (pool(*shape, dt=sdt), pool(*shape, dt=sdt))
                if branch.overlap:
                    shape = (num_blocks * branch.rate, branch.dim)
                    boundary = (pool(*shape, dt=sdt), pool(*shape, dt=sdt))
            self.state_pools.append(state)
            self.boundary_pools.append(boundary)
        # per kind, layer -> the pool it owns or reads (views of the lists above)
        self.entries: dict[str, dict[int, torch.Tensor]] = {}
        self.states: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.boundaries: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for i, layer in enumerate(layout.layers):
            for kind, pid in layer.branches.items():
                self.entries.setdefault(kind, {})[i] = self.entry_pools[pid]
                if self.state_pools[pid] is not None:
                    self.states.setdefault(kind, {})[i] = self.state_pools[pid]
                if self.boundary_pools[pid] is not None:
                    self.boundaries.setdefault(kind, {})[i] = self.boundary_pools[pid]

    # the V4 family's branch kinds by the names its forward and tests read them
    @property
    def comp_kv(self) -> dict[int, torch.Tensor]:
        return self.entries.get("kv", {})

    @property
    def index_keys(self) -> dict[int, torch.Tensor]:
        return self.entries.get("index", {})

    @property
    def comp_state(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        return self.states.get("kv", {})

    @property
    def index_state(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        return self.states.get("index", {})

    @property
    def comp_boundary(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        return self.boundaries.get("kv", {})

    @property
    def index_boundary(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        return self.boundaries.get("index", {})

    def restore_boundary(self, block: int, slot: int, boundary: int) -> None:
        """Put the overlap state saved with ``block`` into ``slot``'s ring, as it was at position ``boundary``."""
        for pid, branch in enumerate(self.layout.branch_pools):
            records = self.boundary_pools[pid]
            if records is None:
                continue
            rows = slot * branch.rows + torch.arange(boundary - branch.rate, boundary) % branch.rows
            saved = torch.arange(block * branch.rate, (block + 1) * branch.rate)
            for ring, record in zip(self.state_pools[pid], records):
                ring[rows.to(ring.device), : branch.dim] = record[saved.to(ring.device)]

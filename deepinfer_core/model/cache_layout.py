"""The cache layout as data: which pools exist and which layer owns (writes) or reads each.

An architecture builds its :class:`CacheLayout` once from its config; the cache allocation
(:class:`~deepinfer_core.model.cache.ModelCache`), the byte counts of the memory plan and ``deepinfer
plan``, rollback and prefix-cache restores all derive from it. A pool several layers read is allocated,
counted and saved once.

* Window pools: one row per source token, only for the blocks the sliding window still covers.
* Branch pools: one compressed branch each, of a kind its architecture names (V4: ``"kv"``, compressed
  KV entries in the cache's entry layout; ``"index"``, indexer keys, dense), one entry per ``rate``
  source tokens, kept for the whole sequence. A stateful branch also has a per-sequence ring of its last
  ``rows`` projected source rows, and, with overlapping windows, boundary records (what a prefix-cache
  hit restores).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

#: the fewest rows a compressor ring keeps. A verification's tokens must land on distinct rows of every ring
#: so that the rows of rejected drafts can be put back without touching accepted ones (``spec_decode/
#: rollback.py``): rings of fewer rows (V4.1's ratio-2 sources) keep this many, which admits 7 drafts.
MIN_RING_ROWS = 8


def ring_rows(rate: int, overlap: bool) -> int:
    """Source rows a compressor ring keeps: its windows' (two with overlap), at least :data:`MIN_RING_ROWS`.
    A ring is read and written modulo this count, so any count at least the windows' is exact."""
    return max((2 if overlap else 1) * rate, MIN_RING_ROWS)


@dataclass(frozen=True)
class BranchSpec:
    """One compressed branch: entries of ``dim`` values, one per ``rate`` source tokens; ``overlap``:
    each window also mixes in the previous one's first half (CSA)."""

    rate: int
    dim: int  # width of one compressed entry
    overlap: bool
    kind: str = "kv"
    stateful: bool = True  # a ring of projected source rows per sequence
    kv_entry: bool = True  # entries in the cache's KV entry layout (FP8 under ``fp8_ds``), else dense values

    @property
    def rows(self) -> int:
        """Source rows the ring keeps."""
        return ring_rows(self.rate, self.overlap)

    @property
    def source_dim(self) -> int:
        return (2 if self.overlap else 1) * self.dim


@dataclass(frozen=True)
class LayerCache:
    """One layer's view: its window pool and, per branch kind, the branch pool it owns or reads."""

    window: int
    branches: Mapping[str, int] = field(default_factory=dict)  # kind -> branch pool id
    specs: Mapping[str, BranchSpec] = field(default_factory=dict)  # kind -> that pool's spec
    owned: frozenset[str] = frozenset()  # kinds this layer writes

    def branch(self, kind: str) -> BranchSpec | None:
        return self.specs.get(kind)

    # the V4 family's two branch kinds, by the names its forward reads them
    @property
    def compressor(self) -> BranchSpec | None:
        return self.specs.get("kv")

    @property
    def indexer(self) -> BranchSpec | None:
        return self.specs.get("index")


@dataclass(frozen=True)
class CacheLayout:
    """Pools and who owns or reads them. Layer ids count the target's layers, then the drafter's."""

    branch_pools: tuple[BranchSpec, ...]
    branch_owners: tuple[int, ...]  # pool id -> the layer that writes it
    window_owners: tuple[int, ...]  # window pool id -> the layer that writes it
    layers: tuple[LayerCache, ...]

    def __post_init__(self) -> None:
        if len(self.branch_owners) != len(self.branch_pools):
            raise ValueError("every branch pool needs one owner layer")
        for i, layer in enumerate(self.layers):
            if not 0 <= layer.window < len(self.window_owners):
                raise ValueError(f"layer {i} reads window pool {layer.window}, which does not exist")
            for kind, pid in layer.branches.items():
                if not 0 <= pid < len(self.branch_pools) or self.branch_pools[pid].kind != kind:
                    raise ValueError(f"layer {i} reads {kind!r} pool {pid}, which is not a {kind!r} pool")

    @classmethod
    def build(cls, layers: list[dict[str, BranchSpec | int]], window: list[int] | None = None) -> CacheLayout:
        """From one dict per layer: kind -> the :class:`BranchSpec` the layer owns, or the id of the layer
        whose pool of that kind it reads. ``window``: per layer, the layer whose window pool it uses
        (default: its own)."""
        pools: list[BranchSpec] = []
        owners: list[int] = []
        pool_of: dict[tuple[int, str], int] = {}
        for i, kinds in enumerate(layers):
            for kind, spec in kinds.items():
                if isinstance(spec, BranchSpec):
                    if spec.kind != kind:
                        raise ValueError(f"layer {i}: a {spec.kind!r} branch declared under {kind!r}")
                    pool_of[i, kind] = len(pools)
                    pools.append(spec)
                    owners.append(i)
        window = list(range(len(layers))) if window is None else window
        window_pool = {owner: pid for pid, owner in enumerate(sorted(set(window)))}
        out = []
        for i, kinds in enumerate(layers):
            branches = {}
            for kind, spec in kinds.items():
                source = i if isinstance(spec, BranchSpec) else int(spec)
                if (source, kind) not in pool_of:
                    raise ValueError(f"layer {i} reads the {kind!r} pool of layer {source}, which owns none")
                branches[kind] = pool_of[source, kind]
            out.append(LayerCache(window_pool[window[i]], branches, {k: pools[p] for k, p in branches.items()},
                                  frozenset(k for k, s in kinds.items() if isinstance(s, BranchSpec))))
        return cls(tuple(pools), tuple(owners), tuple(sorted(window_pool)), tuple(out))

    def branch_specs(self) -> set[BranchSpec]:
        """Every distinct branch geometry (what per-step metadata is built for)."""
        return set(self.branch_pools)

    def pools_of(self, layers: range | None = None) -> Iterator[tuple[int, BranchSpec]]:
        """(pool id, spec) of each branch pool written by ``layers`` (all by default), once."""
        for pid, (spec, owner) in enumerate(zip(self.branch_pools, self.branch_owners)):
            if layers is None or owner in layers:
                yield pid, spec

    def window_pools_of(self, layers: range | None = None) -> list[int]:
        return [pid for pid, owner in enumerate(self.window_owners) if layers is None or owner in layers]


def cache_layout(cfg: Any) -> CacheLayout:
    """``cfg``'s cache layout, built once per config object by its architecture."""
    layout = cfg.__dict__.get("_cache_layout")
    if layout is None:
        layout = cfg.__dict__["_cache_layout"] = cfg.architecture.cache_layout(cfg)
    return layout


def check_block_size(cfg: Any, block_size: int) -> None:
    """A :class:`ValueError` unless ``block_size`` is a multiple of every compression rate of ``cfg``."""
    for spec in cache_layout(cfg).branch_pools:
        if block_size % spec.rate:
            raise ValueError(
                f"block_size {block_size} must be a multiple of every compression rate "
                f"(found rate {spec.rate})"
            )

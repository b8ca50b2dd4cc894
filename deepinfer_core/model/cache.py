"""The model's cache tensors: paged pools and per-sequence state slots, one set per layer.

* window pool (every layer): ``[num_window_blocks * block_size, head_dim]``, one row per source token;
  only blocks the sliding window still covers need to be resident.
* compressed pool (CSA/HCA layers): ``[num_blocks * block_size // rate, head_dim]``, one row per
  compressed entry, kept for the whole sequence; CSA layers also keep indexer keys the same way.
* state slots (CSA/HCA layers): the projected ``kv`` and ``gate`` (position bias added) of the last
  ``rows`` source tokens, where rows = 2 x rate with overlapping windows (CSA) and rate without (HCA).
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

from dataclasses import dataclass

import torch

from deepinfer_core.config import ModelConfig
from deepinfer_core.model.kv_cache_spec import KVCacheSpec, check_kv_cache_spec, state_dtype


@dataclass(frozen=True)
class CompressorSpec:
    """One compressed branch of a layer: main compressor or CSA indexer."""

    rate: int
    dim: int  # width of one compressed entry
    overlap: bool

    @property
    def rows(self) -> int:
        return (2 if self.overlap else 1) * self.rate

    @property
    def source_dim(self) -> int:
        return (2 if self.overlap else 1) * self.dim


@dataclass(frozen=True)
class LayerCacheSpec:
    compressor: CompressorSpec | None
    indexer: CompressorSpec | None


def layer_cache_specs(cfg: ModelConfig) -> list[LayerCacheSpec]:
    """Per attention layer (MTP blocks appended after the main layers)."""
    specs = []
    for layer in range(cfg.num_hidden_layers):
        rate = cfg.compress_rate(layer)
        if not rate:
            specs.append(LayerCacheSpec(None, None))
            continue
        csa = cfg.is_csa(layer)
        comp = CompressorSpec(rate, cfg.head_dim, overlap=csa)
        idx = CompressorSpec(rate, cfg.index_head_dim, overlap=True) if csa else None
        specs.append(LayerCacheSpec(comp, idx))
    specs += [LayerCacheSpec(None, None)] * (cfg.num_nextn_predict_layers or 0)
    return specs


def check_block_size(cfg: ModelConfig, block_size: int) -> None:
    for spec in layer_cache_specs(cfg):
        if spec.compressor is not None and block_size % spec.compressor.rate:
            raise ValueError(
                f"block_size {block_size} must be a multiple of every compression rate "
                f"(found rate {spec.compressor.rate})"
            )


def _spec(cfg: ModelConfig, block_size: int, dtype: torch.dtype, spec: KVCacheSpec | None) -> KVCacheSpec:
    if spec is None:
        check_block_size(cfg, block_size)
        return KVCacheSpec.default(cfg, block_size, dtype)
    check_kv_cache_spec(spec, cfg, block_size)
    return spec


def layer_bytes_per_block(layer: LayerCacheSpec, spec: KVCacheSpec) -> tuple[int, int]:
    """(compressed-pool bytes, window-pool bytes) that one block costs in one layer."""
    comp = 0
    for branch, indexer in ((layer.compressor, False), (layer.indexer, True)):
        if branch is not None:
            comp += spec.compressed_bytes_per_block(branch.rate, indexer)
            if branch.overlap:  # the boundary records
                comp += 2 * branch.rate * branch.dim * spec.state_dtype.itemsize
    return comp, spec.window_bytes_per_block


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype,
                    spec: KVCacheSpec | None = None) -> tuple[int, int]:
    """(compressed-pool bytes, window-pool bytes) that one block costs across all layers, in the layout of
    ``spec`` (default: ``dtype`` entries)."""
    spec = _spec(cfg, block_size, dtype, spec)
    per_layer = [layer_bytes_per_block(layer, spec) for layer in layer_cache_specs(cfg)]
    return sum(c for c, _ in per_layer), sum(w for _, w in per_layer)


def bytes_per_state_slot(cfg: ModelConfig, dtype: torch.dtype, spec: KVCacheSpec | None = None) -> int:
    elt = (spec.state_dtype if spec is not None else state_dtype(dtype)).itemsize
    total = 0
    for layer in layer_cache_specs(cfg):
        for branch in (layer.compressor, layer.indexer):
            if branch is not None:
                total += 2 * branch.rows * branch.source_dim * elt
    return total


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
        self.specs = layer_cache_specs(cfg)
        num_blocks, num_window_blocks, num_state_slots = num_blocks + 1, num_window_blocks + 1, num_state_slots + 1
        sdt = spec.state_dtype

        def pool(rows: int, dim: int, dt: torch.dtype = spec.dtype) -> torch.Tensor:
            return torch.full((rows, dim), fill, dtype=dt, device=device)

        def kv_pool(rows: int) -> torch.Tensor:
            if not spec.is_fp8:
                return pool(rows, spec.head_dim)
            byte = 0xFF if fill != fill else int(fill)  # 0xFF: NaN codes, scales and RoPE values
            return torch.full((rows, spec.entry_bytes), byte, dtype=torch.uint8, device=device)

        self.window_kv = [kv_pool(num_window_blocks * block_size) for _ in self.specs]
        self.comp_kv: dict[int, torch.Tensor] = {}
        self.index_keys: dict[int, torch.Tensor] = {}
        self.comp_state: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.index_state: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.comp_boundary: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.index_boundary: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for layer, branches in enumerate(self.specs):
            for branch, pools, states, boundaries in (
                (branches.compressor, self.comp_kv, self.comp_state, self.comp_boundary),
                (branches.indexer, self.index_keys, self.index_state, self.index_boundary),
            ):
                if branch is None:
                    continue
                rows = num_blocks * block_size // branch.rate
                pools[layer] = pool(rows, branch.dim) if branch is branches.indexer else kv_pool(rows)
                shape = (num_state_slots * branch.rows, branch.source_dim)
                states[layer] = (pool(*shape, dt=sdt), pool(*shape, dt=sdt))
                if branch.overlap:
                    shape = (num_blocks * branch.rate, branch.dim)
                    boundaries[layer] = (pool(*shape, dt=sdt), pool(*shape, dt=sdt))

    def restore_boundary(self, block: int, slot: int, boundary: int) -> None:
        """Put the overlap state saved with ``block`` into ``slot``'s ring, as it was at position ``boundary``."""
        for layer, spec in enumerate(self.specs):
            for branch, states, boundaries in (
                (spec.compressor, self.comp_state, self.comp_boundary),
                (spec.indexer, self.index_state, self.index_boundary),
            ):
                if branch is None or not branch.overlap:
                    continue
                rows = slot * branch.rows + torch.arange(boundary - branch.rate, boundary) % branch.rows
                saved = torch.arange(block * branch.rate, (block + 1) * branch.rate)
                for ring, record in zip(states[layer], boundaries[layer]):
                    ring[rows.to(ring.device), : branch.dim] = record[saved.to(ring.device)]

"""The layout of one paged-cache entry and block, as the backend's attention reads it (vLLM's KVCacheSpec).

Every layer stores rows of ``head_dim`` values: one per source token in its window pool and, in CSA/HCA
layers, one per compressed window in its compressed pool; the last ``rope_dim`` values of a row carry
RoPE. CSA layers also keep indexer keys of ``index_head_dim`` values. The compressor rings and boundary
records are kept in ``state_dtype``. Layout ``"dense"`` stores each value as one ``dtype`` element; it is
the only layout :class:`~deepinfer_core.model.cache.ModelCache` allocates (DeepSeek's 584-byte FP8 entry
is another layout, still to come).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from deepinfer_core.config import CacheConfig, ModelConfig

#: entry layouts ModelCache can allocate
SUPPORTED_LAYOUTS = ("dense",)


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class KVCacheSpec:
    block_size: int  # source tokens one block id covers, in every layer
    dtype: torch.dtype  # one value of a window entry, compressed entry or indexer key
    head_dim: int  # values per window or compressed entry, RoPE included
    rope_dim: int  # the last values of an entry, rotated
    index_head_dim: int  # values per indexer key
    state_dtype: torch.dtype  # compressor rings and boundary records
    layout: str = "dense"

    @classmethod
    def default(cls, cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        """``dtype`` entries, as the model computes them."""
        return cls(block_size, dtype, cfg.head_dim, cfg.rope_dim, cfg.index_head_dim, state_dtype(dtype))

    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.rope_dim

    @property
    def entry_bytes(self) -> int:
        """Bytes of one window or compressed entry."""
        return self.head_dim * self.dtype.itemsize

    @property
    def index_entry_bytes(self) -> int:
        return self.index_head_dim * self.dtype.itemsize

    @property
    def window_bytes_per_block(self) -> int:
        """Bytes of one window block in one layer."""
        return self.block_size * self.entry_bytes

    def compressed_bytes_per_block(self, rate: int, indexer: bool = False) -> int:
        """Bytes of the ``block_size // rate`` compressed entries (indexer keys) of one block in one layer."""
        return self.block_size // rate * (self.index_entry_bytes if indexer else self.entry_bytes)


def check_kv_cache_spec(spec: Any, cfg: ModelConfig, block_size: int) -> None:
    """A :class:`ValueError` saying what in ``spec`` this model, the planned ``block_size`` or ModelCache
    cannot serve."""
    if not isinstance(spec, KVCacheSpec):
        raise TypeError(f"deepinfer_kv_cache_spec returned {type(spec).__name__}, expected a KVCacheSpec or None")
    wrong = []
    if spec.layout not in SUPPORTED_LAYOUTS:
        wrong.append(f"layout {spec.layout!r}: ModelCache allocates only {SUPPORTED_LAYOUTS}")
    if spec.block_size != block_size:
        wrong.append(f"block_size {spec.block_size}: the cache is planned with {block_size} blocks (a backend "
                     "changes cache_config.block_size in deepinfer_configure)")
    for name, want in (("head_dim", cfg.head_dim), ("rope_dim", cfg.rope_dim), ("index_head_dim", cfg.index_head_dim)):
        if getattr(spec, name) != want:
            wrong.append(f"{name} {getattr(spec, name)}: the model has {want}")
    for name in ("dtype", "state_dtype"):
        if not getattr(spec, name).is_floating_point:
            wrong.append(f"{name} {getattr(spec, name)}: a dense entry needs a floating-point dtype")
    if wrong:
        raise ValueError("unusable KV cache spec: " + "; ".join(wrong))
    from deepinfer_core.model.cache import check_block_size

    check_block_size(cfg, spec.block_size)


def resolve_kv_cache_spec(hook: Any, model_config: ModelConfig, cache_config: CacheConfig,
                          dtype: torch.dtype) -> KVCacheSpec:
    """The backend's ``deepinfer_kv_cache_spec`` answer (``hook``: a plugin manager's hook relay, or
    ``None``), checked; the default (``dtype`` entries) when no plugin answers."""
    spec = None
    if hook is not None:
        spec = hook.deepinfer_kv_cache_spec(model_config=model_config, cache_config=cache_config, dtype=dtype)
    if spec is None:
        return KVCacheSpec.default(model_config, cache_config.block_size, dtype)
    check_kv_cache_spec(spec, model_config, cache_config.block_size)
    return spec

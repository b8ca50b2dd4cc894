"""The layout of one paged-cache entry and block, as the backend's attention reads it (vLLM's KVCacheSpec).

Every layer stores rows of ``head_dim`` values: one per source token in its window pool and, in CSA/HCA
layers, one per compressed window in its compressed pool; the last ``rope_dim`` values of a row carry
RoPE. CSA layers also keep indexer keys of ``index_head_dim`` values. The compressor rings and boundary
records are kept in ``state_dtype``. Layouts :class:`~deepinfer_core.model.cache.ModelCache` allocates:

* ``"dense"``: each value one ``dtype`` element.
* ``"fp8_ds"`` (vLLM's ``fp8_ds_mla`` for V4): window and compressed entries as DeepSeek's FP8 entry,
  uint8 rows of :func:`~deepinfer_core.quant.kv_fp8.kv_fp8_entry_bytes` (E4M3 values with ue8m0 scales
  per 64, the RoPE values in ``dtype``: 584 bytes for DeepSeek-V4-Flash in bf16); indexer keys dense.
  The default under ``numerics="deepseek"``, whose model.py stores exactly these values.
* ``"fp4_ds"`` (DeepSeek-V4.1's "FP4 KV", vLLM's ``nvfp4_ds_mla``): uint8 rows of
  :mod:`~deepinfer_core.quant.kv_fp4`: window entries E4M3 with E8M0 scales per 32 (528 B at head_dim 512),
  compressed entries packed e2m1 with E4M3 scales per 16 (288 B), indexer keys packed e2m1 with E8M0
  scales per 32 (68 B at 128). V4.1's default under ``numerics="deepseek"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from deepinfer_core.config import CacheConfig, ModelConfig
from deepinfer_core.model.cache_layout import check_block_size

#: entry layouts ModelCache can allocate
DENSE_LAYOUTS = ("dense",)
FP8_LAYOUT = "fp8_ds"
FP4_LAYOUT = "fp4_ds"
SUPPORTED_LAYOUTS = (*DENSE_LAYOUTS, FP8_LAYOUT, FP4_LAYOUT)


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class KVCacheSpec:
    block_size: int  # source tokens one block id covers, in every layer
    dtype: torch.dtype  # one value of a dense entry or indexer key (fp8_ds: also of a RoPE value)
    head_dim: int  # values per window or compressed entry, RoPE included
    rope_dim: int  # the last values of an entry, rotated
    index_head_dim: int  # values per indexer key
    state_dtype: torch.dtype  # compressor rings and boundary records
    layout: str = "dense"

    @classmethod
    def default(cls, cfg: ModelConfig, block_size: int, dtype: torch.dtype,
                numerics: str = "transformers") -> KVCacheSpec:
        """``dtype`` entries, as the model computes them, or the layout the architecture stores under
        ``numerics`` (DeepSeek-V4 under ``"deepseek"``: window and compressed entries in DeepSeek's FP8
        entry, RoPE values in ``dtype``)."""
        layout = cfg.architecture.kv_layouts.get(numerics, "dense")
        return cls(block_size, dtype, cfg.head_dim, cfg.rope_dim, cfg.index_head_dim, state_dtype(dtype), layout)

    @property
    def is_fp8(self) -> bool:
        return self.layout == FP8_LAYOUT

    @property
    def is_fp4(self) -> bool:
        return self.layout == FP4_LAYOUT

    @property
    def is_packed(self) -> bool:
        """Entries are uint8 rows (decoded by the attention that reads them)."""
        return self.layout in (FP8_LAYOUT, FP4_LAYOUT)

    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.rope_dim

    @property
    def entry_bytes(self) -> int:
        """Bytes of one window entry (and, but for ``fp4_ds``, of one compressed entry)."""
        if self.is_fp8:
            from deepinfer_core.quant.kv_fp8 import kv_fp8_entry_bytes

            return kv_fp8_entry_bytes(self.head_dim, self.rope_dim, self.dtype)
        if self.is_fp4:
            from deepinfer_core.quant.kv_fp4 import entry_bytes

            return entry_bytes("window", self.head_dim)
        return self.head_dim * self.dtype.itemsize

    @property
    def compressed_entry_bytes(self) -> int:
        """Bytes of one compressed entry."""
        if self.is_fp4:
            from deepinfer_core.quant.kv_fp4 import entry_bytes

            return entry_bytes("compressed", self.head_dim)
        return self.entry_bytes

    @property
    def index_entry_bytes(self) -> int:
        if self.is_fp4:
            from deepinfer_core.quant.kv_fp4 import entry_bytes

            return entry_bytes("index", self.index_head_dim)
        return self.index_head_dim * self.dtype.itemsize

    @property
    def window_bytes_per_block(self) -> int:
        """Bytes of one window block in one layer."""
        return self.block_size * self.entry_bytes

    def compressed_bytes_per_block(self, rate: int, indexer: bool = False) -> int:
        """Bytes of the ``block_size // rate`` compressed entries (indexer keys) of one block in one layer."""
        return self.block_size // rate * (self.index_entry_bytes if indexer else self.compressed_entry_bytes)


def check_kv_cache_spec(spec: Any, cfg: ModelConfig, block_size: int) -> None:
    """A :class:`ValueError` saying what in ``spec`` this model, the planned ``block_size`` or ModelCache
    cannot serve."""
    if not isinstance(spec, KVCacheSpec):
        raise TypeError(f"deepinfer_kv_cache_spec returned {type(spec).__name__}, expected a KVCacheSpec or None")
    wrong = []
    if spec.layout not in SUPPORTED_LAYOUTS:
        wrong.append(f"layout {spec.layout!r}: ModelCache allocates only {DENSE_LAYOUTS} entries, "
                     f"{FP8_LAYOUT!r} (DeepSeek's FP8 entry) or {FP4_LAYOUT!r} (DeepSeek-V4.1's packed entries)")
    elif spec.layout not in ("dense", *cfg.architecture.kv_layouts.values()):
        wrong.append(f"layout {spec.layout!r}: {cfg.architecture.name} stores dense entries or "
                     f"{sorted(set(cfg.architecture.kv_layouts.values()))}")
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
    check_block_size(cfg, spec.block_size)


def resolve_kv_cache_spec(hook: Any, model_config: ModelConfig, cache_config: CacheConfig,
                          dtype: torch.dtype, numerics: str = "transformers") -> KVCacheSpec:
    """The backend's ``deepinfer_kv_cache_spec`` answer (``hook``: a plugin manager's hook relay, or
    ``None``), checked; the default for ``numerics`` (:meth:`KVCacheSpec.default`) when no plugin answers."""
    spec = None
    if hook is not None:
        spec = hook.deepinfer_kv_cache_spec(model_config=model_config, cache_config=cache_config, dtype=dtype)
    if spec is None:
        return KVCacheSpec.default(model_config, cache_config.block_size, dtype, numerics)
    check_kv_cache_spec(spec, model_config, cache_config.block_size)
    return spec

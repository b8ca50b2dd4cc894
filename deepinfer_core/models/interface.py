"""What worker/, engine/ and spec_decode/ see of a model: the :class:`Model` protocol."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from deepinfer_core.config import ModelConfig
    from deepinfer_core.model.cache import ModelCache
    from deepinfer_core.model.cache_layout import CacheLayout
    from deepinfer_core.model.metadata import ForwardBatch
    from deepinfer_core.ops import OpTable


@runtime_checkable
class Model(Protocol):
    """A model built from resolved ops over a flat varlen batch and a paged cache.

    ``forward`` returns the logits of ``batch.logits_indices`` and the hidden state a drafter reads;
    ``cache_layout`` says which pools and branches each layer owns or reads (built once, from the
    config); ``drafter`` is the checkpoint's draft model, or None."""

    cfg: ModelConfig
    ops: OpTable
    dtype: torch.dtype
    device: torch.device
    numerics: str
    cache_layout: CacheLayout
    drafter: Any

    def forward(self, batch: ForwardBatch, cache: ModelCache) -> tuple[torch.Tensor, torch.Tensor]: ...

    def ops_in_use(self, mtp: bool = True, kv_fp8: bool | None = None) -> set[str]: ...

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]: ...

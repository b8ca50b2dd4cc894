"""SWA bounded replay: the batch the late layers of a prefill see.

In a model whose layers after the last KV source own no global KV (DeepSeek-V4.1: layers 21-39 of 40),
those late layers matter to later steps only through their private sliding-window KV, and to the prompt's
sample only through its last positions. So a prefill runs them only on the prompt's tail
``[end - keep, end)``, where ``keep`` covers the window and the longest backtracking (:func:`replay_keep`);
earlier chunks publish only global KV and the early layers' state. A sequence's ``replay_from`` (its
:class:`~deepinfer_core.model.metadata.SeqSpan`'s, fixed when its prefill begins) states the semantics:

* a late layer computes the positions ``p >= replay_from`` only (the tail); the others leave the
  residual streams as the last early layer left them;
* its window KV is written for tail positions only; a query at ``p`` sees window keys at
  ``max(p - window + 1, replay_from) .. p`` (the *window pivot* is that first visible position);
* compressed keys, index keys and candidates are the early layers' (global KV, complete for every
  position): a tail query's compressed-key range is the full prefill's.

Since ``keep >= window``, a decode step's window never reaches below ``replay_from``: only prefill steps
carry the metadata (``ForwardBatch.replay_floor`` / ``replay_rows``, set where the step is cut at all).

Two implementations of those semantics (:func:`late_batch`): ``"mask"`` runs the late layers on every
token of the step, their window stores and reads below the floor redirected to the trash / hidden, and
keeps the non-tail rows' streams at the end; ``"compact"`` runs them on the tail rows only. Their tail
rows see the same keys and write the same slots, so they compute the same values.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import torch

from deepinfer_core.model.errors import UnsupportedModelError
from deepinfer_core.model.metadata import ForwardBatch, _pool_rows, _Xp

logger = logging.getLogger(__name__)

#: the implementations of the engine argument ``bounded_replay`` (False: the full prefill)
REPLAY_MODES = ("mask", "compact")
#: what ``bounded_replay`` None (or True) picks where the model can be cut: the faster of the two
#: (``benchmarks/bench_bounded_replay.py``: compact computes and stores only the tail)
DEFAULT_REPLAY_MODE = "compact"


def resolve_bounded_replay(value: bool | str | None, cfg: Any) -> str | None:
    """The mode the engine argument ``bounded_replay`` asks of the model ``cfg``: None (the full prefill)
    for False, and by default for an architecture without bounded replay or a model whose late layers
    cannot be cut; ``"mask"`` / ``"compact"`` (True or None: :data:`DEFAULT_REPLAY_MODE`) where the
    architecture's ``replay_layers`` accepts the model. Asked for explicitly where it cannot run, it is an
    error saying why."""
    if value is False:
        return None
    if value is not None and value is not True and value not in REPLAY_MODES:
        raise ValueError(f"bounded_replay must be False, True or one of {REPLAY_MODES}, got {value!r}")
    arch = cfg.architecture
    layers = getattr(arch, "replay_layers", None)
    if layers is None:
        if value is None:
            return None
        raise ValueError(f"bounded_replay={value!r}: {arch.name} has no layers to cut to a prompt's tail (bounded "
                         "replay is DeepSeek-V4.1's, whose layers after the last KV source own no global KV); pass "
                         "bounded_replay=False")
    try:
        layers(cfg)
    except UnsupportedModelError as exc:
        if value is not None:
            raise
        logger.info("bounded replay is off: %s", exc)
        return None
    return DEFAULT_REPLAY_MODE if value in (None, True) else value


def replay_keep_of(cfg: Any, speculative: Any = None) -> int:
    """:func:`replay_keep` of model ``cfg`` under the engine's speculative config (None: no drafts). A
    DSpark drafter reads the target's features over its own window of ``sliding_window`` positions; the
    keep counts that window whenever the checkpoint has such a drafter, drafting or not, so that turning
    speculation on never changes the cut, and with it the outputs (speculation stays lossless)."""
    drafts = speculative.num_speculative_tokens if speculative is not None else 0
    capture = cfg.sliding_window if getattr(cfg, "dspark_block_size", 0) else 0
    return replay_keep(cfg.sliding_window, drafts, capture)


def replay_keep(sliding_window: int, num_speculative_tokens: int = 0, capture_window: int = 0) -> int:
    """Tail tokens a prefill's late layers run on: the window the first decode step reads plus the longest
    backtracking, the speculative draft length or the drafter's capture window (the trailing positions
    whose target features a DSpark drafter reads), whichever is longer."""
    return sliding_window + max(num_speculative_tokens, capture_window, 0)


@dataclass
class LateBatch:
    """What the late layers of one forward run on. ``batch``: their tokens (compact: the tail only) with
    window stores and reads cut at the floor; ``rows``: those tokens' rows in the step's batch (compact);
    ``keep``: [T] whether a row of the step is in the tail (mask)."""

    mode: str
    batch: ForwardBatch
    rows: torch.Tensor | None = None
    keep: torch.Tensor | None = None

    @property
    def empty(self) -> bool:
        """No token of the step is in the tail (only compact skips the late layers then)."""
        return self.rows is not None and self.rows.numel() == 0

    def narrow(self, x: torch.Tensor) -> torch.Tensor:
        """A per-token tensor of the step, as the late layers see it."""
        return x if self.rows is None else x[self.rows]

    def widen(self, late: torch.Tensor, early: torch.Tensor) -> torch.Tensor:
        """The step's per-token tensor: ``late`` (the late layers' rows) on the tail, ``early`` (its value
        when the late layers began) elsewhere."""
        if self.rows is not None:
            return early.index_copy(0, self.rows, late)
        keep = self.keep.view(-1, *([1] * (late.dim() - 1)))
        return torch.where(keep, late, early)


def late_window_rows(batch: ForwardBatch, positions: torch.Tensor, owner: torch.Tensor,
                     floor: torch.Tensor) -> torch.Tensor:
    """[N, W] window-pool rows of the queries at ``positions`` of sequences ``owner``: positions
    ``p - W + 1 .. p`` at or past ``floor`` (-1 elsewhere)."""
    window, block_size = batch.window_layout
    keys = positions.unsqueeze(1) + torch.arange(1 - window, 1, device=positions.device)
    rows = _pool_rows(batch.window_tables, owner, keys, block_size, first=batch.window_first,
                      xp=_Xp(positions.device))
    return rows.masked_fill(keys < floor.unsqueeze(1), -1)


def late_batch(batch: ForwardBatch, mode: str) -> LateBatch | None:
    """The late layers' view of ``batch`` under ``mode`` (None where the step cuts nothing): derived on
    the batch's device from its tensors, with no host round trip."""
    if batch.replay_floor is None:
        return None
    if mode not in REPLAY_MODES:
        raise ValueError(f"bounded replay mode {mode!r} is unknown; choose one of {REPLAY_MODES}")
    floor = batch.replay_floor
    if mode == "mask":
        keep = batch.positions >= floor
        late = replace(batch, window_slots=batch.window_slots.masked_fill(~keep, -1), storage=None,
                       window_indices=late_window_rows(batch, batch.positions, batch.token_seq, floor))
        return LateBatch(mode, late, keep=keep)
    rows = batch.replay_rows
    positions, owner = batch.positions[rows], batch.token_seq[rows]
    late = replace(batch, input_ids=batch.input_ids[rows], positions=positions,
                   window_slots=batch.window_slots[rows], token_seq=owner, replay_floor=floor[rows],
                   replay_rows=None, window_indices=late_window_rows(batch, positions, owner, floor[rows]),
                   logits_indices=rows.new_zeros(0), query_start_loc=[], compressors={}, ngram_index=None,
                   ngram_tokens=None, storage=None)
    return LateBatch(mode, late, rows=rows)


def window_pivots(batch: ForwardBatch, floor: torch.Tensor | None = None) -> torch.Tensor:
    """[T] the first window position each query of ``batch`` sees: ``max(p - window + 1, floor)`` (the
    floor: ``batch.replay_floor`` where it is set)."""
    floor = batch.replay_floor if floor is None else floor
    first = batch.positions - batch.window_layout[0] + 1
    return first.clamp(min=0) if floor is None else torch.maximum(first.clamp(min=0), floor)

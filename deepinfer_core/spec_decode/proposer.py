"""What the speculative runner sees of a drafter: the :class:`Proposer` protocol and its data.

After every target forward the runner hands the proposer the positions the step kept (``propose``): the
proposer catches its drafter up over them and drafts for the spans that ask. Steps of decodes only may
draft through the proposer's ``graphs`` instead, from the kept tokens on the device, over catch-up spans
laid out by ``catch_up_span``. With expert parallel every rank's step runs the same drafter collectives:
``propose`` pads what it ran to a full step's, and a rank with nothing scheduled runs ``dummy_step``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from deepinfer_core.model.metadata import SeqSpan


@dataclass
class DraftSpan:
    """One sequence's kept positions of the step: ``start .. start + len(next_ids) - 1``."""

    start: int
    rows: list[int]  # rows of the target batch's streams at those positions
    next_ids: list[int]  # the token after each position
    block_table: list[int]
    window_block_table: list[int]
    draft: bool  # propose drafts from the last position


@dataclass
class Proposal:
    draft_token_ids: list[list[int]]  # per drafting span, in order
    confidences: list[list[float]]  # the drafter's probability of each draft


@runtime_checkable
class Proposer(Protocol):
    """Drafts ``k`` tokens a sequence. ``graphs``: the drafting graphs (``size_for(n)``, and
    ``propose(catch_spans, ids, accepted, rows, streams, shift)`` -> ([n, k] drafts, their probabilities)
    on the device), or None: every step drafts through :meth:`propose`."""

    k: int
    graphs: Any

    def propose(self, spans: list[DraftSpan], streams: torch.Tensor) -> Proposal:
        """Catch the drafter up over ``spans`` (``streams``: the target's hidden state) and draft for the
        spans that ask."""
        ...

    def catch_up_span(self, start: int, rows: list[int], block_table: list[int], window_block_table: list[int],
                      shift: int = 0) -> tuple[SeqSpan, list[int]]:
        """A graph catch-up's span from ``start`` and the target hidden state's row of each position."""
        ...

    def dummy_step(self) -> None:
        """A step's drafting with no tokens: its expert-parallel collectives only (MTP: k forwards of the
        block; DSpark: one pass over the stages)."""
        ...

"""What a chained verification step takes from the step before, on the device, as one graph per layout.

A chained step (launched before the step before ends) moves each span on by the drafts the step before
accepted and fills in its first token and drafts; the host knows none of them. The step before leaves
them per row of its batch in buffers of this module (:meth:`ChainGraphs.keep`); the next step's
facts name each sequence's row there (``extra`` row 0, padding sequences a row that stays zero) and
one replay per verification layout (``GraphRunner.facts`` key) reads them: the shift and draft counts
it writes are the step's (:attr:`ChainGraphs.shift`, :attr:`ChainGraphs.num_drafts`). An n-gram model's
step also takes its history there: the host loads the ``n - 1`` tokens before the span's first position
where the step before accepted nothing (``extra`` rows from ``EXTRA_ROWS``), followed on the device by the
drafts the step before kept, and the history is the ``n - 1`` of them from the shift on. Without captured graphs (CPU)
the same ops run eagerly.
"""

from __future__ import annotations

from typing import Any

import torch

from deepinfer_core.worker.graph_runner import EXTRA_ROWS


class ChainGraphs:
    def __init__(self, runner: Any, num_speculative_tokens: int):
        self.runner = runner
        size = max(runner.sizes)
        self.zero_row = size  # the row padding sequences read: never written
        zeros = dict(dtype=torch.long, device=runner.platform.device)
        self.accepted = torch.zeros(size + 1, **zeros)
        self.last = torch.zeros(size + 1, **zeros)
        self.drafts = torch.zeros(size + 1, num_speculative_tokens, **zeros)
        self.kept = torch.zeros(size + 1, num_speculative_tokens, **zeros)
        self.shift = torch.zeros(size, **zeros)
        self.num_drafts = torch.zeros(size, **zeros)
        keys = list(runner.facts) if runner.graphs else []
        self.graphs = dict(runner.platform.capture_graphs(keys, self._apply)) if keys else {}

    def keep(self, last: torch.Tensor, accepted: torch.Tensor, drafts: torch.Tensor, kept: torch.Tensor) -> None:
        """A step's results per row (its first ``len(last)``) for the next one: each row's next first token,
        its accepted draft count, its new drafts and its kept tokens ([n, k + 1]: the accepted drafts first)."""
        n = last.shape[0]
        self.last[:n].copy_(last)
        self.accepted[:n].copy_(accepted)
        self.drafts[:n].copy_(drafts)
        self.kept[:n].copy_(kept[:, : self.kept.shape[1]])

    def apply(self, key: tuple[int, int, int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Move the loaded facts of layout ``key`` on and fill in their tokens; (shift, draft counts) of its
        ``n`` real sequences, valid until the next call."""
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
        else:
            self._apply(key)
        return self.shift[:n], self.num_drafts[:n]

    def _apply(self, key: tuple[int, int, int]) -> None:
        size, _, q = key
        static = self.runner.facts[key]
        facts, extra = static.facts, static.extra
        index = extra[0]
        shift = self.accepted[index]
        self.shift[:size].copy_(shift)
        # no draft past max_tokens: the room left once the step before's accepted drafts are in
        torch.minimum(extra[1], (extra[2] - shift).clamp(min=0), out=self.num_drafts[:size])
        facts.ctx.add_(shift)
        ids = facts.input_ids.view(size, q)
        ids[:, 0] = self.last[index]
        ids[:, 1:] = self.drafts[index, : q - 1]
        if facts.history is not None:
            known = torch.cat([extra[EXTRA_ROWS:].t(), self.kept[index]], dim=1)  # [size, n - 1 + k]
            back = torch.arange(facts.history.shape[1], device=shift.device)
            facts.history.copy_(known.gather(1, shift.unsqueeze(1) + back))

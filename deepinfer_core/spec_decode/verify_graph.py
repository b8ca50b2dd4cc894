"""Greedy verification of a verification graph's output as one more graph per graph key.

A greedy verification after its forward is some twenty small device ops (the argmax, the match
against the drafts, the accepted counts, the output rows, the mask of rejected tokens): on a host that
launches each op in turn, they cost a batch-64 step of the trained default model a tenth of its time.
Per verification graph (``GraphRunner`` key of a query length above 1) this captures them over that
graph's static logits, its static input ids (a span's drafts follow its first token) and a draft-count
buffer every graph shares; a step copies its draft counts in and replays, and the undo log's own
restore graph puts back the rows the rejected tokens wrote. Without captured graphs (CPU) the same ops
run eagerly.
"""

from __future__ import annotations

from typing import Any

import torch

from deepinfer_core.spec_decode.rejection_sampler import VerifyOutput, greedy_verify
from deepinfer_core.spec_decode.rollback import CacheUndo


def greedy_verify_spans(logits: torch.Tensor, input_ids: torch.Tensor, num_drafts: torch.Tensor, span: int,
                        num_tokens: int) -> tuple[VerifyOutput, torch.Tensor]:
    """Greedy verification of the first ``s = len(num_drafts)`` spans of ``span`` tokens (``logits`` and
    ``input_ids``: theirs, a span's drafts after its first token), and which of the ``num_tokens`` tokens
    were rejected: those past their span's accepted drafts (spans past ``s``, and tokens past the last
    whole span, accept nothing)."""
    s = num_drafts.shape[0]
    ids = input_ids[: s * span].view(s, span)
    out = greedy_verify(logits[: s * span].view(s, span, -1), ids[:, 1:], num_drafts)
    tokens = torch.arange(num_tokens, device=logits.device)
    owner = tokens // span
    accepted = torch.cat([out.num_accepted, out.num_accepted.new_zeros(num_tokens // span - s + 1)])
    return out, tokens % span > accepted[owner]


class VerifyGraphs:
    """:func:`greedy_verify_spans` of each verification graph of ``runner`` (a ``GraphRunner``), captured where
    its graphs are."""

    def __init__(self, runner: Any):
        self.runner = runner
        keys = [key for key in runner.graphs if key[2] > 1]
        sizes = [key[0] for key in keys]
        self.num_drafts = torch.zeros(max(sizes, default=0), dtype=torch.long, device=runner.platform.device)
        self.graphs = dict(runner.platform.capture_graphs(keys, self._capture)) if keys else {}

    def _capture(self, key: tuple[int, int, int]):
        size, _, q = key
        logits = self.runner.graphs[key].output[0]
        out, rejected = greedy_verify_spans(logits, self.runner.inputs[key].batch.input_ids, self.num_drafts[:size],
                                            q, size * q)
        return out.output_token_ids, out.num_accepted, rejected

    def verify(self, batch: Any, logits: torch.Tensor, num_drafts: torch.Tensor, undo: CacheUndo,
               span: int) -> VerifyOutput:
        """The verification of a replayed graph step (``batch``: its static inputs, ``logits`` its real rows)
        whose real spans have ``num_drafts`` (device) drafts; its rejected rows put back."""
        n = num_drafts.shape[0]
        graph = self.graphs.get(self.runner.key_of(batch))
        if graph is None:
            out, rejected = greedy_verify_spans(logits, batch.input_ids, num_drafts, span, batch.num_tokens)
        else:
            self.num_drafts.zero_()
            self.num_drafts[:n].copy_(num_drafts)
            graph.replay()
            tokens, accepted, rejected = graph.output
            # the graph's buffers: the next step's replay writes them
            out = VerifyOutput(tokens[:n].clone(), accepted[:n].clone())
        undo.restore(rejected)
        return out

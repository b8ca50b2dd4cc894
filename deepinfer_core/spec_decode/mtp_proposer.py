"""MtpProposer: drafts with the checkpoint's MTP block, applied recurrently (DeepSeek's ``mtp.0.*``).

The MTP block at position ``t`` reads the main model's last hyper-connection streams at ``t`` and the
token at ``t + 1``, and predicts the token at ``t + 2``; its sliding-window KV lives in the MTP layer's
rows of the window pool (same block tables as the main layers). After every target forward the block
catches up over the positions the step kept (every prefill chunk, the accepted prefix of a
verification), which writes its KV for them and, at a sequence's last position, gives draft 1. Draft
``j + 1`` comes from one more MTP step at the next position, fed the block's own output streams and draft
``j``. Drafts are greedy; each one's confidence is the drafter's probability of it.

Draft positions past the blocks the step holds read and write nothing (rows -1): such a draft sees less
of its own context, which costs acceptance, never correctness.

With expert parallel every rank's step runs the MTP block k times, whatever it drafts (the missing
times with no tokens, through the MoE's collectives only), so that the ranks' collectives line up.
"""

from __future__ import annotations

import torch

from deepinfer_core.model.cache import ModelCache
from deepinfer_core.model.metadata import SeqSpan, build_forward_batch, pad_tables
from deepinfer_core.models.interface import Model
from deepinfer_core.spec_decode.mtp_graph import MtpGraphs
from deepinfer_core.spec_decode.proposer import DraftSpan, Proposal


class MtpProposer:
    """The :class:`~deepinfer_core.spec_decode.proposer.Proposer` of ``model.drafter`` (MTP layers).

    ``graphs``: an :class:`~deepinfer_core.spec_decode.mtp_graph.MtpGraphs` that drafts for steps whose
    every span drafts from at most k + 1 kept positions; other steps draft eagerly."""

    def __init__(self, model: Model, cache: ModelCache, num_speculative_tokens: int,
                 graphs: MtpGraphs | None = None):
        if model.drafter is None:
            raise ValueError("speculative_config method 'mtp' needs a checkpoint with mtp.* weights; this one has "
                             "none (num_nextn_predict_layers / the mtp.0.* tensors)")
        self.model, self.drafter, self.cache, self.k = model, model.drafter, cache, num_speculative_tokens
        self.window = model.cfg.sliding_window
        self.graphs = graphs

    def _batch(self, spans: list[SeqSpan], ids: list[int], rows: list[int]):
        return build_forward_batch(ids, spans, set(), self.cache.block_size, self.window, rows,
                                   device=self.model.device)

    def _tables(self, span: DraftSpan, last: int) -> tuple[list[int], list[int]]:
        """Block tables padded with -1 up to position ``last``, so that no position maps to another's row."""
        return pad_tables(span.block_table, span.window_block_table, last, self.cache.block_size)

    @torch.inference_mode()
    def propose(self, spans: list[DraftSpan], streams: torch.Tensor) -> Proposal:
        """Catch the MTP block up over ``spans`` (``streams``: the target's [T, n, D]) and draft for the
        spans that ask."""
        if self.graphs is not None and spans and self._graphable(spans):
            return self._propose_padded(spans, streams)
        self._forwards = 0
        split = self._split(spans) if self.graphs is not None and spans else None
        if split is not None:  # a step with prompt chunks: one eager catch-up, then the graphs
            head, tails = split
            self._propose(head, streams)
            return self._propose_padded(tails, streams)
        proposal = self._propose(spans, streams)
        if self.model.ep is not None:  # the expert-parallel peers run the block k times a step
            for _ in range(self.k - self._forwards):
                self.drafter.dummy_step()
        return proposal

    def dummy_step(self) -> None:
        """A step's drafting with no tokens: the block's k forwards' collectives (an expert-parallel rank's
        share of its peers')."""
        for _ in range(self.k):
            self.drafter.dummy_step()

    def _forward(self, *args) -> tuple[torch.Tensor, torch.Tensor]:
        self._forwards += 1
        return self.drafter.forward(*args)

    def _propose(self, spans: list[DraftSpan], streams: torch.Tensor) -> Proposal:
        if not spans:
            return Proposal([], [])
        seq_spans, ids, rows, out_rows = [], [], [], []
        for span in spans:
            n = len(span.next_ids)
            table, window = self._tables(span, span.start + n - 1 + self.k)
            seq_spans.append(SeqSpan(span.start, n, table, window, -1))
            ids.extend(span.next_ids)
            rows.extend(span.rows)
            if span.draft:
                out_rows.append(len(ids) - 1)
        batch = self._batch(seq_spans, ids, out_rows)
        index = torch.tensor(rows, dtype=torch.long).to(streams.device, non_blocking=True)
        next_ids = torch.tensor(ids, dtype=torch.long).to(streams.device, non_blocking=True)
        logits, out = self._forward(batch, self.cache, streams[index], next_ids)
        drafting = [s for s in spans if s.draft]
        if not drafting:
            return Proposal([], [])
        h = out[batch.logits_indices]
        tokens, confs = [], []
        positions = [s.start + len(s.next_ids) for s in drafting]  # where draft 1's input token sits
        for j in range(self.k):
            probs = torch.softmax(logits, dim=-1)
            conf, token = probs.max(dim=-1)
            tokens.append(token)
            confs.append(conf)
            if j + 1 == self.k:
                break
            step_spans = []
            for s, p in zip(drafting, positions):
                table, window = self._tables(s, p + j)
                step_spans.append(SeqSpan(p + j, 1, table, window, -1))
            batch = self._batch(step_spans, [0] * len(drafting), list(range(len(drafting))))
            logits, h = self._forward(batch, self.cache, h, token)
        draft_ids = torch.stack(tokens, dim=1).tolist()
        confidences = torch.stack(confs, dim=1).tolist()
        return Proposal(draft_ids, confidences)

    def _split(self, spans: list[DraftSpan]) -> tuple[list[DraftSpan], list[DraftSpan]] | None:
        """A step with longer spans (prompt chunks) as an eager catch-up without drafts (the spans that do not
        draft, and every drafting span but its last k + 1 positions) and the drafting spans' last k + 1
        positions at most, which the graphs take as a decode step's: the draft steps run in a graph
        instead of k - 1 eager forwards. None where the graphs cannot take the drafting spans."""
        drafting = sum(s.draft for s in spans)
        if not drafting or self.model.ep is not None or self.graphs.size_for(drafting) is None:
            return None
        q, head, tails = self.k + 1, [], []
        for s in spans:
            cut = len(s.next_ids) - q if s.draft else len(s.next_ids)
            if cut > 0:
                head.append(DraftSpan(s.start, s.rows[:cut], s.next_ids[:cut], s.block_table,
                                      s.window_block_table, False))
            if s.draft:
                cut = max(cut, 0)
                tails.append(DraftSpan(s.start + cut, s.rows[cut:], s.next_ids[cut:], s.block_table,
                                       s.window_block_table, True))
        return head, tails

    def _graphable(self, spans: list[DraftSpan]) -> bool:
        return (self.graphs.size_for(len(spans)) is not None
                and all(s.draft and 1 <= len(s.next_ids) <= self.k + 1 for s in spans))

    def catch_up_span(self, start: int, rows: list[int], block_table: list[int], window_block_table: list[int],
                      shift: int = 0) -> tuple[SeqSpan, list[int]]:
        """A padded catch-up's span of ``k + 1`` positions from ``start`` (its tables reaching ``k`` positions
        past its last, ``shift`` more where the span may move on that much) and the target streams' row of
        each position: ``rows``, its last one repeated."""
        q = self.k + 1
        table, window = pad_tables(block_table, window_block_table, start + q - 1 + self.k + shift,
                                   self.cache.block_size)
        return SeqSpan(start, q, table, window, -1), rows + rows[-1:] * (q - len(rows))

    def _propose_padded(self, spans: list[DraftSpan], streams: torch.Tensor) -> Proposal:
        """The catch-up padded to k + 1 positions per span and the draft steps, through ``self.graphs``."""
        catch, ids, rows, accepted = [], [], [], []
        for span in spans:
            seq_span, span_rows = self.catch_up_span(span.start, span.rows, span.block_table, span.window_block_table)
            catch.append(seq_span)
            rows += span_rows
            ids += span.next_ids + [0] * (self.k + 1 - len(span.next_ids))
            accepted.append(len(span.next_ids) - 1)
        drafts, confidences = self.graphs.propose(catch, ids, accepted, rows, streams)
        return Proposal(drafts.tolist(), confidences.tolist())

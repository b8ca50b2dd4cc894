"""DSparkProposer: drafts a block at once with the checkpoint's DSpark stages (DeepSeek-V4.1's ``mtp.{0,1,2}``).

After every target forward the stages' window rings are seeded with the target's hidden state at the
positions the step kept (every prefill chunk, the accepted prefix and bonus token of a verification):
``wkv(main_x)`` at each position (:meth:`DeepseekV41DSpark.seed`). A sequence that drafts then runs the
stages once over its block ``[the token after its last kept position, noise x (block - 1)]``: the block
attends the ring (positions up to the last kept one) and itself, not causally; the Markov head walks it
left to right (greedy) and the confidence head gives each position's probability of being accepted given
the positions before it were (a sigmoid of its logit), which the confidence scheduler multiplies into
survival estimates. The first ``k`` positions of the block are the drafts.

Positions a verification rejected keep whatever their ring rows held: a draft reads only positions up to
its sequence's last kept one, which the seeding of that step wrote.

Steps of decodes only may seed and draft through ``graphs`` instead
(:class:`~deepinfer_core.spec_decode.dspark_graph.DSparkGraphs`), from the kept tokens on the device,
over catch-up spans of ``k + 1`` positions laid out by :meth:`DSparkProposer.catch_up_span`.

With expert parallel every rank's step runs one draft pass over the stages (their MoE layers' dispatch and
combine), a rank with nothing to draft with no tokens (:meth:`DSparkProposer.dummy_step`), so that the
ranks' collectives line up; seeding holds no collective.
"""

from __future__ import annotations

import torch

from deepinfer_core.model.cache import ModelCache
from deepinfer_core.model.metadata import SeqSpan, build_forward_batch, pad_tables
from deepinfer_core.models.interface import Model
from deepinfer_core.spec_decode.dspark_graph import DSparkGraphs
from deepinfer_core.spec_decode.proposer import DraftSpan, Proposal


class DSparkProposer:
    """The :class:`~deepinfer_core.spec_decode.proposer.Proposer` of ``model.drafter`` (DSpark stages).

    ``graphs``: a :class:`~deepinfer_core.spec_decode.dspark_graph.DSparkGraphs` through which the runner
    drafts steps of decodes only (from the verification's result on the device); :meth:`propose`, the
    other steps' drafting, runs eagerly."""

    def __init__(self, model: Model, cache: ModelCache, num_speculative_tokens: int,
                 graphs: DSparkGraphs | None = None):
        drafter = model.drafter
        if drafter is None or not hasattr(drafter, "block_size"):
            raise ValueError("speculative_config method 'dspark' needs a checkpoint with DSpark stages (mtp.* "
                             "weights and dspark_block_size in its config)")
        if num_speculative_tokens > drafter.block_size:
            raise ValueError(f"num_speculative_tokens {num_speculative_tokens} is more than the DSpark block "
                             f"of this checkpoint drafts ({drafter.block_size})")
        self.model, self.drafter, self.cache, self.k = model, drafter, cache, num_speculative_tokens
        self.graphs = graphs

    @torch.inference_mode()
    def propose(self, spans: list[DraftSpan], streams: torch.Tensor) -> Proposal:
        """Seed the stages' rings over ``spans`` (``streams``: what the target's forward returned for the
        drafter, [T, targets * D]) and draft for the spans that ask."""
        proposal = self._propose(spans, streams) if spans else None
        if proposal is None:
            if self.model.ep is not None:  # the expert-parallel peers run a draft pass this step
                self.dummy_step()
            return Proposal([], [])
        return proposal

    def _propose(self, spans: list[DraftSpan], streams: torch.Tensor) -> Proposal | None:
        """Seed and draft; None where no span drafts (no draft pass ran)."""
        seq_spans, rows, last_rows, n = [], [], [], 0
        for span in spans:
            seq_spans.append(SeqSpan(span.start, len(span.next_ids), span.block_table, span.window_block_table, -1))
            rows += span.rows
            n += len(span.next_ids)
            if span.draft:
                last_rows.append(n - 1)
        batch = build_forward_batch([0] * n, seq_spans, set(), self.cache.block_size, self.model.cfg.sliding_window,
                                    last_rows, device=self.model.device)
        index = torch.tensor(rows, dtype=torch.long).to(streams.device, non_blocking=True)
        self.drafter.seed(streams[index], batch, self.cache)
        drafting = [s for s in spans if s.draft]
        if not drafting:
            return None
        device = streams.device
        tokens = torch.tensor([s.next_ids[-1] for s in drafting], dtype=torch.long).to(device, non_blocking=True)
        positions = torch.tensor([s.start + len(s.next_ids) - 1 for s in drafting], dtype=torch.long).to(device)
        window_rows = batch.window_rows()[batch.logits_indices]
        ids, _, confidence = self.drafter.draft(tokens, positions, window_rows, self.cache)
        drafts = ids[:, 1: 1 + self.k].tolist()
        confidences = torch.sigmoid(confidence[:, : self.k]).tolist()
        return Proposal(drafts, confidences)

    def catch_up_span(self, start: int, rows: list[int], block_table: list[int], window_block_table: list[int],
                      shift: int = 0) -> tuple[SeqSpan, list[int]]:
        """A padded seeding's span of ``k + 1`` positions from ``start`` (its tables reaching its last, ``shift``
        more where the span may move on that much, -1 past the blocks the step holds) and the target state's
        row of each position: ``rows``, its last one repeated."""
        q = self.k + 1
        table, window = pad_tables(block_table, window_block_table, start + q - 1 + shift, self.cache.block_size)
        return SeqSpan(start, q, table, window, -1), rows + rows[-1:] * (q - len(rows))

    def dummy_step(self) -> None:
        """A step's drafting with no tokens: one pass over the stages' MoE collectives."""
        self.drafter.dummy_step()

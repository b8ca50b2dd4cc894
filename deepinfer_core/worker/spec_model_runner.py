"""SpecDecodeModelRunner: a step with speculative decoding (MTP drafts, one varlen verification forward).

Every sequence's span of the step is computed in one target forward: prefill chunks, plain decodes and
verifications ([last token + drafts], every position's logits kept). Plain rows are sampled as usual;
verification rows go through the rejection sampler. The rows rejected drafts wrote are then put back
(``spec_decode/rollback.py``), the MTP block catches up over the kept positions and drafts for the next
step. The target forward replays a captured graph when the runner has one for the step's shape: every
sequence a plain decode, or every one a verification of the same number of drafts
(``GraphRunner.query_lens``: 1 and 1 + k, every 1 + j with confidence scheduling). A decode-only step
of unequal spans is padded to the shortest graph that holds its longest span with filler tokens (always
rejected; the undo log puts their writes back); steps with prefill chunks run eagerly. Drafting replays
the proposer's graphs (``spec_decode/mtp_graph.py``, ``spec_decode/dspark_graph.py``) when every span
drafts from at most k + 1 kept positions.

A plain step (``SchedulerOutput.speculate`` False: the engine's gate found plain decode faster) runs as
the plain runner runs it, with no drafting: the MTP block's window rows of its positions are left as
they were, which costs the first drafts after it acceptance, never correctness.

A step is launched in two halves: ``execute_model`` runs the target forward, the samplers and the
rollback, and returns; the rest (the new tokens to the host, and for most steps the drafts) runs when
the output is asked for, or when the next step is launched, whichever comes first. A step of decodes
only (verifications and plain samples) whose batch a drafting graph holds launches its drafting right
after verification, laid out on the device from the accepted counts; steps with prefill chunks draft in
the second half, from the accepted counts read back. A verification's row j is masked by its grammar
after its drafts before j (``SchedulerOutput.grammar_bitmask``), then penalised by its outputs and those
drafts; one that asks for logprobs gets the plain sampler's at each kept position. Masked or penalised
verifications are not chained. With async scheduling the engine schedules the next step while
the first half runs on the device. Such a step's sequences carry placeholders (their token of the step
before and its drafts) at the positions they would have if that step accepted nothing; the runner
shifts each span by the drafts the step before accepted and fills in the tokens. When the step before
drafted on the device and this one is verifications only (``_chains``), that happens on the device
too: the step launches before the step before ends, its layout and its drafting layout derived there by
graphs of their own from the per-sequence facts the host knows (``derive_padded``), and a sampled
verification's noise hashed there from the output positions the shift gives (``verify_noise_at``), so
the host never waits for a step before queueing the next.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from deepinfer_core.engine.scheduler_output import ScheduledSeq, SchedulerOutput
from deepinfer_core.engine.sequence import PLACEHOLDER
from deepinfer_core.model.metadata import BEFORE_START, PaddedFacts, SeqSpan, build_forward_batch, pad_tables
from deepinfer_core.spec_decode.chain_graph import ChainGraphs
from deepinfer_core.spec_decode.confidence import StepProfile
from deepinfer_core.spec_decode.dspark_graph import DSparkGraphs
from deepinfer_core.spec_decode.dspark_proposer import DSparkProposer
from deepinfer_core.spec_decode.mtp_graph import MtpGraphs
from deepinfer_core.spec_decode.mtp_proposer import MtpProposer
from deepinfer_core.spec_decode.proposer import DraftSpan, Proposer
from deepinfer_core.spec_decode.rollback import CacheUndo
from deepinfer_core.spec_decode.verifier import Verification, Verifier
from deepinfer_core.spec_decode.verify_graph import VerifyGraphs
from deepinfer_core.worker.graph_runner import EXTRA_ROWS
from deepinfer_core.worker.model_runner import CachedRequestState, ModelRunner
from deepinfer_core.worker.outputs import EMPTY_OUTPUT, ModelRunnerOutput


class _Pending:
    """A launched step; ``get_output`` runs its second half once (an error in it is raised each time)."""

    def __init__(self, complete):
        self._complete, self._output, self._error = complete, None, None

    def get_output(self) -> ModelRunnerOutput:
        if self._error is not None:
            raise self._error
        if self._output is None:
            try:
                self._output = self._complete()
            except Exception as exc:
                self._error = exc
                raise
            self._complete = None
        return self._output


@dataclass
class _Chain:
    """A step that drafted on the device, whose results the next step, launched before it ends, takes
    from there (per row: :class:`~deepinfer_core.spec_decode.chain_graph.ChainGraphs`)."""

    pending: _Pending
    rows: dict[int, int]  # seq id -> row


class _HostCopy:
    """Device tensors on their way to the host (``Platform.to_host``); ``lists`` waits for them."""

    def __init__(self, platform, tensors: list[torch.Tensor]):
        self._tensors, self._ready = platform.to_host(tensors)

    def lists(self) -> list[list]:
        if self._ready is not None:
            self._ready.synchronize()
        return [t.tolist() for t in self._tensors]


class SpecDecodeModelRunner(ModelRunner):
    def __init__(self, *args, num_speculative_tokens: int = 1, profile_steps: bool = False, method: str = "mtp",
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.k = num_speculative_tokens
        self.verifier = Verifier(self.sampler, self.platform)
        # what the confidence scheduler prices a decode step by: its graph's time
        self.step_profile = None
        if profile_steps and self.graph_runner is not None:
            self.step_profile = StepProfile(self.graph_runner.profile_steps())
        self.proposer: Proposer
        graphs_of = DSparkGraphs if method == "dspark" else MtpGraphs
        drafting_graphs = None
        # under expert parallel the drafting runs eagerly (its collectives exchange their sizes), the same
        # drafter collectives on every rank, placeholder steps included (the proposers' ``propose``)
        if self.graph_runner is not None and self.model.ep is None:
            drafting_graphs = graphs_of(self.model, self.cache, self.graph_runner.sizes, num_speculative_tokens,
                                        capture=bool(self.graph_runner.graphs), platform=self.platform)
        proposer_of = DSparkProposer if method == "dspark" else MtpProposer
        self.proposer = proposer_of(self.model, self.cache, num_speculative_tokens, drafting_graphs)
        self._step_graphs: tuple[Any, VerifyGraphs, ChainGraphs] | None = None
        if self.graph_runner is not None:
            self._graphs_of(self.graph_runner)
        self.num_layers = self.model.cfg.num_hidden_layers
        self._pending: _Pending | None = None  # the launched step whose second half has not run yet
        self._accepted: dict[int, int] = {}  # seq id -> drafts its last step accepted
        self._drafts: dict[int, list[int]] = {}  # seq id -> the drafts its last step proposed
        self._stream_rows: dict[tuple[int, int], torch.Tensor] = {}  # see _catch_up_rows
        self._chain: _Chain | None = None  # the device results of ``_pending``, when it drafted on the device

    def execute_model(self, so: SchedulerOutput) -> _Pending:
        if self._pending is not None:
            if self._chains(so):  # laid out on the device from the step before's result, which may be in flight
                return self._execute_chained(so)
            pending, self._pending = self._pending, None  # the step before ends first: this one builds on it
            pending.get_output()
        self._chain = None
        self._forget(so.finished_seq_ids)
        if not so.speculate:  # a plain decode step: no drafting, the plain (async) pipeline
            for s in so.scheduled:
                self._accepted[s.seq_id], self._drafts[s.seq_id] = 0, []
            return super().execute_model(so)
        self._update_states(so)
        mask_rows = self._mask_rows(so.scheduled)
        so = dataclasses.replace(so, scheduled=[self._resolve(s) for s in so.scheduled])
        # image rows (only prompt positions have them): such a step runs eagerly and unpadded, so each span's
        # rows follow the one before's, as the plain runner lays them out (the graphs carry no image rows)
        mm = self._mm_embeds(so)
        q = self._graph_query_len(so.scheduled) if mm is None else None
        spans, ids, rows, plain, verifies, starts = [], [], [], [], [], []
        draft, filler = [], []
        for i, s in enumerate(so.scheduled):
            if s.restore_boundary is not None:
                self.cache.restore_boundary(s.restore_boundary, s.state_slot, s.start)
            extra = q - len(s.token_ids) if q else 0
            spans.append(SeqSpan(s.start, len(s.token_ids) + extra, *self._tables(s, extra), s.state_slot,
                                 s.write_from, self._history(s), replay_from=s.replay_from))
            starts.append(len(ids))
            ids.extend(s.token_ids + [s.token_ids[-1]] * extra)
            n_plain = len(s.token_ids) - s.num_drafts
            draft += [False] * n_plain + [True] * (s.num_drafts + extra)
            filler += [False] * len(s.token_ids) + [True] * extra
            last = starts[-1] + len(s.token_ids) - 1  # the span's last real token
            if s.sample and s.num_drafts:
                verifies.append(Verification(i, last - s.num_drafts if q else len(rows), self.requests[s.seq_id],
                                        s.token_ids[n_plain:]))
                rows.extend(range(last - s.num_drafts, last + 1))
            elif s.sample:
                plain.append((i, last if q else len(rows)))
                rows.append(last)
        graphs = self.graph_runner
        if q:  # every token's logits: a row's index is its token's
            rows = list(range(len(ids)))
        pad = graphs.padding_for(spans, rows, eager=mm is not None) if graphs is not None else None
        host = build_forward_batch(ids, spans, self.model.compressor_specs(), self.block_size,
                                   self.model.cfg.sliding_window, rows, pad=pad,
                                   ngram=getattr(self.model, "ngram_size", 0))
        draft_mask = torch.tensor(draft + [False] * (host.num_tokens - len(draft)), dtype=torch.bool)
        filler_mask = torch.tensor(filler + [False] * (host.num_tokens - len(filler)), dtype=torch.bool)
        undo = None
        in_graph = pad is not None and getattr(graphs, "prologue", None) is not None  # the graph saves the rows
        if (verifies or any(filler)) and not in_graph:
            undo = CacheUndo(self.cache, host, draft_mask, self.num_layers, self.model.device)
        if pad is not None:  # the graph's buffers: read (sampled, drafted from) before the next replay
            if in_graph:
                logits, streams, undo = graphs.replay_step(graphs.load(host))
            else:
                logits, streams = graphs.replay_with_streams(graphs.load(host))
        else:
            batch = host.with_storage(self.platform.upload(host.packed()))
            batch.mm = mm
            logits, streams = self.model.forward(batch, self.cache)

        plain_out = verified = plain_samples = verified_logprobs = None
        if plain:
            states = [self.requests[so.scheduled[i].seq_id] for i, _ in plain]
            bitmask = so.grammar_bitmask
            if bitmask is not None:
                bitmask = bitmask[[mask_rows[i] for i, _ in plain]]
            index = torch.tensor([r for _, r in plain], dtype=torch.long, device=logits.device)
            plain_samples = self.sampler(logits.index_select(0, index), states, bitmask)
            self.sampler.count_outputs(states, plain_samples.sampled_token_ids.unsqueeze(1))
            plain_out = plain_samples.to_host(self.platform)
        fillers = filler_mask if any(filler) else None  # on the host: a uniform verification never reads it
        if verifies:
            lengths = {len(s.token_ids) for s in so.scheduled}
            span = q or (next(iter(lengths)) if len(lengths) == 1 else None)
            masks = None if so.grammar_bitmask is None else (so.grammar_bitmask, mask_rows)
            verified, verified_logprobs = self.verifier.verify(logits, verifies, undo, draft_mask, fillers, starts,
                                                       so.scheduled, span, masks)
        elif undo is not None:
            undo.restore(fillers.to(logits.device))
        drafted = windows = None
        if self._drafts_on_device(so.scheduled):
            drafted = self._draft_on_device(so.scheduled, streams, starts, plain, plain_samples, verifies, verified)
        else:
            # the window blocks as the step saw them: once it ends, the engine releases those the next
            # query cannot see, which the drafter's query at the step's first position may still see
            windows = [list(s.window_block_table) for s in so.scheduled]
        if verified is not None:  # on its way to the host now: the next step may be queued before it is read
            verified = _HostCopy(self.platform, [verified.output_token_ids, verified.num_accepted]
                                 + (verified_logprobs or []))
        if drafted is not None:
            drafted = _HostCopy(self.platform, list(drafted))
        self._pending = _Pending(lambda: self._complete(so, streams, starts, plain, plain_out, verifies, verified,
                                                        drafted, windows))
        if drafted is not None:
            self._chain.pending = self._pending
        if self.model.ep is not None:  # the drafting's collectives meet the expert-parallel peers' in this step
            self._pending.get_output()
        return self._pending

    def _forget(self, seq_ids: list[int]) -> None:
        """Drop all the runner keeps of sequences that left."""
        for seq_id in seq_ids:
            self._accepted.pop(seq_id, None)
            self._drafts.pop(seq_id, None)
        self._drop(seq_ids)

    def _chains(self, so: SchedulerOutput) -> bool:
        """Whether the step can launch while the step before is in flight, laid out on the device from its
        result (``self._chain``): that step drafted on the device and its output is not read yet; this one
        is a speculative step of verifications only, every span its sequence's placeholders (moved on
        by that step's accepted drafts) with at most k drafts (those past ``max_tokens`` once moved on are
        dropped on the device), in a batch that a verification graph with the undo log inside and a
        drafting graph hold. Sequences of the step before may leave (see :meth:`_execute_chained`)."""
        chain, graphs, k = self._chain, self.graph_runner, self.k
        if (chain is None or chain.pending is not self._pending or self._pending._output is not None
                or not so.speculate or not so.scheduled or so.grammar_bitmask is not None
                or getattr(graphs, "prologue", None) is None
                or self.proposer.graphs is None or self.proposer.graphs.size_for(len(so.scheduled)) is None):
            return False
        for s in so.scheduled:
            state = self.requests.get(s.seq_id)
            if (state is None or s.seq_id not in chain.rows or not s.sample or s.restore_boundary is not None
                    or len(s.token_ids) != 1 + s.num_drafts or s.num_drafts > k
                    or any(t != PLACEHOLDER for t in s.token_ids)):
                return False
        q = self._chained_query_len(so.scheduled)
        return q is not None and self._chained_padding(so.scheduled, q) is not None

    def _chained_query_len(self, scheduled: list[ScheduledSeq]) -> int | None:
        """The tokens per sequence of the verification graph a chained step replays: the smallest captured
        length that holds its longest span (a confidence-scheduled step verifying fewer drafts replays a
        shorter graph, where one is captured)."""
        longest = 1 + max(s.num_drafts for s in scheduled)
        return next((q for q in self.graph_runner.query_lens if q >= max(longest, 2)), None)

    def _chained_spans(self, scheduled: list[ScheduledSeq], q: int) -> list[SeqSpan]:
        """The spans of ``q`` tokens of a chained step where the step before accepted nothing, their tables
        reaching as far as if it accepted every draft."""
        return [SeqSpan(s.start, q, *pad_tables(s.block_table, s.window_block_table, s.start + self.k + q - 1,
                                                self.block_size), s.state_slot, s.write_from) for s in scheduled]

    def _chained_history(self, s: ScheduledSeq) -> list[int]:
        """An n-gram model's chained span: the ``n - 1`` tokens before its first position where the step
        before accepted nothing (BEFORE_START before the sequence), all on the host; the device moves them
        on by the drafts that step accepted (``ChainGraphs``)."""
        history = self._history(s)
        return [BEFORE_START] * (self.graph_runner.ngram - 1 - len(history)) + history

    def _chained_padding(self, scheduled: list[ScheduledSeq], q: int):
        probe = [SeqSpan(s.start + self.k, q, [], [], -1) for s in scheduled]
        return self.graph_runner.local_padding(probe, list(range(len(probe) * q)))

    def _execute_chained(self, so: SchedulerOutput) -> _Pending:
        """Launch a step of verifications before the step before ends (see :meth:`_chains`): its spans
        moved on, its tokens and drafts filled in, its layout derived and its drafting laid out on the
        device, from the step before's result there; the host reads nothing until this step's output.
        The sequences that leave are forgotten once the step before's output, which holds them, is in."""
        prev, chain = self._pending, self._chain
        self._update_states(so, drop_finished=False)
        scheduled, graphs = so.scheduled, self.graph_runner
        n, q = len(scheduled), self._chained_query_len(scheduled)
        spans, pad = self._chained_spans(scheduled, q), self._chained_padding(scheduled, q)
        known = [self._chained_history(s) for s in scheduled] if graphs.ngram else []
        spans = [dataclasses.replace(sp, history=h) for sp, h in zip(spans, known)] or spans
        facts = PaddedFacts.from_spans(spans, [0] * (n * q), pad, self.block_size, self.model.cfg.sliding_window,
                                       window_blocks=graphs.facts_window_blocks(q))
        states = [self.requests[s.seq_id] for s in scheduled]
        verify_graphs, chain_graphs = self._graphs_of(graphs)
        extra = np.zeros((graphs.extra_rows, pad.num_seqs), dtype=np.int64)
        extra[0] = chain_graphs.zero_row
        extra[:EXTRA_ROWS, :n] = [[chain.rows[s.seq_id] for s in scheduled], [s.num_drafts for s in scheduled],
                                  [self._room(st) for st in states]]
        if known:
            extra[EXTRA_ROWS:, :n] = np.array(known, dtype=np.int64).T
        device, _ = graphs.load_facts(pad, facts, extra)
        shift, num_drafts = chain_graphs.apply((pad.num_seqs, pad.context, pad.query_len), n)
        ids = device.input_ids[: n * q].view(n, q)
        sampled = None if all(st.params.greedy for st in states) else self.verifier.sampling(states, shift)
        batch = graphs.derive(pad, n)
        logits, streams, undo = graphs.replay_step(batch)
        penalised = states if any(st.params.has_penalties for st in states) else None
        if sampled is None and penalised is None:
            out = verify_graphs.verify(batch, logits, num_drafts, undo, q)
        else:
            out = self.verifier.verify_rows(logits, ids[:, 1:], num_drafts, undo, q, batch.num_tokens, sampled,
                                            penalised)
        catch = [self.proposer.catch_up_span(sp.context_len, [], sp.block_table, sp.window_block_table, self.k)[0]
                 for sp in spans]
        stream_rows = self._catch_up_rows(n, q, logits.device)
        kept = out.output_token_ids
        if q < self.k + 1:
            kept = torch.cat([kept, kept.new_full((n, self.k + 1 - q), -1)], dim=1)
        drafted = self._propose_chained(scheduled, catch, kept, out.num_accepted, stream_rows, streams, shift)
        verifies = [Verification(i, i * q, self.requests[s.seq_id], []) for i, s in enumerate(scheduled)]
        logprobs = []
        if any(v.state.params.logprobs is not None for v in verifies):
            logprobs = self.verifier.logprobs(logits[: n * q], out.output_token_ids, verifies)
        verified = _HostCopy(self.platform, [out.output_token_ids, out.num_accepted] + logprobs)
        drafted = _HostCopy(self.platform, list(drafted))

        def complete() -> ModelRunnerOutput:
            prev.get_output()  # the step before's tokens go in first
            self._forget(so.finished_seq_ids)
            return self._complete(so, streams, [], [], None, verifies, verified, drafted, None)

        self._pending = self._chain.pending = _Pending(complete)
        return self._pending

    def _graphs_of(self, runner) -> tuple[VerifyGraphs, ChainGraphs]:
        """The greedy verification and chain graphs of ``runner`` (captured with the runner's own graphs;
        made here for a runner given after construction)."""
        if self._step_graphs is None or self._step_graphs[0] is not runner:
            self._step_graphs = (runner, VerifyGraphs(runner), ChainGraphs(runner, self.k))
        return self._step_graphs[1:]

    def _drafts_on_device(self, scheduled: list[ScheduledSeq]) -> bool:
        """Whether the step drafts right after verification, from its result on the device: every span a
        sampled decode (a verification or a plain sample), in a batch a drafting graph holds."""
        graphs = self.proposer.graphs
        return (graphs is not None and graphs.size_for(len(scheduled)) is not None
                and all(s.sample and len(s.token_ids) == 1 + s.num_drafts for s in scheduled))

    def _draft_on_device(self, scheduled: list[ScheduledSeq], streams: torch.Tensor, starts: list[int],
                         plain: list, plain_samples, verifies: list[Verification], verified
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """Launch the MTP catch-up and drafting over each span's kept positions, which the device knows:
        a verification's accepted drafts and bonus token, a plain sample's token. ([n, k] drafts, their
        probabilities), on the device."""
        device, n, q = streams.device, len(scheduled), self.k + 1
        catch, rows = [], []
        for i, s in enumerate(scheduled):
            span, span_rows = self.proposer.catch_up_span(s.start, list(range(starts[i], starts[i] + len(s.token_ids))),
                                                          s.block_table, s.window_block_table)
            catch.append(span)
            rows += span_rows
        index = self.platform.upload(torch.tensor([v.index for v in verifies] + [i for i, _ in plain] + rows,
                                                  dtype=torch.long))
        verify_index, plain_index, rows = index.split([len(verifies), len(plain), len(rows)])
        ids = torch.zeros((n, q), dtype=torch.long, device=device)
        accepted = torch.zeros(n, dtype=torch.long, device=device)
        if verifies:
            ids[verify_index, : verified.output_token_ids.shape[1]] = verified.output_token_ids
            accepted[verify_index] = verified.num_accepted
        if plain:
            ids[plain_index, 0] = plain_samples.sampled_token_ids
        return self._propose_chained(scheduled, catch, ids, accepted, rows, streams, None)

    def _propose_chained(self, scheduled: list[ScheduledSeq], catch: list[SeqSpan], ids: torch.Tensor,
                         accepted: torch.Tensor, rows: torch.Tensor, streams: torch.Tensor,
                         shift: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft through the graphs from the kept tokens ``ids`` [n, k + 1] (``accepted`` [n] past the first)
        and leave the next step what it needs to launch before this one ends (``self._chain``)."""
        tokens, confs = self.proposer.graphs.propose(catch, ids.view(-1), accepted, rows, streams, shift)
        if self.graph_runner is not None:  # a chained step may follow
            self._graphs_of(self.graph_runner)[1].keep(ids.gather(1, accepted.unsqueeze(1)).squeeze(1), accepted,
                                                       tokens, ids)
        self._chain = _Chain(None, {s.seq_id: i for i, s in enumerate(scheduled)})
        return tokens, confs

    def _graph_query_len(self, scheduled: list[ScheduledSeq]) -> int | None:
        """The tokens per sequence of a graph that runs this step with every span padded by filler tokens
        (always rejected, their cache writes put back), or None: run it as scheduled. A step qualifies
        when every span is a sampled decode (its last token and its drafts, no prefill) and the spans
        differ in length or share one no graph is captured for."""
        graphs = self.graph_runner
        if graphs is None or not scheduled or len(graphs.query_lens) < 2:
            return None
        if any(not s.sample or len(s.token_ids) != 1 + s.num_drafts for s in scheduled):
            return None
        longest = max(len(s.token_ids) for s in scheduled)
        if longest in graphs.query_lens and all(len(s.token_ids) == longest for s in scheduled):
            return None  # already one graph's shape
        q = next((n for n in graphs.query_lens if n >= longest), None)
        probe = [SeqSpan(s.start, q, [], [], -1) for s in scheduled] if q else []
        return q if q and graphs.local_padding(probe, list(range(len(probe) * q))) is not None else None

    def _tables(self, s: ScheduledSeq, extra: int) -> tuple[list[int], list[int]]:
        """The span's block tables, with -1 for the blocks that only ``extra`` filler tokens reach (their
        writes go to the trash, never to another position's rows)."""
        if not extra:
            return s.block_table, s.window_block_table
        return pad_tables(s.block_table, s.window_block_table, s.start + len(s.token_ids) + extra - 1, self.block_size)

    @staticmethod
    def _room(state: CachedRequestState) -> int:
        """Drafts a chained verification of ``state`` may hold below ``max_tokens``, less the drafts the step
        before (its output not in ``state`` yet) accepts."""
        max_tokens = state.params.max_tokens
        return 1 << 30 if max_tokens is None else max_tokens - len(state.output_token_ids) - 2

    def _resolve(self, s: ScheduledSeq) -> ScheduledSeq:
        """A span scheduled before its sequence's step before ended: shifted by the drafts that step
        accepted, its token and drafts filled in, and no draft past ``max_tokens`` (the host, not knowing
        the accepted count, may have scheduled more)."""
        if PLACEHOLDER not in s.token_ids:
            return s
        drafts = self._drafts.get(s.seq_id, [])
        if not s.sample or len(s.token_ids) != 1 + s.num_drafts or s.num_drafts > len(drafts):
            raise RuntimeError(f"sequence {s.seq_id}: placeholders only stand for the last token and its drafts")
        state = self.requests[s.seq_id]
        n, max_tokens = s.num_drafts, state.params.max_tokens
        if max_tokens is not None:
            n = max(0, min(n, max_tokens - len(state.output_token_ids) - 1))
        return dataclasses.replace(s, start=s.start + self._accepted.get(s.seq_id, 0), num_drafts=n,
                                   token_ids=[state.output_token_ids[-1]] + drafts[:n])

    def _complete(self, so: SchedulerOutput, streams: torch.Tensor, starts: list[int], plain: list,
                  plain_out, verifies: list[Verification], verified, drafted: tuple[torch.Tensor, torch.Tensor] | None,
                  windows: list[list[int]] | None) -> ModelRunnerOutput:
        """The second half of a step: the new tokens on the host, then the drafts ``drafted`` on the device
        (every span's), or drafting here (``windows``: the spans' window block tables at launch); the
        output."""
        new_tokens: dict[int, list[int]] = {}  # scheduled index -> its new tokens
        logprobs: dict[int, list[dict[int, float]] | None] = {}  # scheduled index -> its new tokens' logprobs
        dead_ends = {}
        if verifies:
            tokens, counts, *lps = verified.lists()
            for i, (v, row, n) in enumerate(zip(verifies, tokens, counts)):
                new_tokens[v.index] = row[: n + 1]
                m = v.state.params.logprobs
                if lps and m is not None:
                    ids, values = (x[i * len(row): i * len(row) + n + 1] for x in lps)
                    logprobs[v.index] = [dict(zip(a[: m + 1], b[: m + 1])) for a, b in zip(ids, values)]
        if plain_out is not None:
            states = [self.requests[so.scheduled[i].seq_id] for i, _ in plain]
            tokens, lps = plain_out.tolists(states)
            for (i, _), token, lp, j in zip(plain, tokens, lps, range(len(plain))):
                new_tokens[i], logprobs[i] = [token], None if lp is None else [lp]
                if plain_out.dead_ends is not None:
                    dead_ends[i] = plain_out.dead_ends[j]
        if drafted is not None:
            drafts = dict(enumerate(zip(*drafted.lists())))
        else:
            drafts = self._draft(so, streams, starts, new_tokens, windows)
        out = self._output(so, new_tokens, logprobs, dead_ends, drafts)
        for seq_id, tokens, drafts in zip(out.seq_ids, out.new_token_ids or [], out.draft_token_ids or []):
            self._accepted[seq_id], self._drafts[seq_id] = len(tokens) - 1, list(drafts)
        return out

    @staticmethod
    def _mask_rows(scheduled: list[ScheduledSeq]) -> dict[int, int]:
        """Scheduled index -> the first of its grammar bitmask rows (a row for its token, one per draft)."""
        rows, row = {}, 0
        for i, s in enumerate(scheduled):
            if s.sample:
                rows[i], row = row, row + 1 + s.num_drafts
        return rows

    def _catch_up_rows(self, n: int, q: int, device: torch.device) -> torch.Tensor:
        """The verification rows of ``n`` spans of ``q`` tokens that a chained catch-up reads, ``k + 1`` a
        span: its ``q`` rows, the last repeated past them (never kept)."""
        rows = self._stream_rows.get((n, q))
        if rows is None:
            positions = torch.arange(self.k + 1, device=device).clamp(max=q - 1)
            rows = self._stream_rows[n, q] = (torch.arange(n, device=device).unsqueeze(1) * q + positions).view(-1)
        return rows

    def _draft(self, so: SchedulerOutput, streams: torch.Tensor, starts: list[int], new_tokens: dict[int, list[int]],
               windows: list[list[int]]) -> dict[int, tuple[list[int], list[float]]]:
        """Catch the MTP block up over the kept positions and draft: scheduled index -> (drafts, their
        probabilities) for the spans that draft."""
        spans, drafting = [], []
        for i, s in enumerate(so.scheduled):
            n_plain = len(s.token_ids) - s.num_drafts
            if s.sample:
                kept = new_tokens[i]
                nxt = s.token_ids[1:n_plain] + kept
            elif s.next_token_id is not None:
                nxt = s.token_ids[1:] + [s.next_token_id]
            else:
                continue
            spans.append(DraftSpan(s.start, list(range(starts[i], starts[i] + len(nxt))), nxt, s.block_table,
                                   windows[i], s.sample))
            if s.sample:
                drafting.append(i)
        proposal = self.proposer.propose(spans, streams)
        return dict(zip(drafting, zip(proposal.draft_token_ids, proposal.confidences)))

    def _output(self, so: SchedulerOutput, new_tokens: dict[int, list[int]], logprobs: dict, dead_ends: dict,
                drafts: dict[int, tuple[list[int], list[float]]]) -> ModelRunnerOutput:
        """Record the new tokens; the step's output."""
        out = ModelRunnerOutput(new_token_ids=[], draft_token_ids=[], draft_confidences=[], new_logprobs=[])
        any_dead = bool(dead_ends)
        for i, s in enumerate(so.scheduled):
            if not s.sample:
                continue
            state = self.requests[s.seq_id]
            state.output_token_ids.extend(new_tokens[i])
            self.sampler.mark_counted(state, len(new_tokens[i]))  # counted on the device at launch
            out.seq_ids.append(s.seq_id)
            out.sampled_token_ids.append(new_tokens[i][0])
            lps = logprobs.get(i)
            out.logprobs.append(lps[0] if lps else None)
            out.new_logprobs.append(lps)
            out.new_token_ids.append(new_tokens[i])
            d, c = drafts.get(i, ([], []))
            out.draft_token_ids.append(d)
            out.draft_confidences.append(c)
            if any_dead:
                out.dead_ends = (out.dead_ends or []) + [dead_ends.get(i, False)]
        return out if out.seq_ids else EMPTY_OUTPUT

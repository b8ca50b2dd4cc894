"""ModelRunner: one step on one device. Builds the ForwardBatch from the scheduler output, runs the
forward (eagerly, or by replaying a captured graph when the step's shape has one), samples, and keeps
each sequence's sampling state across steps (vLLM's persistent batch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from deepinfer_core.engine.multimodal import MultiModalItem, gather_mm_embeds, mark_dead
from deepinfer_core.engine.scheduler_output import SchedulerOutput
from deepinfer_core.engine.sequence import PLACEHOLDER
from deepinfer_core.model.cache import ModelCache
from deepinfer_core.model.metadata import ForwardBatch, MultiModalEmbeds, SeqSpan, build_forward_batch
from deepinfer_core.models.interface import Model
from deepinfer_core.platform import Platform
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.sampling.sampler import Sampler, SamplerOutput
from deepinfer_core.worker.outputs import EMPTY_OUTPUT, ModelRunnerOutput, ReadyOutput


@dataclass
class CachedRequestState:
    """A sequence as the worker knows it: what sampling needs, kept from step to step."""

    seq_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    output_token_ids: list[int] = field(default_factory=list)  # PLACEHOLDER until a sample reaches the host
    mm_items: list[MultiModalItem] = field(default_factory=list)  # the prompt's images
    mm_embeds: dict[int, torch.Tensor] = field(default_factory=dict)  # their span rows, once computed


class _PendingOutput:
    """A launched step's samples on their way to the host."""

    def __init__(self, states: list[CachedRequestState], positions: list[int], host: SamplerOutput):
        self.states, self.positions, self.host = states, positions, host

    def get_output(self) -> ModelRunnerOutput:
        tokens, logprobs = self.host.tolists(self.states)
        for state, pos, token in zip(self.states, self.positions, tokens):
            if pos < len(state.output_token_ids):
                state.output_token_ids[pos] = token
        return ModelRunnerOutput([s.seq_id for s in self.states], tokens, logprobs, self.host.dead_ends)


class ModelRunner:
    def __init__(self, model: Model, cache: ModelCache, block_size: int, sampler: Sampler,
                 platform: Platform | None = None, graph_runner: Any = None):
        self.model, self.cache, self.block_size, self.sampler = model, cache, block_size, sampler
        self.platform = platform or Platform(model.device)
        if hasattr(model, "side_stream"):
            model.side_stream = self.platform.side_stream()
        self.graph_runner = graph_runner  # None: always eager
        self.requests: dict[int, CachedRequestState] = {}
        self._prev_rows: dict[int, int] = {}  # seq id -> row of the previous step's samples
        self._prev_tokens: torch.Tensor | None = None

    # --- one step --------------------------------------------------------------------------------

    def execute_model(self, so: SchedulerOutput) -> _PendingOutput | ReadyOutput:
        """Launch the step; the samples reach the host through the returned output's ``get_output``."""
        self._update_states(so)
        spans, ids, rows, states, fill = [], [], [], [], []
        for s in so.scheduled:
            if s.restore_boundary is not None:
                self.cache.restore_boundary(s.restore_boundary, s.state_slot, s.start)
            spans.append(SeqSpan(s.start, len(s.token_ids), s.block_table, s.window_block_table, s.state_slot,
                                 s.write_from, self._history(s), replay_from=s.replay_from))
            ids.extend(s.token_ids)
            if s.token_ids[-1] == PLACEHOLDER:  # the previous step's sample, still on the device
                fill.append((len(ids) - 1, self._prev_rows[s.seq_id]))
            if s.sample:
                rows.append(len(ids) - 1)
                states.append(self.requests[s.seq_id])
        mm = self._mm_embeds(so)
        batch = self.prepare(ids, spans, rows, eager=mm is not None)  # the graphs carry no image rows
        batch.mm = mm
        if fill:
            where = torch.tensor(fill, dtype=torch.long).to(self.model.device, non_blocking=True)
            batch.input_ids[where[:, 0]] = self._prev_tokens[where[:, 1]]
        logits = self.execute(batch)  # may be a graph's output buffer: sampled before the next execute
        if not states:
            return ReadyOutput(EMPTY_OUTPUT)
        out = self.sampler(logits, states, so.grammar_bitmask)
        self.sampler.count_samples(states, out.sampled_token_ids)  # a penalised next step may not wait for them
        positions = []
        for state in states:
            positions.append(len(state.output_token_ids))
            state.output_token_ids.append(PLACEHOLDER)
        self._prev_rows = {state.seq_id: row for row, state in enumerate(states)}
        self._prev_tokens = out.sampled_token_ids
        return _PendingOutput(states, positions, out.to_host(self.platform))

    def _history(self, s) -> list[int] | None:
        """An n-gram model's history of a scheduled span: the request's tokens just before its new ones
        (all on the host by now: only a span's own first token may still be a sample on the device)."""
        n = getattr(self.model, "ngram_size", 0)
        if not n:
            return None
        state = self.requests[s.seq_id]
        first = max(0, s.start - n + 1)
        prompt = state.prompt_token_ids
        history = (prompt[first:s.start] if s.start <= len(prompt) else
                   prompt[first:] + state.output_token_ids[max(0, first - len(prompt)):s.start - len(prompt)])
        if state.mm_items:  # image positions are dead to the n-grams
            history = mark_dead(history, first, state.mm_items)
        if PLACEHOLDER in history:
            raise RuntimeError(f"sequence {s.seq_id}: a token before position {s.start} is not on the host yet")
        return history

    def _mm_embeds(self, so: SchedulerOutput) -> MultiModalEmbeds | None:
        """The image rows of the step's positions; a request's images are encoded the first time a step
        reaches their spans (a prefix-cache hit over a whole span never encodes it) and kept while it lives."""
        parts, row = [], 0
        for s in so.scheduled:
            state = self.requests[s.seq_id]
            if state.mm_items:
                parts.append((row, s.start, s.start + len(s.token_ids), state.mm_items,
                              lambda k, state=state: self._image_rows(state, k)))
            row += len(s.token_ids)
        return gather_mm_embeds(parts) if parts else None

    def _image_rows(self, state: CachedRequestState, k: int) -> torch.Tensor:
        if k not in state.mm_embeds:
            state.mm_embeds[k] = self.model.embed_image(state.mm_items[k].data)
        return state.mm_embeds[k]

    def _update_states(self, so: SchedulerOutput, drop_finished: bool = True) -> None:
        if drop_finished:
            self._drop(so.finished_seq_ids)
        for new in so.new_requests:
            self.requests[new.seq_id] = CachedRequestState(new.seq_id, list(new.prompt_token_ids), new.params,
                                                           new.seed, mm_items=new.mm_items)

    def _drop(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self.requests.pop(seq_id, None)
            self.sampler.free(seq_id)

    def prepare(self, token_ids: list[int], spans: list[SeqSpan], logits_rows: list[int],
                eager: bool = False) -> ForwardBatch:
        """The step's batch on the model's device; padded to a captured shape when a graph will run it
        (never with ``eager``, which a step that reads image rows asks for)."""
        graphs = self.graph_runner  # asked even for an eager step: under expert parallel it is an agreement
        pad = graphs.padding_for(spans, logits_rows, eager=eager) if graphs is not None else None
        host = build_forward_batch(token_ids, spans, self.model.compressor_specs(), self.block_size,
                                   self.model.cfg.sliding_window, logits_rows, pad=pad,
                                   ngram=getattr(self.model, "ngram_size", 0))
        if pad is not None:
            return self.graph_runner.load(host)
        return host.with_storage(self.platform.upload(host.packed()))

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits (float32, or float64 in golden runs) of the batch's ``logits_indices`` rows.

        With a graph the result is a view of the graph's output buffer: consume it (sample) before the
        next ``execute``.
        """
        if self.graph_runner is not None and batch.padded_to is not None:
            return self.graph_runner.replay(batch)
        logits, _ = self.model.forward(batch, self.cache)
        return logits

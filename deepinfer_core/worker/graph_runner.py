"""Decode steps replayed from captured graphs: one graph per (batch size, context, query length) bucket
over static inputs.

A step of ``n`` sequences of ``q`` new tokens each (1 for decode; 1 + drafts for a speculative
verification, when the runner is built with that query length) whose longest has ``L`` tokens (with the
new ones) runs the graph of the smallest captured size >= ``n`` and the smallest context bucket >= ``L``
(powers of two of tokens, then ``max_model_len``): its compressed candidates, indexer work and block
tables follow the batch's real contexts, and ``max_model_len`` only decides how many buckets there are.
The rows past ``n`` are padding
sequences with no blocks and state slot -1, whose writes land in the cache's trash. All of a step's
index tensors live in one packed int64 device buffer per graph, filled by a single host-to-device copy
from one of two (pinned, where the platform has it) staging buffers every graph shares. Capture itself,
streams and events come from the backend's :class:`~deepinfer_core.platform.Platform`.

Under expert parallel (a ``coordinator``, :mod:`~deepinfer_core.parallel.batch_sync`) the ranks agree on
every step's graph before it runs: each pads to the largest rank's size bucket, a rank with nothing
scheduled replays that size over padding sequences only (:meth:`GraphRunner.placeholder_step`), and the
forward of every graph dispatches and combines at fixed shapes (the dispatcher's ``graph_shapes``).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import numpy as np
import torch

from deepinfer_core.model.cache import ModelCache
from deepinfer_core.model.metadata import (
    ForwardBatch,
    GraphPadding,
    PaddedFacts,
    SeqSpan,
    build_forward_batch,
    derive_padded,
)
from deepinfer_core.models.interface import Model
from deepinfer_core.parallel.batch_sync import BatchCoordinator, StepShape
from deepinfer_core.parallel.ep import graph_collectives
from deepinfer_core.parallel.eplb import padding_uncounted
from deepinfer_core.platform import Graph, Platform


def capture_sizes(max_size: int, step: int = 32) -> list[int]:
    """Batch sizes to capture: powers of two up to ``step``, then every ``step``, and ``max_size`` itself."""
    if max_size < 1:
        return []
    sizes = [1 << i for i in range(step.bit_length()) if 1 << i <= min(step, max_size)]
    sizes += list(range(2 * step, max_size + 1, step))
    return sorted(set(sizes) | {max_size})


#: per-sequence values a chained verification step loads with its facts (``GraphRunner.load_facts``); an
#: n-gram model's add ``GraphRunner.extra_rows - EXTRA_ROWS`` more: the history the step before starts from
EXTRA_ROWS = 3

#: the smallest context bucket (tokens) of the decode graphs
MIN_CONTEXT_BUCKET = 1024


def context_buckets(max_model_len: int, block_size: int, smallest: int = MIN_CONTEXT_BUCKET) -> list[int]:
    """Context capacities (tokens) of the decode graph layouts: powers of two from ``smallest`` below
    ``max_model_len``, then ``max_model_len`` itself, each rounded up to whole blocks."""
    top = -(-max(max_model_len, 1) // block_size) * block_size
    buckets, c = set(), max(smallest, 1)
    while c < top:
        buckets.add(-(-c // block_size) * block_size)
        c *= 2
    return sorted(buckets | {top})


class _Staging:
    """Two host buffers, as long as the largest graph's inputs, that every graph's inputs pass through
    (a buffer is refilled only after its previous copy has run)."""

    def __init__(self, numel: int, platform: Platform):
        self.buffers = [torch.empty(numel, dtype=torch.long, pin_memory=platform.pin_memory) for _ in range(2)]
        self.copied = [platform.new_event() for _ in range(2)]
        self.turn = 0

    def copy(self, host: ForwardBatch | torch.Tensor, packed: torch.Tensor) -> None:
        """``packed`` (device) := ``host``, a batch's packed tensors or a flat tensor."""
        k, self.turn = self.turn, 1 - self.turn
        if self.copied[k] is not None:
            self.copied[k].synchronize()
        staging = self.buffers[k][: packed.numel()]
        if isinstance(host, torch.Tensor):
            staging.copy_(host)
        else:
            host.packed(out=staging)
        packed.copy_(staging, non_blocking=True)
        if self.copied[k] is not None:
            self.copied[k].record()


class _StaticInputs:
    """The packed device buffer of one graph's inputs and its views as a ForwardBatch."""

    def __init__(self, host: ForwardBatch, platform: Platform):
        self.packed = host.packed().to(platform.device)
        self.batch = host.with_storage(self.packed)


class _StaticFacts:
    """A verification graph's facts on the device (``PaddedFacts`` views of one buffer, a padding layout's
    until loaded), followed by ``extra_rows * size`` values of the caller's."""

    def __init__(self, host: PaddedFacts, size: int, platform: Platform, extra_rows: int = EXTRA_ROWS):
        rows = extra_rows * size
        self.flat = torch.cat([host.packed(), torch.zeros(rows, dtype=torch.long)]).to(platform.device)
        self.facts = host.views(self.flat)
        self.extra = self.flat[-rows:].view(extra_rows, size)


class GraphRunner:
    """Pads decode steps to a captured (batch size, context) bucket and replays that bucket's graph.

    With ``capture=False`` (CPU tests) the padded static batch runs eagerly: the same inputs, buffers
    and padding as a replay, without the graph. ``min_context`` is the smallest context bucket;
    ``query_lens`` the new tokens per sequence a graph is captured for; ``keep_streams``: the graphs
    also return the last layer's streams (what the MTP drafter reads), see :meth:`replay_with_streams`;
    ``prologue(batch, query_len, shared)``: runs before the forward, inside the graph, its result returned
    by :meth:`replay_step` (``shared``: inside a capture, where it may write buffers every graph shares).
    """

    def __init__(self, model: Model, cache: ModelCache, sizes: list[int], max_model_len: int,
                 block_size: int, capture: bool = True, platform: Platform | None = None,
                 min_context: int = MIN_CONTEXT_BUCKET, query_lens: tuple[int, ...] = (1,),
                 keep_streams: bool = False, prologue: Callable[[ForwardBatch, int, bool], Any] | None = None):
        self.model, self.cache, self.block_size = model, cache, block_size
        self.platform = platform or Platform(model.device)
        self.sizes = sorted(sizes)
        self.contexts = context_buckets(max_model_len, block_size, min_context)
        self.query_lens = sorted(set(query_lens))
        self.keep_streams = keep_streams
        self.prologue = prologue
        self.coordinator: BatchCoordinator | None = None  # expert parallel: the ranks agree on each step's graph
        self.rates = sorted({spec.rate for spec in model.compressor_specs()})
        self.ngram = getattr(model, "ngram_size", 0)  # an n-gram model's layouts carry each sequence's history
        # a chained step's history: the one its span would have if the step before accepted nothing, which
        # the device moves on by the drafts that step accepted (``ChainGraphs``)
        self.extra_rows = EXTRA_ROWS + max(self.ngram - 1, 0)
        self.inputs: dict[tuple[int, int, int], _StaticInputs] = {}  # (size, context, query len) -> inputs
        self.graphs: dict[tuple[int, int, int], Graph] = {}
        for q in self.query_lens:
            for size in reversed(self.sizes):
                for context in reversed(self.contexts):
                    empty = build_forward_batch([], [], model.compressor_specs(), block_size,
                                                model.cfg.sliding_window, pad=self.layout(size, context, q),
                                                ngram=self.ngram)
                    self.inputs[size, context, q] = _StaticInputs(empty, self.platform)
        # the verification layouts the device derives from facts (``load_facts``, ``derive``)
        self.facts = {key: _StaticFacts(PaddedFacts.from_spans([], [], self.layout(*key), block_size,
                                                               model.cfg.sliding_window,
                                                               window_blocks=self.facts_window_blocks(key[2])),
                                        key[0], self.platform, self.extra_rows)
                      for key in self.inputs if key[2] > 1}
        self.derive_graphs: dict[tuple[int, int, int], Graph] = {}
        self.staging = _Staging(max(s.packed.numel() for s in self.inputs.values()), self.platform)
        if capture:
            self.capture()

    def layout(self, size: int, context: int, query_len: int = 1) -> GraphPadding:
        return GraphPadding(size, {rate: -(-context // rate) for rate in self.rates}, context, query_len, self.ngram)

    def padding_for(self, spans: list[SeqSpan], logits_rows: list[int], eager: bool = False
                    ) -> GraphPadding | None:
        """The graph layout for this step, or None when it must run eagerly (``eager``, prefill, too many
        sequences, sequences of unequal or uncaptured query lengths, a sequence longer than the largest
        context bucket). A step of q > 1 tokens per sequence must want every token's logits.

        With a coordinator this is the step's agreement with the other ranks (a collective: called once per
        forward, eager ones included): the layout of the largest rank's size bucket, or None for all."""
        local = None if eager else self.local_padding(spans, logits_rows)
        if self.coordinator is None:
            return local
        q = local.query_len if local is not None else 1
        agreed = self.coordinator.agree(StepShape(len(spans), q, local is not None))
        if agreed is None:
            return None
        return self.layout(self.sizes[bisect.bisect_left(self.sizes, agreed.num_seqs)], local.context, q)

    def placeholder_step(self) -> bool:
        """A rank with nothing scheduled: agree with the others (see :meth:`padding_for`), then replay the
        agreed graph size over padding sequences only, whose writes land in the cache's trash (True), or
        return False where the ranks run this step eagerly (the caller then runs the MoE collectives with
        no tokens)."""
        agreed = self.coordinator.agree(StepShape(0))
        if agreed is None:
            return False
        pad = self.layout(self.sizes[bisect.bisect_left(self.sizes, agreed.num_seqs)], self.contexts[0],
                          agreed.query_len)
        empty = build_forward_batch([], [], self.model.compressor_specs(), self.block_size,
                                    self.model.cfg.sliding_window, pad=pad, ngram=self.ngram)
        self.replay_step(self.load(empty))
        return True

    def local_padding(self, spans: list[SeqSpan], logits_rows: list[int]) -> GraphPadding | None:
        """:meth:`padding_for` on this rank alone: never a collective (for probes that may run on one rank
        only)."""
        n = len(spans)
        if not n or n > self.sizes[-1]:
            return None
        q = spans[0].num_new
        if q not in self.query_lens or any(s.num_new != q for s in spans):
            return None
        if logits_rows != list(range(n if q == 1 else n * q)):
            return None
        longest = max(s.context_len + q for s in spans)
        if longest > self.contexts[-1]:
            return None
        return self.layout(self.sizes[bisect.bisect_left(self.sizes, n)],
                           self.contexts[bisect.bisect_left(self.contexts, longest)], q)

    @staticmethod
    def key_of(batch: ForwardBatch) -> tuple[int, int, int]:
        return batch.padded_to, batch.padded_context, batch.num_tokens // batch.padded_to

    def load(self, host: ForwardBatch) -> ForwardBatch:
        """Copy a padded host batch into its graph's static inputs; returns the static batch (device views).

        Its ``input_ids`` may still be changed in place on the device before :meth:`replay`.
        """
        static = self.inputs[self.key_of(host)]
        self.staging.copy(host, static.packed)
        static.batch.query_start_loc = host.query_start_loc
        return static.batch

    def facts_window_blocks(self, query_len: int) -> int:
        """Window-table columns of a verification's facts: its window and ``query_len`` tokens from the
        shortest context it may have, up to ``max(query_lens) - 1`` positions further (the drafts the step
        before may accept)."""
        return (self.model.cfg.sliding_window + max(self.query_lens) + query_len - 1) // self.block_size + 2

    def load_facts(self, pad: GraphPadding, host: PaddedFacts, extra: np.ndarray) -> tuple[PaddedFacts, torch.Tensor]:
        """Copy ``host`` (``pad``'s shapes, ``facts_window_blocks`` window columns) and ``extra``
        ([extra_rows, size], the caller's) into the static facts of ``pad``'s graph, one copy; returns their
        device views, which may be changed in place before :meth:`derive`."""
        static = self.facts[pad.num_seqs, pad.context, pad.query_len]
        self.staging.copy(host.packed(extra), static.flat)
        return static.facts, static.extra

    def derive(self, pad: GraphPadding, num_seqs: int) -> ForwardBatch:
        """:meth:`load` of a batch laid out on the device from the static facts (:meth:`load_facts`) of
        ``pad``'s graph, by a graph of its own where captured, for ``num_seqs`` real sequences (see
        :func:`~deepinfer_core.model.metadata.derive_padded`)."""
        key = (pad.num_seqs, pad.context, pad.query_len)
        graph = self.derive_graphs.get(key)
        if graph is not None:
            graph.replay()
        else:
            self._derive(key)
        static, q = self.inputs[key], pad.query_len
        static.batch.query_start_loc = list(range(0, num_seqs * q + 1, q))
        return static.batch

    def _derive(self, key: tuple[int, int, int]) -> None:
        derive_padded(self.inputs[key].batch, self.facts[key].facts, self.model.compressor_specs(), self.block_size,
                      self.model.cfg.sliding_window)

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """The real sequences' logits rows (all their tokens' when q > 1)."""
        return self.replay_with_streams(batch)[0]

    def replay_with_streams(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits rows of the real tokens, the streams of every padded row or None without
        ``keep_streams``). Both may be the graph's output buffers: consume them before the next replay."""
        return self.replay_step(batch)[:2]

    def replay_step(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
        """:meth:`replay_with_streams` and the prologue's result (None without one)."""
        key = self.key_of(batch)
        graph, rows = self.graphs.get(key), batch.query_start_loc[-1]
        if graph is not None:
            graph.replay()
            logits, streams, pre = graph.output
        else:
            logits, streams, pre = self._forward(batch, key[2], shared=False)
        return logits[:rows], streams, pre

    def _forward(self, batch: ForwardBatch, query_len: int, shared: bool):
        pre = self.prologue(batch, query_len, shared) if self.prologue is not None else None
        with ExitStack() as fixed:
            for collective in graph_collectives(self.model):
                fixed.enter_context(collective.graph_shapes())
            with padding_uncounted(self.model, batch):
                logits, streams = self.model.forward(batch, self.cache)
        return logits, streams if self.keep_streams else None, pre

    def _shared_forward(self, key: tuple[int, int, int]):
        """The forward of ``key``'s static inputs with its outputs copied into buffers that every graph of
        that query length shares (a graph's own outputs stay allocated: one vocab-wide logits buffer per
        size and context bucket otherwise)."""
        q = key[2]
        logits, streams, pre = self._forward(self.inputs[key].batch, q, shared=True)
        outs = (logits, streams) if self.keep_streams else (logits,)
        if q not in self._outputs:  # the largest size comes first (and before capture, in a warm-up run)
            rows = self.sizes[-1] * q
            self._outputs[q] = tuple(t.new_empty((rows, *t.shape[1:])) for t in outs)
        views = []
        for buffer, t in zip(self._outputs[q], outs):
            buffer[: t.shape[0]].copy_(t)
            views.append(buffer[: t.shape[0]])
        return views[0], views[1] if self.keep_streams else None, pre

    @torch.inference_mode()
    def profile_steps(self, repeats: int = 3) -> dict[tuple[int, int], float]:
        """Seconds of one replay of each (size, query length) graph at the smallest context bucket, timed to
        the device's completion. Its tokens are random for the timing: padding sequences of one token
        would all route to the same experts."""
        gen = torch.Generator().manual_seed(0)
        seconds = {}
        for q in self.query_lens:
            for size in self.sizes:
                batch = self.inputs[size, self.contexts[0], q].batch
                saved = batch.input_ids.clone()
                batch.input_ids.copy_(torch.randint(self.model.cfg.vocab_size, saved.shape, generator=gen))
                self.replay_step(batch)  # warm
                self.platform.synchronize()
                begin = time.perf_counter()
                for _ in range(repeats):
                    self.replay_step(batch)
                self.platform.synchronize()
                seconds[size, q] = (time.perf_counter() - begin) / repeats
                batch.input_ids.copy_(saved)
        return seconds

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every (size, context, query length) bucket, largest first into one pool. The capture
        inputs are padding sequences only, so capturing writes nothing outside the cache's trash."""
        self._outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self.graphs = dict(self.platform.capture_graphs(list(self.inputs), self._shared_forward))
        # the padding layout's facts: capturing lays out padding sequences only
        self.derive_graphs = dict(self.platform.capture_graphs(list(self.facts), self._derive)) if self.facts else {}
        capture_restores = getattr(self.prologue, "capture_restores", None)
        if capture_restores is not None:  # what the prologue saved, put back by graphs of their own
            capture_restores(self.platform, {key: graph.output[2] for key, graph in self.graphs.items()})

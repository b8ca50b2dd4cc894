"""MTP drafting replayed from captured graphs: one graph per batch size runs the catch-up over ``k + 1``
positions per sequence and the ``k - 1`` draft steps after it, their layouts derived on the device from
how many positions each sequence kept.

A step keeps 1 to k + 1 positions of each sequence (a plain decode, or the accepted prefix of a
verification plus the bonus token). The catch-up is padded to k + 1 positions per sequence with filler
tokens: the MTP window rows of the positions past the kept ones get values of those fillers, and each
such row is written again (by this step's draft steps or the next catch-up, which start there) before a
query reads it, so the drafts are the eager proposer's. Padding sequences have no blocks: what they
write lands in the trash.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

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
from deepinfer_core.platform import Graph, Platform


@dataclass
class _Inputs:
    """One graph's static inputs on the device (one packed index buffer): the catch-up batch, the drafts
    each sequence's last step accepted (its last kept position is ``accepted`` past its first), the
    window block tables the draft steps index (from logical block ``table_first``), and the target
    streams the catch-up reads."""

    packed: torch.Tensor
    catch_up: ForwardBatch
    accepted: torch.Tensor  # [size]
    table: torch.Tensor  # [size, cols]
    table_first: torch.Tensor  # [size]
    streams: torch.Tensor


class MtpGraphs:
    """Drafting for up to ``max(sizes)`` sequences, padded to the smallest size that holds them. The host
    lays out only what does not depend on how many drafts were accepted (the catch-up over k + 1
    positions, a fixed-width window table); the draft steps' positions and window rows are derived on
    the device, so that drafting can follow a verification without the host reading its result.

    With ``capture=False`` (CPU tests) the padded static inputs run eagerly, exactly what a replay
    computes.
    """

    def __init__(self, model: Model, cache: ModelCache, sizes: list[int], num_speculative_tokens: int,
                 capture: bool = True, platform: Platform | None = None):
        self.model, self.cache, self.k = model, cache, num_speculative_tokens
        self.q = num_speculative_tokens + 1
        self.sizes = sorted(sizes)
        self.platform = platform or Platform(model.device)
        cfg = model.cfg
        self.window, self.block_size = cfg.sliding_window, cache.block_size
        # the window blocks a draft step reaches, from the first one the catch-up's window reaches (up to k
        # positions before the catch-up's first: see ``propose``'s ``shift``)
        self.cols = (self.window + 3 * self.k) // self.block_size + 2
        self.inputs: dict[int, _Inputs] = {}
        for size in self.sizes:
            catch_up = self._catch_up([], [], size)
            host = self._pack(catch_up, [0] * size, [], size)
            packed = host.to(model.device)
            streams = torch.zeros((size * self.q, *self._stream_shape()), dtype=model.dtype, device=model.device)
            self.inputs[size] = _Inputs(packed, *self._views(catch_up, size, packed), streams)
        # the catch-up's facts on the device for a layout derived there (``propose`` with ``shift``)
        self.facts: dict[int, tuple[torch.Tensor, PaddedFacts]] = {}
        for size in self.sizes:
            host = self._facts([], size)
            flat = host.packed().to(model.device)
            self.facts[size] = (flat, host.views(flat))
        self.graphs: dict[int, Graph] = {}
        self.derive_graphs: dict[int, Graph] = {}
        if capture:
            with torch.inference_mode():
                self.graphs = dict(self.platform.capture_graphs(self.sizes, self._run))
                self.derive_graphs = dict(self.platform.capture_graphs(self.sizes, self._derive_static))

    def _stream_shape(self) -> tuple[int, ...]:
        """A row of what the target's forward returns for the drafter: its last hyper-connection streams."""
        return self.model.cfg.hc_mult, self.model.cfg.hidden_size

    def size_for(self, num_seqs: int) -> int | None:
        i = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[i] if num_seqs and i < len(self.sizes) else None

    def _catch_up(self, spans: list[SeqSpan], ids: list[int], size: int) -> ForwardBatch:
        return build_forward_batch(ids or [0] * (len(spans) * self.q), spans, set(), self.block_size, self.window,
                                   pad=GraphPadding(size, {}, None, self.q))

    def _pack(self, catch_up: ForwardBatch, accepted: list[int], spans: list[SeqSpan], size: int) -> torch.Tensor:
        """The catch-up batch, ``accepted`` (padding sequences 0), each span's window table from the first
        block its catch-up window reaches (``cols`` columns, -1 padded), and that block."""
        table = np.full((size, self.cols), -1, dtype=np.int64)
        first = np.zeros(size, dtype=np.int64)
        for i, span in enumerate(spans):
            first[i] = max(0, span.context_len - self.window + 1) // self.block_size
            row = span.window_block_table[first[i]:first[i] + self.cols]
            table[i, :len(row)] = row
        accepted = np.array(list(accepted) + [0] * (size - len(accepted)), dtype=np.int64)
        return torch.cat([catch_up.packed(), torch.from_numpy(accepted), torch.from_numpy(table.reshape(-1)),
                          torch.from_numpy(first)])

    def _views(self, catch_up: ForwardBatch, size: int, flat: torch.Tensor):
        n = catch_up.packed().numel()
        accepted = flat[n:n + size]
        table = flat[n + size:n + size + size * self.cols].view(size, self.cols)
        return catch_up.with_storage(flat[:n]), accepted, table, flat[n + size + size * self.cols:]

    def _window_rows(self, inputs: _Inputs, positions: torch.Tensor) -> torch.Tensor:
        """Window-pool rows of ``positions`` [size, ...] of each sequence (-1: negative, or not resident)."""
        seq = torch.arange(positions.shape[0], device=positions.device).view(-1, *([1] * (positions.dim() - 1)))
        blocks = positions // self.block_size - inputs.table_first.view_as(seq)
        phys = inputs.table[seq, blocks.clamp(0, self.cols - 1)]
        ok = (positions >= 0) & (blocks >= 0) & (blocks < self.cols) & (phys >= 0)
        return torch.where(ok, phys * self.block_size + positions % self.block_size, -1)

    def _step(self, inputs: _Inputs, first: torch.Tensor, j: int) -> ForwardBatch:
        """Draft step ``j + 1``'s batch: one position per sequence, ``j + 1`` past the last kept one."""
        positions = first + inputs.accepted + 1 + j
        size = positions.shape[0]
        seq = torch.arange(size, device=positions.device)
        window = positions.unsqueeze(1) + torch.arange(1 - self.window, 1, device=positions.device)
        return ForwardBatch(input_ids=torch.zeros_like(positions), positions=positions,
                            window_slots=self._window_rows(inputs, positions),
                            window_indices=self._window_rows(inputs, window), logits_indices=seq,
                            query_start_loc=list(range(size + 1)), token_seq=seq, padded_to=size)

    def _run(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Catch-up and draft steps over the static inputs of ``size``: ([size, k] drafts, their
        probabilities)."""
        model, inputs = self.model, self.inputs[size]
        first = inputs.catch_up.positions.view(size, self.q)[:, 0]
        last = torch.arange(size, device=first.device) * self.q + inputs.accepted
        batch = inputs.catch_up.replace_tensors({"logits_indices": last})
        logits, out = model.drafter.forward(batch, self.cache, inputs.streams, batch.input_ids)
        h = out[last]
        tokens, confs = [], []
        for j in range(self.k):
            conf, token = torch.softmax(logits, dim=-1).max(dim=-1)
            tokens.append(token)
            confs.append(conf)
            if j + 1 == self.k:
                break
            logits, h = model.drafter.forward(self._step(inputs, first, j), self.cache, h, token)
        return torch.stack(tokens, dim=1), torch.stack(confs, dim=1)

    @torch.inference_mode()
    def propose(self, catch_spans: list[SeqSpan], ids: list[int] | torch.Tensor, accepted: list[int] | torch.Tensor,
                rows: list[int] | torch.Tensor, streams: torch.Tensor, shift: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts of ``len(catch_spans)`` sequences ([n, k] tokens and probabilities, on the device):
        ``catch_spans`` of ``k + 1`` positions each, their block tables reaching ``k`` positions past the
        last, ``ids`` [n * (k + 1)] their next tokens (fillers past the kept ones), ``accepted`` [n] the
        kept positions of each less one, ``rows`` [n * (k + 1)] the target streams' row of every catch-up
        position. ``ids``, ``accepted`` and ``rows`` may be lists or device tensors. ``shift`` [n] (device,
        at most k each): the spans start that much later than ``catch_spans`` say (their tables reach
        that much further), which only the device knows; the catch-up is then laid out there."""
        n = len(catch_spans)
        size = self.size_for(n)
        inputs = self.inputs[size]
        on_device = isinstance(ids, torch.Tensor)
        if shift is not None:
            self._derive(catch_spans, shift, size)
        else:
            catch_up = self._catch_up(catch_spans, [] if on_device else ids, size)
            host_accepted = [0] * n if isinstance(accepted, torch.Tensor) else accepted
            inputs.packed.copy_(self.platform.upload(self._pack(catch_up, host_accepted, catch_spans, size)))
        if on_device:
            inputs.catch_up.input_ids[: n * self.q].copy_(ids.clamp(min=0))
        if isinstance(accepted, torch.Tensor):
            inputs.accepted[:n].copy_(accepted)
        if not isinstance(rows, torch.Tensor):
            rows = torch.tensor(rows, dtype=torch.long).to(streams.device, non_blocking=True)
        inputs.streams[: len(rows)] = streams[rows]
        graph = self.graphs.get(size)
        if graph is not None:
            graph.replay()
            tokens, confs = graph.output
        else:
            tokens, confs = self._run(size)
        return tokens[:n], confs[:n]

    def _facts(self, catch_spans: list[SeqSpan], size: int) -> PaddedFacts:
        pad = GraphPadding(size, {}, None, self.q)
        return PaddedFacts.from_spans(catch_spans, [0] * (len(catch_spans) * self.q), pad, self.block_size,
                                      self.window, window_blocks=self.cols)

    def _derive(self, catch_spans: list[SeqSpan], shift: torch.Tensor, size: int) -> None:
        """The static inputs of ``catch_spans`` moved on by ``shift``, laid out on the device (accepted
        counts 0, tokens 0: the caller fills them in), by a graph where captured."""
        flat, facts = self.facts[size]
        flat.copy_(self.platform.upload(self._facts(catch_spans, size).packed()), non_blocking=True)
        facts.ctx[: len(catch_spans)] += shift
        graph = self.derive_graphs.get(size)
        if graph is not None:
            graph.replay()
        else:
            self._derive_static(size)

    def _derive_static(self, size: int) -> None:
        inputs, facts = self.inputs[size], self.facts[size][1]
        derive_padded(inputs.catch_up, facts, set(), self.block_size, self.window)
        inputs.accepted.zero_()
        inputs.table.copy_(facts.wtables)
        inputs.table_first.copy_(facts.wfirst)

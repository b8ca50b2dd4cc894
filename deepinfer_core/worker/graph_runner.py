"""Decode steps replayed from captured graphs: one graph per bucketed batch size over static inputs.

A step of ``n`` decoding sequences runs the graph of the smallest captured size >= ``n``; the rows past
``n`` are padding sequences with no blocks and state slot -1, whose writes land in the cache's trash.
All of a step's index tensors live in one packed int64 device buffer per graph, filled by a single
host-to-device copy from (pinned, where the platform has it) staging memory. Capture itself, streams
and events come from the backend's :class:`~deepinfer_core.platform.Platform`.
"""

from __future__ import annotations

import bisect

import torch

from deepinfer_core.model.cache import ModelCache
from deepinfer_core.model.deepseek_v4 import DeepseekV4Model
from deepinfer_core.model.metadata import ForwardBatch, GraphPadding, SeqSpan, build_forward_batch
from deepinfer_core.platform import Graph, Platform


def capture_sizes(max_size: int, step: int = 32) -> list[int]:
    """Batch sizes to capture: powers of two up to ``step``, then every ``step``, and ``max_size`` itself."""
    if max_size < 1:
        return []
    sizes = [1 << i for i in range(step.bit_length()) if 1 << i <= min(step, max_size)]
    sizes += list(range(2 * step, max_size + 1, step))
    return sorted(set(sizes) | {max_size})


class _StaticInputs:
    """The packed device buffer of one graph's inputs, its views as a ForwardBatch, and two staging
    buffers (a host buffer is reused only after its previous copy has run)."""

    def __init__(self, host: ForwardBatch, platform: Platform):
        flat = host.packed()
        self.packed = flat.to(platform.device)
        self.batch = host.with_storage(self.packed)
        self.staging = [torch.empty_like(flat, pin_memory=platform.pin_memory) for _ in range(2)]
        self.copied = [platform.new_event() for _ in range(2)]
        self.turn = 0

    def load(self, host: ForwardBatch) -> None:
        k, self.turn = self.turn, 1 - self.turn
        if self.copied[k] is not None:
            self.copied[k].synchronize()
        host.packed(out=self.staging[k])
        self.packed.copy_(self.staging[k], non_blocking=True)
        if self.copied[k] is not None:
            self.copied[k].record()


class GraphRunner:
    """Pads decode steps to a captured size and replays that size's graph.

    With ``capture=False`` (CPU tests) the padded static batch runs eagerly: the same inputs, buffers
    and padding as a replay, without the graph.
    """

    def __init__(self, model: DeepseekV4Model, cache: ModelCache, sizes: list[int], max_model_len: int,
                 block_size: int, capture: bool = True, platform: Platform | None = None):
        self.model, self.cache, self.block_size = model, cache, block_size
        self.platform = platform or Platform(model.device)
        self.sizes = sorted(sizes)
        rates = {spec.rate for spec in model.compressor_specs()}
        self.max_entries = {rate: -(-max_model_len // rate) for rate in rates}
        self.inputs: dict[int, _StaticInputs] = {}
        self.graphs: dict[int, Graph] = {}
        for size in reversed(self.sizes):
            empty = build_forward_batch([], [], model.compressor_specs(), block_size, model.cfg.sliding_window,
                                        pad=GraphPadding(size, self.max_entries))
            self.inputs[size] = _StaticInputs(empty, self.platform)
        if capture:
            self.capture()

    def padding_for(self, spans: list[SeqSpan], logits_rows: list[int]) -> GraphPadding | None:
        """The graph layout for this step, or None when it must run eagerly (prefill, too many sequences)."""
        n = len(spans)
        if not n or n > self.sizes[-1] or any(s.num_new != 1 for s in spans) or logits_rows != list(range(n)):
            return None
        return GraphPadding(self.sizes[bisect.bisect_left(self.sizes, n)], self.max_entries)

    def load(self, host: ForwardBatch) -> ForwardBatch:
        """Copy a padded host batch into its graph's static inputs; returns the static batch (device views).

        Its ``input_ids`` may still be changed in place on the device before :meth:`replay`.
        """
        static = self.inputs[host.padded_to]
        static.load(host)
        static.batch.query_start_loc = host.query_start_loc
        return static.batch

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        size, n = batch.padded_to, len(batch.query_start_loc) - 1
        if size in self.graphs:
            self.graphs[size].replay()
            return self.graphs[size].output[:n]
        logits, _ = self.model.forward(batch, self.cache)
        return logits[:n]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size. The capture inputs are padding sequences only, so capturing writes nothing
        outside the cache's trash."""
        self.graphs = self.platform.capture_graphs(
            self.sizes, lambda size: self.model.forward(self.inputs[size].batch, self.cache)[0])

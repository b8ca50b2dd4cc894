"""Decode steps replayed from CUDA graphs: one graph per bucketed batch size over static input buffers.

A step of ``n`` decoding sequences runs the graph of the smallest captured size >= ``n``; the rows past
``n`` are padding sequences with no blocks and state slot -1, whose writes land in the cache's trash.
All of a step's index tensors live in one packed int64 device buffer per graph, filled by a single
host-to-device copy from pinned memory.
"""

from __future__ import annotations

import bisect

import torch

from deepinfer_core.model.cache import ModelCache
from deepinfer_core.model.deepseek_v4 import DeepseekV4Model
from deepinfer_core.model.metadata import ForwardBatch, GraphPadding, SeqSpan, build_forward_batch


def capture_sizes(max_size: int, step: int = 32) -> list[int]:
    """Batch sizes to capture: powers of two up to ``step``, then every ``step``, and ``max_size`` itself."""
    if max_size < 1:
        return []
    sizes = [1 << i for i in range(step.bit_length()) if 1 << i <= min(step, max_size)]
    sizes += list(range(2 * step, max_size + 1, step))
    return sorted(set(sizes) | {max_size})


class _StaticInputs:
    """The packed device buffer of one graph's inputs, its views as a ForwardBatch, and two pinned
    staging buffers (a host buffer is reused only after its previous copy has run)."""

    def __init__(self, host: ForwardBatch, device: torch.device):
        flat = host.packed()
        self.packed = flat.to(device)
        self.batch = host.with_storage(self.packed)
        pin = device.type == "cuda"
        self.staging = [torch.empty_like(flat, pin_memory=pin) for _ in range(2)]
        self.copied = [torch.cuda.Event() if pin else None for _ in range(2)]
        self.turn = 0

    def load(self, host: ForwardBatch) -> None:
        k, self.turn = self.turn, 1 - self.turn
        if self.copied[k] is not None:
            self.copied[k].synchronize()
        host.packed(out=self.staging[k])
        self.packed.copy_(self.staging[k], non_blocking=True)
        if self.copied[k] is not None:
            self.copied[k].record()


class CUDAGraphRunner:
    """Pads decode steps to a captured size and replays that size's graph.

    With ``capture=False`` (CPU tests) the padded static batch runs eagerly: the same inputs, buffers
    and padding as a replay, without the graph.
    """

    def __init__(self, model: DeepseekV4Model, cache: ModelCache, sizes: list[int], max_model_len: int,
                 block_size: int, capture: bool = True):
        self.model, self.cache, self.block_size = model, cache, block_size
        self.sizes = sorted(sizes)
        rates = {spec.rate for spec in model.compressor_specs()}
        self.max_entries = {rate: -(-max_model_len // rate) for rate in rates}
        self.inputs: dict[int, _StaticInputs] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        for size in reversed(self.sizes):
            empty = build_forward_batch([], [], model.compressor_specs(), block_size, model.cfg.sliding_window,
                                        pad=GraphPadding(size, self.max_entries))
            self.inputs[size] = _StaticInputs(empty, model.device)
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
            return self.outputs[size][:n]
        logits, _ = self.model.forward(batch, self.cache)
        return logits[:n]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, all in one memory pool. The capture inputs are padding
        sequences only, so capturing writes nothing outside the cache's trash."""
        torch.cuda.synchronize()
        pool = None
        side = torch.cuda.Stream()
        for size in reversed(self.sizes):
            batch = self.inputs[size].batch
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # compiles the kernels of this shape; allocations settle
                    self.model.forward(batch, self.cache)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size], _ = self.model.forward(batch, self.cache)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()

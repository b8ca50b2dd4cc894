"""ModelRunner: turns a scheduled step into a ForwardBatch and runs the forward, eagerly or by replaying
a captured graph (the backend's ``deepinfer_graph_runner``) when the step's shape has one."""

from __future__ import annotations

from typing import Any

import torch

from deepinfer_core.engine.cuda_graph import capture_sizes
from deepinfer_core.model.cache import ModelCache
from deepinfer_core.model.deepseek_v4 import DeepseekV4Model
from deepinfer_core.model.metadata import ForwardBatch, SeqSpan, build_forward_batch

DEFAULT_MAX_CAPTURE_SIZE = 256  # larger decode batches run eagerly: launch overhead no longer dominates


class ModelRunner:
    def __init__(self, model: DeepseekV4Model, cache: ModelCache, block_size: int, graph_runner: Any = None):
        self.model, self.cache, self.block_size = model, cache, block_size
        self.graph_runner = graph_runner  # None: always eager

    @classmethod
    def create(cls, model: DeepseekV4Model, cache: ModelCache, args: Any, scheduler_config: Any,
               backend: Any) -> ModelRunner:
        """A runner for the engine's arguments: with graphs from the backend unless ``args.enforce_eager``."""
        graphs = None
        if not args.enforce_eager:
            max_size = min(args.max_cudagraph_capture_size or DEFAULT_MAX_CAPTURE_SIZE, scheduler_config.max_num_seqs)
            graphs = backend.hook.deepinfer_graph_runner(
                model=model, cache=cache, capture_sizes=capture_sizes(max_size),
                max_model_len=scheduler_config.max_model_len, block_size=args.block_size,
            )
        return cls(model, cache, args.block_size, graphs)

    def prepare(self, token_ids: list[int], spans: list[SeqSpan], logits_rows: list[int]) -> ForwardBatch:
        """The step's batch on the model's device; padded to a captured shape when a graph will run it."""
        pad = self.graph_runner.padding_for(spans, logits_rows) if self.graph_runner is not None else None
        host = build_forward_batch(token_ids, spans, self.model.compressor_specs(), self.block_size,
                                   self.model.cfg.sliding_window, logits_rows, pad=pad)
        if pad is not None:
            return self.graph_runner.load(host)
        return upload(host, self.model.device)

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


def upload(host: ForwardBatch, device: torch.device) -> ForwardBatch:
    """The batch on ``device`` through one host-to-device copy of all its index tensors."""
    if device.type == "cpu":
        return host
    return host.with_storage(host.packed().pin_memory().to(device, non_blocking=True))

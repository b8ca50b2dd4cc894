"""MTP drafting replayed from captured graphs: one graph per batch size runs the catch-up over ``k + 1``
positions per sequence and the ``k - 1`` draft steps after it.

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

import torch

from deepinfer_core.model.cache import ModelCache
from deepinfer_core.model.deepseek_v4 import DeepseekV4Model
from deepinfer_core.model.metadata import ForwardBatch, GraphPadding, SeqSpan, build_forward_batch
from deepinfer_core.platform import Graph, Platform


@dataclass
class _Inputs:
    """One graph's static inputs on the device: the catch-up batch, the draft steps' batches (one
    packed index buffer) and the target streams the catch-up reads."""

    packed: torch.Tensor
    catch_up: ForwardBatch
    steps: list[ForwardBatch]
    streams: torch.Tensor


class MtpGraphs:
    """Drafting for up to ``max(sizes)`` sequences, padded to the smallest size that holds them.

    With ``capture=False`` (CPU tests) the padded static inputs run eagerly, exactly what a replay
    computes.
    """

    def __init__(self, model: DeepseekV4Model, cache: ModelCache, sizes: list[int], num_speculative_tokens: int,
                 capture: bool = True, platform: Platform | None = None):
        self.model, self.cache, self.k = model, cache, num_speculative_tokens
        self.q = num_speculative_tokens + 1
        self.sizes = sorted(sizes)
        self.platform = platform or Platform(model.device)
        cfg = model.cfg
        self.inputs: dict[int, _Inputs] = {}
        for size in self.sizes:
            catch_up, steps = self._layouts([], [], [], [], size)
            packed = self._pack(catch_up, steps).to(model.device)
            streams = torch.zeros((size * self.q, cfg.hc_mult, cfg.hidden_size), dtype=model.dtype,
                                  device=model.device)
            self.inputs[size] = _Inputs(packed, *self._views(catch_up, steps, packed), streams)
        self.graphs: dict[int, Graph] = {}
        if capture:
            with torch.inference_mode():
                self.graphs = dict(self.platform.capture_graphs(self.sizes, self._run))

    def size_for(self, num_seqs: int) -> int | None:
        i = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[i] if num_seqs and i < len(self.sizes) else None

    def _layouts(self, catch_spans: list[SeqSpan], ids: list[int], last_rows: list[int],
                 step_spans: list[list[SeqSpan]], size: int) -> tuple[ForwardBatch, list[ForwardBatch]]:
        bs, window = self.cache.block_size, self.model.cfg.sliding_window
        catch_up = build_forward_batch(ids, catch_spans, set(), bs, window,
                                       pad=GraphPadding(size, {}, None, self.q))
        last = torch.tensor(last_rows + [i * self.q for i in range(len(last_rows), size)], dtype=torch.long)
        catch_up = catch_up.replace_tensors({"logits_indices": last})
        steps = [build_forward_batch([0] * len(spans), spans, set(), bs, window, pad=GraphPadding(size, {}, None))
                 for spans in (step_spans or [[]] * (self.k - 1))]
        return catch_up, steps

    @staticmethod
    def _pack(catch_up: ForwardBatch, steps: list[ForwardBatch]) -> torch.Tensor:
        return torch.cat([catch_up.packed()] + [s.packed() for s in steps])

    @staticmethod
    def _views(catch_up: ForwardBatch, steps: list[ForwardBatch], flat: torch.Tensor):
        out, offset = [], 0
        for batch in [catch_up] + steps:
            n = batch.packed().numel()
            out.append(batch.with_storage(flat[offset:offset + n]))
            offset += n
        return out[0], out[1:]

    def _run(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Catch-up and draft steps over the static inputs of ``size``: ([size, k] drafts, their
        probabilities)."""
        model, inputs = self.model, self.inputs[size]
        batch = inputs.catch_up
        logits, out = model.mtp_forward(batch, self.cache, inputs.streams, batch.input_ids)
        h = out[batch.logits_indices]
        tokens, confs = [], []
        for j in range(self.k):
            conf, token = torch.softmax(logits, dim=-1).max(dim=-1)
            tokens.append(token)
            confs.append(conf)
            if j + 1 == self.k:
                break
            logits, h = model.mtp_forward(inputs.steps[j], self.cache, h, token)
        return torch.stack(tokens, dim=1), torch.stack(confs, dim=1)

    @torch.inference_mode()
    def propose(self, catch_spans: list[SeqSpan], ids: list[int], last_rows: list[int],
                step_spans: list[list[SeqSpan]], streams: torch.Tensor, rows: list[int]
                ) -> tuple[list[list[int]], list[list[float]]]:
        """Drafts of ``len(catch_spans)`` sequences: ``catch_spans`` of ``k + 1`` positions each (``ids``
        their next tokens, fillers past the kept ones; ``last_rows`` the row of each one's last kept
        position), ``step_spans[j]`` the spans of draft step ``j + 1``, ``rows`` the target streams' row
        of every catch-up position."""
        n = len(catch_spans)
        size = self.size_for(n)
        inputs = self.inputs[size]
        catch_up, steps = self._layouts(catch_spans, ids, last_rows, step_spans, size)
        inputs.packed.copy_(self.platform.upload(self._pack(catch_up, steps)))
        index = torch.tensor(rows, dtype=torch.long).to(streams.device, non_blocking=True)
        inputs.streams[: len(rows)] = streams[index]
        graph = self.graphs.get(size)
        if graph is not None:
            graph.replay()
            tokens, confs = graph.output
        else:
            tokens, confs = self._run(size)
        return tokens[:n].tolist(), confs[:n].tolist()

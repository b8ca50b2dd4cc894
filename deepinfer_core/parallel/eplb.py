"""Expert-parallel load balancing (EPLB): the load of every logical expert, counted on the device during
the forward (a scatter-add per MoE layer, no host sync, so it can live inside graphs).

The rest of EPLB: the slot map (:mod:`.expert_map`), DeepSeek's policy (:mod:`.eplb_policy`), moving
weights (:mod:`.eplb_transfer`) and the periodic rearrangement (:mod:`.eplb_state`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


class ExpertLoad:
    """``counts[layer, expert]``: the (token, expert) pairs routed to each logical expert of each main MoE
    layer, by this rank's tokens, since the last :meth:`take`."""

    def __init__(self, moe_records: list[Any], num_experts: int, device: torch.device | str):
        self._layer_of = {id(m): i for i, m in enumerate(moe_records)}
        self._records = moe_records  # keeps the ids above valid
        self.counts = torch.zeros((len(moe_records), num_experts), dtype=torch.long, device=device)

    @classmethod
    def for_model(cls, model: Any) -> ExpertLoad:
        return cls([block.moe for block in model.weights.layers], model.cfg.n_routed_experts, model.device)

    token_mask: torch.Tensor | None = None  # [T] inside a graph's forward: the real (not padding) tokens

    def record(self, moe: Any, topk_ids: torch.Tensor) -> None:
        """Count one MoE layer's routing (global expert ids [T, k]); an MTP layer's is not counted."""
        layer = self._layer_of.get(id(moe))
        if layer is not None:
            flat = topk_ids.reshape(-1)
            self.counts[layer].index_add_(0, flat, self._weights(topk_ids))

    def _weights(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """1 per (token, k) pair, 0 for a padding token's."""
        mask = self.token_mask
        if mask is None or mask.shape[0] != topk_ids.shape[0]:
            return torch.ones_like(topk_ids.reshape(-1))
        return mask.unsqueeze(1).expand_as(topk_ids).reshape(-1).to(topk_ids.dtype)

    def take(self) -> torch.Tensor:
        """The counts so far (on the host), zeroed for the next window."""
        counts = self.counts.to("cpu", copy=True)
        self.counts.zero_()
        return counts


class EplbRecorder(ExpertLoad):
    """ExpertLoad that also keeps this step's counts for the EPLB window (``step_counts``) and tells the
    dispatcher which main MoE layer it is about to dispatch (the model records a layer's routing just
    before its dispatch), so the dispatcher maps the layer's logical ids through that layer's slots."""

    def __init__(self, moe_records: list[Any], num_experts: int, device: torch.device | str, dispatcher: Any):
        super().__init__(moe_records, num_experts, device)
        self.dispatcher = dispatcher
        self.step_counts = torch.zeros_like(self.counts)

    @classmethod
    def for_model(cls, model: Any, dispatcher: Any = None) -> EplbRecorder:
        return cls([block.moe for block in model.weights.layers], model.cfg.n_routed_experts, model.device,
                   dispatcher)

    @classmethod
    def for_drafter(cls, model: Any, dispatcher: Any) -> EplbRecorder:
        """The recorder of the drafter's own expert group (its MoE layers, in order; ``dispatcher``: its own)."""
        drafter = model.drafter
        return cls(drafter.moe_layers(), drafter.num_experts, model.device, dispatcher)

    def record(self, moe: Any, topk_ids: torch.Tensor) -> None:
        layer = self._layer_of.get(id(moe))
        self.dispatcher.layer = layer
        if layer is not None:
            flat = topk_ids.reshape(-1)
            ones = self._weights(topk_ids)
            self.counts[layer].index_add_(0, flat, ones)
            self.step_counts[layer].index_add_(0, flat, ones)


@contextmanager
def padding_uncounted(model: Any, batch: Any) -> Iterator[None]:
    """A graph's forward of ``batch`` (a padded layout): the expert load leaves out the padding sequences'
    tokens, those whose window KV goes nowhere (slot -1; a real decode token always has a window row).
    The mask is computed from the batch's tensors on the device, so a captured graph recomputes it."""
    load = getattr(model, "expert_load", None)
    if load is None:
        yield
        return
    load.token_mask = batch.window_slots >= 0
    try:
        yield
    finally:
        load.token_mask = None

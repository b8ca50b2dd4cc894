"""DeepSeek-V4.1's weights as typed records, as its forward reads them, and :data:`LAYOUT`, which says
which checkpoint name fills which field. Layers that read another layer's compressed KV or index keys
have no compressor / key projection of their own (their records hold None there)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from deepinfer_core.model.errors import CheckpointError
from deepinfer_core.model.records import Experts, Linear, build_records, named_tensors
from deepinfer_core.models.deepseek_v4.weights import HyperConnection, SharedExpert, stack_shared_experts

__all__ = ["LAYOUT", "Attention", "Block", "Compressor", "DrafterStage", "Engram", "Gate", "Indexer",
           "ModelWeights", "MoE", "build_weights", "stack_shared_experts"]


@dataclass
class Compressor:
    """A KV source's compressor: ratio 2 pools ``wkv`` rows with a softmax over ``wgate``; ratio 1 has no
    gate (``norm(wkv(x))``)."""

    wkv: Linear
    norm: torch.Tensor
    wgate: Linear | None = None


@dataclass
class Indexer:
    """An index source: query projection and per-head weights; a KV source also derives the index keys
    from its latent (``k_norm(wk(latent))``)."""

    wq_b: Linear
    weights_proj: Linear
    wk: Linear | None = None
    k_norm: torch.Tensor | None = None


@dataclass
class Attention:
    wq_a: Linear
    q_norm: torch.Tensor
    wq_b: Linear
    wkv: Linear
    kv_norm: torch.Tensor
    sinks: torch.Tensor
    wo_a: torch.Tensor
    wo_b: Linear
    compressor: Compressor | None = None
    indexer: Indexer | None = None


@dataclass
class Gate:
    weight: Linear
    bias: torch.Tensor
    bias_vl: torch.Tensor | None = None  # image-span tokens' routing bias


@dataclass
class MoE:
    gate: Gate
    experts: Experts
    shared: SharedExpert


@dataclass
class Engram:
    """The n-gram memory before a block: ``table`` [rows, head_dim] kept E4M3 with a scale per 32 values of
    a row (rows are dequantised as they are looked up), ``wkv`` [(n+1)D, cols*hd] (one key per stream, one
    shared value), the gate's ``q_weight`` and ``k_weight`` [n, D]."""

    table: Linear
    wkv: Linear
    q_weight: torch.Tensor
    k_weight: torch.Tensor


@dataclass
class Block:
    """Single-pass mHC: each sublayer's mixes give its post/comb and the *next* sublayer's pre."""

    attn_hc: HyperConnection
    attn_norm: torch.Tensor
    attn: Attention
    ffn_hc: HyperConnection
    ffn_norm: torch.Tensor
    moe: MoE
    engram: Engram | None = None


@dataclass
class DrafterStage:
    """One DSpark stage (``mtp.j``): a window-only block; the first holds ``main_proj``/``main_norm``, the
    last the output norm, the Markov head and the confidence head."""

    block: Block
    main_proj: Linear | None = None
    main_norm: torch.Tensor | None = None
    norm: torch.Tensor | None = None
    markov_embed: torch.Tensor | None = None
    markov_head: Linear | None = None
    confidence: Linear | None = None


@dataclass
class ModelWeights:
    embed: torch.Tensor
    head: Linear
    norm: torch.Tensor
    layers: list[Block]
    mtp: list[DrafterStage] = field(default_factory=list)
    #: the vision tower's tensors by checkpoint name (checked and loaded; read by the vision path)
    vision: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from named_tensors(self, LAYOUT)
        yield from self.vision.items()


LAYOUT: dict[type, dict[str, str]] = {
    ModelWeights: {"embed": "embed.weight", "head": "head.weight", "norm": "norm.weight", "layers": "layers.",
                   "mtp": "mtp."},
    DrafterStage: {"block": "", "main_proj": "main_proj.weight", "main_norm": "main_norm.weight",
                   "norm": "norm.weight", "markov_embed": "markov_head.embed.weight",
                   "markov_head": "markov_head.head.weight", "confidence": "confidence_head.proj.weight"},
    HyperConnection: {"fn": "fn", "base": "base", "scale": "scale"},
    Block: {"attn_hc": "hc_attn_", "attn_norm": "attn_norm.weight", "attn": "attn.", "ffn_hc": "hc_ffn_",
            "ffn_norm": "ffn_norm.weight", "moe": "ffn.", "engram": "engram."},
    Attention: {"wq_a": "wq_a.weight", "q_norm": "q_norm.weight", "wq_b": "wq_b.weight", "wkv": "wkv.weight",
                "kv_norm": "kv_norm.weight", "sinks": "attn_sink", "wo_a": "wo_a.weight", "wo_b": "wo_b.weight",
                "compressor": "compressor.", "indexer": "indexer."},
    Compressor: {"wkv": "wkv.weight", "norm": "norm.weight", "wgate": "wgate.weight"},
    Indexer: {"wq_b": "wq_b.weight", "weights_proj": "weights_proj.weight", "wk": "wk.weight",
              "k_norm": "k_norm.weight"},
    Gate: {"weight": "weight", "bias": "bias", "bias_vl": "bias_vl"},
    MoE: {"gate": "gate.", "experts": "experts.", "shared": "shared_experts."},
    Experts: {"w13": "w13", "w2": "w2"},
    SharedExpert: {"w13": "w13", "w2": "w2.weight"},
    Engram: {"table": "embed.weight", "wkv": "wkv.weight", "q_weight": "q_weight", "k_weight": "k_weight"},
}

_VISION = ("vision.", "aligner.", "image_start", "image_end", "image_newline")


def build_weights(cfg: Any, params: dict[str, torch.Tensor], hook: Any = None,
                  num_experts: int | None = None) -> ModelWeights:
    """The records of ``params`` (canonical names, experts stacked), handed once to every plugin's
    ``deepinfer_process_weights`` when ``hook`` is given."""
    vision = {k: params.pop(k) for k in [k for k in params if k.startswith(_VISION)]}
    weights = build_records(ModelWeights, params, LAYOUT)
    weights.vision = vision
    if len(weights.layers) != cfg.num_hidden_layers:
        raise CheckpointError(f"found {len(weights.layers)} decoder layers, the config has {cfg.num_hidden_layers}")
    for i, layer in enumerate(weights.layers):
        want = cfg.n_routed_experts if num_experts is None else num_experts
        got = layer.moe.experts.w13.weight.shape[0]
        if got != want:
            raise CheckpointError(f"layer {i}: the expert stacks hold {got} experts, expected {want}")
    if hook is not None:
        hook.deepinfer_process_weights(weights=weights, model_config=cfg)
    return weights

"""DeepSeek-V4's weights as typed records, one per component, as the forward reads them, and
:data:`LAYOUT`, the one place that says which checkpoint name fills which field.

Tensors keep the checkpoint's layout, routed experts stacked; a backend may re-lay them in
``deepinfer_process_weights`` by replacing fields.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from deepinfer_core.model.errors import CheckpointError
from deepinfer_core.model.records import Experts, Linear, build_records, named_tensors, records
from deepinfer_core.models.deepseek_v4.names import canonical_name
from deepinfer_core.quant.fp8 import FP8_BLOCK, dequantize_fp8_block

__all__ = ["LAYOUT", "Attention", "Block", "Compressor", "DSparkModelWeights", "DSparkStage", "Experts", "Gate",
           "HyperConnection", "Indexer", "Linear", "MTPBlock", "MoE", "ModelWeights", "OutputNorm", "SharedExpert",
           "build_weights", "records", "stack_shared_experts"]


@dataclass
class HyperConnection:
    """One mHC mixing over the ``n`` streams: ``fn`` [(2+n)n, nD], ``base`` [(2+n)n], ``scale`` [3]
    (before the output norm: [n, nD], [n], [1])."""

    fn: torch.Tensor
    base: torch.Tensor
    scale: torch.Tensor


@dataclass
class Compressor:
    """Projections of a compressed branch, the per-position bias ``ape`` [rate, width] and the entry norm."""

    wkv: Linear
    wgate: Linear
    ape: torch.Tensor
    norm: torch.Tensor


@dataclass
class Indexer:
    """CSA's lightning indexer: query projection from the q low-rank, per-head weights, key compressor."""

    wq_b: Linear
    weights_proj: Linear
    compressor: Compressor


@dataclass
class Attention:
    """Shared-KV MQA; ``wo_a`` [G*R, H*D/G] is the grouped low-rank output projection (no FP8 op)."""

    wq_a: Linear
    q_norm: torch.Tensor
    wq_b: Linear
    wkv: Linear
    kv_norm: torch.Tensor
    sinks: torch.Tensor
    wo_a: torch.Tensor
    wo_b: Linear
    compressor: Compressor | None = None  # CSA and HCA layers
    indexer: Indexer | None = None  # CSA layers


@dataclass
class Gate:
    """The router: ``bias`` corrects the scores (learned routing), ``tid2eid`` [V, k] fixes the experts
    per token id (hash routing); a layer has one of the two."""

    weight: Linear
    bias: torch.Tensor | None = None
    tid2eid: torch.Tensor | None = None


@dataclass
class SharedExpert:
    w13: Linear  # [2I, D]
    w2: Linear  # [D, I]


@dataclass
class MoE:
    gate: Gate
    experts: Experts
    shared: SharedExpert


@dataclass
class Block:
    """One decoder block: mHC around attention, mHC around the MoE."""

    attn_hc: HyperConnection
    attn_norm: torch.Tensor
    attn: Attention
    ffn_hc: HyperConnection
    ffn_norm: torch.Tensor
    moe: MoE


@dataclass
class OutputNorm:
    """Collapse the streams (``hc``), then RMS-norm: before the head, in the model and in each MTP block."""

    hc: HyperConnection
    norm: torch.Tensor


@dataclass
class MTPBlock:
    """One multi-token-prediction layer: ``e_proj(enorm(embed(t+1))) + h_proj(hnorm(streams_t))`` through
    a decoder block (plain sliding-window attention) and its own output norm."""

    enorm: torch.Tensor
    hnorm: torch.Tensor
    e_proj: Linear
    h_proj: Linear
    block: Block
    output: OutputNorm


@dataclass
class ModelWeights:
    embed: torch.Tensor
    head: Linear
    output: OutputNorm
    layers: list[Block]
    mtp: list[MTPBlock] = field(default_factory=list)

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint name, tensor) of every weight, FP8 scales as ``name + "_scale"``; a tensor shared
        by two fields (tied embeddings) comes once per name."""
        return named_tensors(self, LAYOUT)


@dataclass
class DSparkStage:
    """One DSpark stage of V4-Flash-0731 (``mtp.j``): a window-only block; the first stage holds ``main_proj``
    / ``main_norm`` (over the target layers' outputs), the last the streams' collapse (``hc_head``) and the
    output ``norm``, the Markov head (``markov_embed`` [V, rank], ``markov_head`` [V, rank]) and the confidence head
    (``confidence`` [1, D + rank])."""

    block: Block
    main_proj: Linear | None = None
    main_norm: torch.Tensor | None = None
    hc_head: HyperConnection | None = None
    norm: torch.Tensor | None = None
    markov_embed: torch.Tensor | None = None
    markov_head: Linear | None = None
    confidence: Linear | None = None


@dataclass
class DSparkModelWeights(ModelWeights):
    """V4-Flash-0731's weights: the V4 backbone, DSpark stages under ``mtp.``."""

    mtp: list[DSparkStage] = field(default_factory=list)


#: where each field of a record lives, relative to the record's prefix (:mod:`deepinfer_core.model.records`)
LAYOUT: dict[type, dict[str, str]] = {
    ModelWeights: {"embed": "embed.weight", "head": "head.weight", "output": "", "layers": "layers.",
                   "mtp": "mtp."},
    DSparkModelWeights: {"embed": "embed.weight", "head": "head.weight", "output": "", "layers": "layers.",
                         "mtp": "mtp."},
    DSparkStage: {"block": "", "main_proj": "main_proj.weight", "main_norm": "main_norm.weight",
                  "hc_head": "hc_head_", "norm": "norm.weight", "markov_embed": "markov_head.embed.weight",
                  "markov_head": "markov_head.head.weight", "confidence": "confidence_head.proj.weight"},
    OutputNorm: {"hc": "hc_head_", "norm": "norm.weight"},
    HyperConnection: {"fn": "fn", "base": "base", "scale": "scale"},
    MTPBlock: {"enorm": "enorm.weight", "hnorm": "hnorm.weight", "e_proj": "e_proj.weight",
               "h_proj": "h_proj.weight", "block": "", "output": ""},
    Block: {"attn_hc": "hc_attn_", "attn_norm": "attn_norm.weight", "attn": "attn.", "ffn_hc": "hc_ffn_",
            "ffn_norm": "ffn_norm.weight", "moe": "ffn."},
    Attention: {"wq_a": "wq_a.weight", "q_norm": "q_norm.weight", "wq_b": "wq_b.weight", "wkv": "wkv.weight",
                "kv_norm": "kv_norm.weight", "sinks": "attn_sink", "wo_a": "wo_a.weight", "wo_b": "wo_b.weight",
                "compressor": "compressor.", "indexer": "indexer."},
    Compressor: {"wkv": "wkv.weight", "wgate": "wgate.weight", "ape": "ape", "norm": "norm.weight"},
    Indexer: {"wq_b": "wq_b.weight", "weights_proj": "weights_proj.weight", "compressor": "compressor."},
    MoE: {"gate": "gate.", "experts": "experts.", "shared": "shared_experts."},
    Gate: {"weight": "weight", "bias": "bias", "tid2eid": "tid2eid"},
    Experts: {"w13": "w13", "w2": "w2"},
    SharedExpert: {"w13": "w13", "w2": "w2.weight"},
}


def stack_shared_experts(cfg: Any, params: dict[str, torch.Tensor], param_dtype: Callable[[str], torch.dtype]
                         ) -> None:
    """Each shared expert's w1 and w3 -> w13 [2I, D]; E4M3 halves with their scales stay E4M3 when their
    tiles stack whole, otherwise they are dequantised first (FP8 mode quantises the stacked projection
    afterwards)."""
    inter = cfg.moe_intermediate_size
    for w1_name in [n for n in params if n.endswith("shared_experts.w1.weight")]:
        prefix = w1_name[: -len("w1.weight")]
        halves = [prefix + "w1.weight", prefix + "w3.weight"]
        if halves[1] not in params:
            continue
        scales = [params.pop(h + "_scale", None) for h in halves]
        if all(s is not None for s in scales) and inter % FP8_BLOCK == 0:
            params[prefix + "w13_scale"] = torch.cat(scales, dim=0)
        elif any(s is not None for s in scales):
            for h, s in zip(halves, scales):
                if s is not None:
                    params[h] = dequantize_fp8_block(params[h], s).to(param_dtype(prefix + "w13"))
        params[prefix + "w13"] = torch.cat([params.pop(h) for h in halves], dim=0)


def build_weights(cfg: Any, params: dict[str, torch.Tensor], hook: Any = None,
                  num_experts: int | None = None) -> ModelWeights:
    """The records of ``params`` (canonical names, experts stacked, FP8/FP4 scales as ``name + "_scale"``),
    handed once to every plugin's ``deepinfer_process_weights`` when ``hook`` is given. ``num_experts``:
    how many routed experts each stack holds (all by default; fewer where only a range was loaded)."""
    params = {canonical_name(k): v for k, v in params.items()}
    dspark = getattr(cfg, "dspark", None) is not None
    weights = build_records(DSparkModelWeights if dspark else ModelWeights, params, LAYOUT)
    if len(weights.layers) != cfg.num_hidden_layers:
        raise CheckpointError(f"found {len(weights.layers)} decoder layers, the config has {cfg.num_hidden_layers}")
    want = cfg.n_routed_experts if num_experts is None else num_experts
    blocks = [*weights.layers, *(m.block for m in weights.mtp)]
    if dspark:  # the stages' experts are a count of their own, loaded whole (see the loader)
        blocks = weights.layers
        _check_stages(cfg, weights.mtp, num_experts is None)
    for i, layer in enumerate(blocks):
        ex = layer.moe.experts
        if ex.w13.format != ex.w2.format:
            raise CheckpointError(f"block {i}: routed experts' w13 is {ex.w13.format} and w2 {ex.w2.format}; "
                                  "both must have one format")
        if ex.w13.weight.shape[0] != want or ex.w2.weight.shape[0] != want:
            raise CheckpointError(f"block {i}: the expert stacks hold {ex.w13.weight.shape[0]} experts, "
                                  f"expected {want}")
    if hook is not None:
        hook.deepinfer_process_weights(weights=weights, model_config=cfg)
    return weights


def _check_stages(cfg: Any, stages: list[DSparkStage], whole: bool) -> None:
    """The stages a 0731 checkpoint holds: all of them or none, each expert stack of one format (of the
    stages' count where every expert was loaded)."""
    want = cfg.drafter_moe_config()[0]
    if stages and len(stages) != cfg.num_nextn_predict_layers:
        raise CheckpointError(f"found {len(stages)} DSpark stages (mtp.*), the config has "
                              f"{cfg.num_nextn_predict_layers}")
    for j, stage in enumerate(stages):
        ex = stage.block.moe.experts
        if ex.w13.format != ex.w2.format:
            raise CheckpointError(f"mtp.{j}: routed experts' w13 is {ex.w13.format} and w2 {ex.w2.format}")
        if whole and ex.w13.weight.shape[0] != want:
            raise CheckpointError(f"mtp.{j}: the expert stacks hold {ex.w13.weight.shape[0]} experts, expected "
                                  f"{want}")

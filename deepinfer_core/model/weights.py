"""The model's weights as typed records, one per component, as the forward reads them.

The loader (:mod:`deepinfer_core.model.loader`) builds them and alone knows which checkpoint tensor fills
which field. Tensors keep the checkpoint's layout, routed experts stacked; a backend may re-lay them in
``deepinfer_process_weights`` by replacing fields.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, fields, is_dataclass

import torch


@dataclass
class Linear:
    """``x @ weight.T`` for a logical weight [N, K] (stacked experts: [E, N, K]), kept in one of three
    formats (:attr:`format`):

    * ``"float"``: ``weight`` [N, K] in a float dtype, ``scale`` None;
    * ``"fp8"``: ``weight`` E4M3 [N, K], ``scale`` one float32 per 128x128 tile ``[ceil(N/128), ceil(K/128)]``;
    * ``"fp4"``: ``weight`` uint8 [N, K/2], two e2m1 values a byte along K (the even one in the low
      nibble), ``scale`` ``float8_e8m0fnu`` [N, K/32], one power of two per 32 inputs
      (:mod:`deepinfer_core.quant.fp4`)."""

    weight: torch.Tensor
    scale: torch.Tensor | None = None

    @property
    def format(self) -> str:
        if self.scale is None:
            return "float"
        return "fp4" if self.weight.dtype in (torch.uint8, torch.float4_e2m1fn_x2) else "fp8"

    @property
    def is_fp8(self) -> bool:
        return self.format == "fp8"

    @property
    def is_fp4(self) -> bool:
        return self.format == "fp4"


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
class Experts:
    """Routed experts, stacked: ``w13`` [E, 2I, D] (gate rows, then up rows) and ``w2`` [E, D, I], both
    in one :attr:`Linear.format` (FP4: packed [E, 2I, D/2] and [E, D, I/2] with scales per 32 inputs)."""

    w13: Linear
    w2: Linear

    @property
    def is_fp8(self) -> bool:
        return self.w13.is_fp8 and self.w2.is_fp8

    @property
    def is_fp4(self) -> bool:
        return self.w13.is_fp4 and self.w2.is_fp4


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
        from deepinfer_core.model.loader import named_parameters

        return named_parameters(self)


def records(root: object, leaves: tuple[type, ...] = ()) -> Iterator[object]:
    """``root`` (a record or a list of them) and every record nested in it, depth first; the records of a
    type in ``leaves`` are yielded but not entered."""
    if isinstance(root, list):
        for item in root:
            yield from records(item, leaves)
        return
    if not is_dataclass(root):
        return
    yield root
    if isinstance(root, leaves):
        return
    for f in fields(root):
        yield from records(getattr(root, f.name), leaves)

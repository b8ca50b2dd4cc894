"""DeepSeek-V4-Flash-0731's DSpark drafter as its config.json declares it.

0731 is the V4-Flash architecture with a 3-stage DSpark drafter under ``mtp.{0,1,2}`` in place of the one MTP
layer. Its config is recognised by its fields: ``n_mtp_layers`` (the stages) differs from
``num_nextn_predict_layers`` (the root config still says 1 where DeepSeek's ``inference/config.json`` says
``n_mtp_layers: 3``), or it names ``dspark_block_size``; ``compress_ratios`` then has one entry per backbone
layer and per stage (46: 43 + 3), the stages' 0. A plain V4 config (neither field) has no :class:`DSparkSpec`
and parses exactly as before.

The ``dspark_*`` keys are V4.1's names; where a 0731 config leaves one out the published 0731 value stands
(block 5, noise token 128799, Markov rank 256, the last backbone layers as targets: [40, 41, 42] of 43 for
three stages, the stages' experts those of the backbone: 256, top-6).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deepinfer_core.model.errors import UnsupportedModelError

#: 0731's published drafter values, for the keys a config leaves out
BLOCK_SIZE = 5
NOISE_TOKEN_ID = 128799
MARKOV_RANK = 256


@dataclass(frozen=True)
class DSparkSpec:
    """The drafter of a 0731 config: ``stages`` blocks drafting ``block_size`` positions from the hc-mean of
    the outputs of ``target_layer_ids``; their MoE routes ``top_k`` of ``num_experts``."""

    stages: int
    block_size: int
    noise_token_id: int
    target_layer_ids: tuple[int, ...]
    markov_rank: int
    num_experts: int
    top_k: int


def _get(hf: Any, name: str) -> Any:
    return getattr(hf, name, None)


def is_dspark(hf: Any) -> bool:
    """Does this V4 config (a transformers ``DeepseekV4Config``) declare DSpark stages?"""
    stages, nextn = _get(hf, "n_mtp_layers"), _get(hf, "num_nextn_predict_layers")
    return _get(hf, "dspark_block_size") is not None or (stages is not None and stages != nextn)


def dspark_spec(hf: Any) -> DSparkSpec | None:
    """The drafter ``hf`` declares (unchecked; :func:`validate` checks it), None for a plain V4 config."""
    if not is_dspark(hf):
        return None
    n = int(hf.num_hidden_layers)
    stages = _get(hf, "n_mtp_layers")
    stages = int(stages if stages is not None else hf.num_nextn_predict_layers or 0)
    targets = _get(hf, "dspark_target_layer_ids")
    targets = tuple(range(n - stages, n)) if targets is None else tuple(targets)

    def value(name: str, default: Any) -> Any:
        v = _get(hf, name)
        return default if v is None else v

    return DSparkSpec(
        stages=stages, block_size=value("dspark_block_size", BLOCK_SIZE),
        noise_token_id=value("dspark_noise_token_id", NOISE_TOKEN_ID), target_layer_ids=targets,
        markov_rank=value("dspark_markov_rank", MARKOV_RANK),
        num_experts=value("dspark_n_routed_experts", 0) or hf.n_routed_experts,
        top_k=value("dspark_n_activated_experts", 0) or hf.num_experts_per_tok)


def validate(spec: DSparkSpec, hf: Any, raw: dict[str, Any], where: str) -> None:
    """An :class:`UnsupportedModelError` naming the first field of the drafter ``raw`` (config.json) gets
    wrong."""
    n, vocab = int(hf.num_hidden_layers), int(hf.vocab_size)

    def fail(msg: str) -> None:
        raise UnsupportedModelError(f"{where}: DSpark drafter (V4-Flash-0731 layout): {msg}")

    def positive_int(name: str, v: Any) -> None:
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            fail(f"{name} must be an integer >= 1, got {v!r}")

    positive_int("n_mtp_layers (the DSpark stages)", spec.stages)
    positive_int("dspark_block_size", spec.block_size)
    positive_int("dspark_markov_rank", spec.markov_rank)
    positive_int("dspark_n_routed_experts", spec.num_experts)
    positive_int("dspark_n_activated_experts", spec.top_k)
    if spec.top_k > spec.num_experts:
        fail(f"the stages route {spec.top_k} of {spec.num_experts} experts")
    if not isinstance(spec.noise_token_id, int) or not 0 <= spec.noise_token_id < vocab:
        fail(f"dspark_noise_token_id {spec.noise_token_id!r} is not a token id of the {vocab}-entry vocabulary")
    ids = list(spec.target_layer_ids)
    if not ids:
        fail("dspark_target_layer_ids is empty: main_proj reads at least one target layer")
    if any(not isinstance(i, int) or not 0 <= i < n for i in ids):
        fail(f"dspark_target_layer_ids {ids} holds ids outside the {n} backbone layers")
    if ids != sorted(set(ids)):
        fail(f"dspark_target_layer_ids {ids} must be strictly increasing")
    ratios = raw.get("compress_ratios")
    if ratios is not None:
        if len(ratios) != n + spec.stages:
            fail(f"compress_ratios has {len(ratios)} entries; {n} layers and {spec.stages} stages need "
                 f"{n + spec.stages}")
        if any(ratios[n:]):
            fail(f"compress_ratios gives the stages {ratios[n:]}; they are window-only (0)")

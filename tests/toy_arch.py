"""A toy architecture registered from the tests folder: DeepSeek-V4 plus one extra tensor and one extra
cache branch that two layers share. Nothing in deepinfer_core knows it.

* The branch ``"toy"`` (rate 4, overlapping windows, no ring of its own) is owned by layer 1: each step
  it stores half of the compressed KV entries layer 1 just wrote. Layer 3 reads that same pool.
* The tensor ``layers.3.attn.toy_proj.weight`` [hidden, head_dim]: layer 3 adds ``toy_proj`` of the mean
  of the toy entries its query may see to its attention output.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import DeepseekV4Config as HFConfig

from deepinfer_core.model.cache_layout import BranchSpec, CacheLayout
from deepinfer_core.model.manifest import CheckpointManifest, TensorSpec
from deepinfer_core.model.records import Linear
from deepinfer_core.models import deepseek_v4 as v4
from deepinfer_core.models.deepseek_v4.config import DeepseekV4Config, layer_branches
from deepinfer_core.models.registry import Architecture

NAME, MODEL_TYPE = "ToyDeepseekV4ForCausalLM", "toy_deepseek_v4"
OWNER, READER, RATE = 1, 3, 4
TOY_PROJ = f"layers.{READER}.attn.toy_proj.weight"


class ToyConfig(DeepseekV4Config):
    @classmethod
    def parse(cls, path: Path, raw: dict[str, Any]) -> ToyConfig:
        return cls(HFConfig.from_dict({**raw, "model_type": "deepseek_v4"}), path)

    @property
    def architecture(self) -> Architecture:
        return ARCHITECTURE


def manifest(cfg: ToyConfig) -> CheckpointManifest:
    base = v4.manifest(cfg)
    row = TensorSpec(TOY_PROJ, (cfg.hidden_size, cfg.head_dim), "bf16")
    return CheckpointManifest({**base.rows, TOY_PROJ: row}, base.renames, base.ignored, base.tied)


def cache_layout(cfg: ToyConfig) -> CacheLayout:
    layers = layer_branches(cfg)
    assert cfg.compress_rate(OWNER) == RATE and cfg.is_csa(OWNER) and cfg.compress_rate(READER) == RATE
    layers[OWNER]["toy"] = BranchSpec(RATE, cfg.head_dim, overlap=True, kind="toy", stateful=False, kv_entry=False)
    layers[READER]["toy"] = OWNER
    return CacheLayout.build(layers)


def build_weights(cfg: ToyConfig, params: dict[str, torch.Tensor], hook: Any = None,
                  num_experts: int | None = None) -> Any:
    weights = v4.build_weights(cfg, params, hook, num_experts)
    weights.toy_proj = Linear(params[TOY_PROJ])
    return weights


class ToyModel(v4.DeepseekV4Model):
    def attention(self, a, layer, h, batch, cache, rope, candidates):
        out = super().attention(a, layer, h, batch, cache, rope, candidates)
        toy = cache.entries.get("toy", {}).get(layer)
        if layer == OWNER:  # the entries that closed this step (slot -1: the trash row)
            slots = batch.compressors[RATE, True].entry_slots
            toy[slots] = cache.comp_kv[layer][slots] * 0.5
        elif layer == READER:
            rows = candidates[RATE]
            seen = (rows >= 0).unsqueeze(-1)
            mean = (toy[rows.clamp(min=0)] * seen).sum(1) / seen.sum(1).clamp(min=1)
            out = out + self.linear(mean.to(out.dtype), self.weights.toy_proj)
        return out


def load_model(cfg, path, ops, dtype, device, hook, quantization, numerics, experts, show_progress):
    from deepinfer_core.model.loader import load_weights

    weights = load_weights(cfg, path, dtype, device, keep_fp8=quantization == "fp8", show_progress=show_progress,
                           hook=hook, experts=experts, numerics=numerics)
    return ToyModel(cfg, weights, ops, dtype, numerics=numerics)


ARCHITECTURE = Architecture(
    name=NAME, model_types=(MODEL_TYPE,), config_class=ToyConfig, manifest=manifest, cache_layout=cache_layout,
    load_model=load_model, default_numerics=lambda cfg: "transformers", numerics=("transformers",),
    build_weights=build_weights, prepare_params=v4.stack_shared_experts, drafters={"mtp": v4.DeepseekV4MTP},
)

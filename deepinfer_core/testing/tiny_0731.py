"""Tiny DeepSeek-V4-Flash-0731 checkpoints for tests: the tiny V4 backbone (``tiny_model``'s ``"tiny"``, four
mHC streams) with three DSpark stages, in the published layout, generated from the manifest.

The config is 0731's form: ``compress_ratios`` with one entry per backbone layer and per stage (the stages'
0), ``n_mtp_layers`` 3 beside ``num_nextn_predict_layers`` 1, V4.1's ``dspark_*`` keys (a block of 3, the
outputs of layers 1-3 as targets). The stages' expert count is the backbone's, as in 0731. Weights are random
at scales that keep activations of order one, written as the published files store them (FP8 linears with
128x128 ue8m0 scales, FP4 experts), so the values a loader reads are exactly representable.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from deepinfer_core.testing.published_checkpoint import (
    QUANTIZATION_CONFIG,
    random_checkpoint_tensors,
    to_published,
    write_tensors,
)
from deepinfer_core.testing.tiny_model import build_tokenizer, tiny_config

#: the drafter's fields of the tiny 0731 (the backbone is tiny_model's "tiny" with hc_mult 4)
TINY_0731_DRAFTER: dict[str, Any] = dict(
    num_nextn_predict_layers=1, n_mtp_layers=3, dspark_block_size=3, dspark_noise_token_id=380,
    dspark_target_layer_ids=[1, 2, 3], dspark_markov_rank=16,
)
#: per layer of the backbone (CSA 4, HCA 8), then the stages (window only)
_RATIOS = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 8}


def tiny_0731_config(**overrides: Any) -> dict:
    """The config.json of the tiny 0731 (``overrides`` on any field, drafter fields included)."""
    hf = tiny_config("tiny", hc_mult=4).to_dict()
    drafter = {**TINY_0731_DRAFTER, **{k: v for k, v in overrides.items() if k in TINY_0731_DRAFTER}}
    backbone = {k: v for k, v in overrides.items() if k not in TINY_0731_DRAFTER}
    stages = drafter["n_mtp_layers"] if drafter.get("n_mtp_layers") is not None else 1
    ratios = [_RATIOS[t] for t in hf["layer_types"]] + [0] * stages
    keep = ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "q_lora_rank", "num_experts_per_tok", "n_routed_experts",
            "n_shared_experts", "scoring_func", "norm_topk_prob", "routed_scaling_factor", "max_position_embeddings",
            "rope_theta", "layer_types", "compress_rates", "compress_rope_theta", "hc_mult", "hc_sinkhorn_iters",
            "hc_eps", "mlp_layer_types", "swiglu_limit", "sliding_window", "o_groups", "o_lora_rank", "index_n_heads",
            "index_head_dim", "index_topk", "hidden_act", "rms_norm_eps", "bos_token_id", "eos_token_id",
            "tie_word_embeddings", "rope_parameters", "partial_rotary_factor")
    config = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
              **{k: hf[k] for k in keep}, "compress_ratios": ratios, **drafter,
              "quantization_config": dict(QUANTIZATION_CONFIG), "expert_dtype": "fp4", "torch_dtype": "bfloat16"}
    config.update(backbone)
    return config


def _random(name: str, shape: tuple[int, ...], gen: torch.Generator, top_k: int, experts: int) -> torch.Tensor:
    """A value for parameter ``name`` at a scale that keeps the forward's activations of order one."""
    def randn(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=gen)

    if name.endswith("tid2eid"):  # distinct experts per token id
        return torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(shape[0])]).int()
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * randn(*shape)
    if name.endswith(("attn_sink", "embed.weight")):
        return randn(*shape)
    if "hc_" in name:
        if name.endswith("_fn"):
            return randn(*shape) / math.sqrt(shape[-1])
        return (0.5 + 0.1 * randn(*shape)) if name.endswith("_scale") else 0.5 * randn(*shape)
    if name.endswith(("gate.bias", ".ape")):
        return 0.1 * randn(*shape)
    return randn(*shape) / math.sqrt(shape[-1])


def build_tiny_0731(path: str | Path, seed: int = 0, shards: int = 1, with_drafter: bool = True,
                    **overrides: Any) -> Path:
    """A random tiny V4-Flash-0731 in the published layout in ``path`` (config.json, safetensors, a byte-level
    BPE tokenizer); ``overrides`` change config fields; ``with_drafter`` False leaves the stages out."""
    from deepinfer_core.config import ModelConfig
    from deepinfer_core.model.loader import manifest_of

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = tiny_0731_config(**overrides)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    cfg = ModelConfig.from_pretrained(path)
    man = manifest_of(cfg)
    gen = torch.Generator().manual_seed(seed)
    tensors = random_checkpoint_tensors(
        man, lambda name, shape: _random(name, shape, gen, cfg.num_experts_per_tok, cfg.n_routed_experts),
        with_drafter)
    write_tensors(path, to_published(tensors, man), shards)
    build_tokenizer(path, cfg.vocab_size)
    (path / "deepinfer_tiny.json").write_text(json.dumps({"name": "tiny_0731", "seed": seed, "layout": "published"}))
    return path

"""Tiny DeepSeek-V4.1 checkpoints in the release's layout, for tests, generated from the manifest.

Every feature bites at short lengths (``TINY_V41``): a window of 8, KV sources of ratio 2 and 1 each
followed by readers, index sources that reindex and layers that reuse their top-k, a candidate source
whose 2-entry blocks the later index sources rank inside (3 blocks kept: pruning starts past 6 entries),
an index top-k of 4 (smaller than the compressed positions of any prompt past a dozen tokens), two
Engram layers, three DSpark stages; optionally a two-block vision tower (``TINY_V41_VISION``). Widths are
whole quantisation groups (32 for FP8 tiles and activations, 16 for compressed KV).

The weights are random at scales that keep activations of order one; every tensor is written as the
release stores it (:func:`~deepinfer_core.testing.published_checkpoint.to_published`), so the values a
loader reads are exactly representable in the published formats.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import torch

from deepinfer_core.default_model import EMBEDDED_V4_MODEL as DEFAULT_MODEL_DIR  # its tokenizer
from deepinfer_core.testing.published_checkpoint import random_checkpoint_tensors, to_published, write_tensors

#: the text model's fields (Hugging Face names); Engram row counts and the compressed vocab are derived
TINY_V41: dict[str, Any] = dict(
    vocab_size=4096, hidden_size=128, moe_intermediate_size=64, num_hidden_layers=8, num_attention_heads=2,
    num_key_value_heads=1, head_dim=64, qk_rope_head_dim=16, q_lora_rank=64, o_lora_rank=32, o_groups=2,
    hidden_act="silu", swiglu_limit=10.0, rms_norm_eps=1e-20, max_position_embeddings=4096, rope_theta=10000.0,
    rope_scaling={"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                  "original_max_position_embeddings": 64},
    compress_rope_theta=160000.0, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    scoring_func="sqrtsoftplus", topk_method="noaux_tc", norm_topk_prob=True, routed_scaling_factor=1.5,
    sliding_window=8, compress_ratios=[0, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0], kv_source_layer_ids=[1, 4],
    index_source_layer_ids=[1, 4, 6], index_n_heads=2, index_head_dim=32, index_topk=4,
    candidate_source_layer_id=4, candidate_topk_blocks=3, candidate_block_size=2, hc_mult=4,
    hc_sinkhorn_iters=20, hc_eps=1e-6, engram_layer_ids=[1, 5], engram_vocab_size=1000, engram_max_ngram_size=3,
    engram_n_heads=2, engram_head_dim=32, engram_pad_token_id=2, num_nextn_predict_layers=3,
    dspark_block_size=3, dspark_noise_token_id=4000, dspark_target_layer_ids=[5, 6, 7], dspark_markov_rank=32,
    dspark_n_routed_experts=4, dspark_n_activated_experts=2, image_token_id=4001,
)

#: a vision tower small enough for the CPU: head_dim 16, 2 blocks, at most 40 positions an image span, and
#: images below 42x42 pixels scaled up to it
TINY_V41_VISION: dict[str, Any] = dict(
    model_type="deepseek_v41_vision", num_hidden_layers=2, hidden_size=64, num_heads=4, intermediate_size=96,
    patch_size=14, rope_theta=10000.0, downsample_ratio=3, max_image_tokens=40, min_pixels=42 * 42,
    max_wh_ratio=None,
)


def tiny_v41_config(tokenizer_dir: Path = DEFAULT_MODEL_DIR, engram: bool = True, vision: bool = False,
                    **overrides: Any) -> dict:
    """The Hugging Face config.json of the tiny model (with ``overrides`` on the text fields); Engram's
    row counts and compressed vocab derived from the tokenizer in ``tokenizer_dir``; ``vision``: with the
    vision tower of :data:`TINY_V41_VISION`."""
    from deepinfer_core.models.deepseek_v41.engram import engram_layout_of

    text = {**TINY_V41, **overrides}
    if engram and text.get("engram_layer_ids"):
        layout = engram_layout_of(text, tokenizer_dir)
        text.update(engram_num_embeddings=list(layout.num_rows),
                    engram_compressed_vocab_size=layout.compressed_vocab_size)
    else:
        text.update(engram_layer_ids=[], engram_num_embeddings=[])
    return {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "dtype": "bfloat16",
            "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "image_token_id": text["image_token_id"],
            "tie_word_embeddings": False,
            "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                    "weight_block_size": [32, 32], "scale_fmt": "ue8m0", "expert_dtype": "fp4"},
            "text_config": {"model_type": "deepseek_v41_text", **text},
            **({"vision_config": dict(TINY_V41_VISION)} if vision else {})}


def _random(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """A value for parameter ``name`` at a scale that keeps the forward's activations of order one."""
    def randn(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=gen)

    if name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "q_weight", "k_weight")):
        return 1.0 + 0.1 * randn(*shape)
    if name.endswith("attn_sink"):
        return randn(*shape)
    if "hc_" in name:
        if name.endswith("_fn"):
            return 0.1 * randn(*shape)
        if name.endswith("_scale"):
            return 0.5 + 0.1 * randn(*shape)
        return 0.1 * randn(*shape)
    if name.endswith(("gate.bias", "gate.bias_vl")):
        return 0.05 * randn(*shape)
    if name.endswith(("embed.weight", "markov_head.embed.weight")) or name.startswith("image_"):
        return randn(*shape)
    fan_in = shape[-1]
    return randn(*shape) / math.sqrt(fan_in)


def build_tiny_v41(path: str | Path, seed: int = 0, shards: int = 1, with_drafter: bool = True,
                   vision: bool = False, **overrides: Any) -> Path:
    """A random tiny DeepSeek-V4.1 in the release's layout in ``path`` (config.json, safetensors and the
    embedded tokenizer); ``overrides`` change the text fields of :data:`TINY_V41`; ``vision``: with a
    vision tower (:data:`TINY_V41_VISION`), the routers' ``bias_vl`` and the span delimiters."""
    from deepinfer_core.models.deepseek_v41.config import DeepseekV41Config
    from deepinfer_core.models.deepseek_v41.manifest import manifest

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = tiny_v41_config(vision=vision, **overrides)
    cfg = DeepseekV41Config.from_dict(config, path)
    man = manifest(cfg)
    gen = torch.Generator().manual_seed(seed)
    tensors = random_checkpoint_tensors(man, lambda name, shape: _random(name, shape, gen), with_drafter)
    write_tensors(path, to_published(tensors, man), shards)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL_DIR / f, path / f)
    return path

"""DeepSeek-V4.1(-Flash): config, checkpoint manifest, weight records, cache layout and forward."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from deepinfer_core.model.errors import UnsupportedModelError
from deepinfer_core.models.deepseek_v41 import engram_placement as engram_placement_
from deepinfer_core.models.deepseek_v41.config import DeepseekV41Config, cache_layout
from deepinfer_core.models.deepseek_v41.dspark import DeepseekV41DSpark
from deepinfer_core.models.deepseek_v41.manifest import manifest
from deepinfer_core.models.deepseek_v41.model import NUMERICS, DeepseekV41Model
from deepinfer_core.models.deepseek_v41.replay import replay_layers
from deepinfer_core.models.deepseek_v41.weights import ModelWeights, build_weights, stack_shared_experts
from deepinfer_core.models.registry import Architecture


def default_numerics(cfg: DeepseekV41Config) -> str:
    """``"deepseek"``: the release was trained with its quantisation steps."""
    return "deepseek"


def load_model(cfg: DeepseekV41Config, path: Path, ops: Any, dtype: torch.dtype, device: torch.device | str,
               hook: Any, quantization: str | None, numerics: str, experts: range | None,
               show_progress: bool, engram_placement: str | None = None, engram_shard: bool = False,
               drafter_experts: range | None = None) -> DeepseekV41Model:
    """The weights in ``path`` on ``device`` as a model running ``ops``: packed FP4 routed experts stay packed
    under deepseek numerics, everything else is dequantised to ``dtype``; the Engram tables stay FP8 where
    ``engram_placement`` puts them (:mod:`.engram_placement`; None: the memory plan's choice), their rows
    split over the ranks with ``engram_shard``; ``drafter_experts``: the DSpark stages' own experts to read
    (expert parallel: a rank's share; all by default)."""
    from deepinfer_core.model.loader import manifest_of, read_checkpoint, read_headers

    if quantization is not None:
        raise UnsupportedModelError(f"quantization={quantization!r} is not supported for DeepSeek-V4.1 yet: its "
                                    "weights are dequantised on load (quantization=None)")
    tables = frozenset(engram_placement_.table_names(cfg)) if cfg.has_engram else frozenset()
    params = read_checkpoint(cfg, path, dtype, device, keep_fp8=False, show_progress=show_progress, experts=experts,
                             keep_fp4=numerics == "deepseek", numerics=numerics, exclude=tables,
                             drafter_experts=drafter_experts)
    shard = _engram_shard(engram_shard) if tables else None
    placement = None
    if tables:
        other = sum(t.numel() * t.element_size() for t in params.values())
        placement = engram_placement_.resolve_placement(cfg, engram_placement, device, other)
        params.update(engram_placement_.place_tables(cfg, read_headers(Path(path), manifest_of(cfg)), placement,
                                                     device, shard))
    weights = build_weights(cfg, params, hook, num_experts=None if experts is None else len(experts))
    engram_hash = None
    if cfg.has_engram:
        from deepinfer_core.models.deepseek_v41.engram import engram_hasher

        engram_hash = engram_hasher(cfg, path, device)
    model = DeepseekV41Model(cfg, weights, ops, dtype, numerics=numerics, engram_hash=engram_hash)
    model.engram_placement = placement if tables else None
    if shard is not None:
        starts = {id(weights.layers[layer].engram.table.weight): engram_placement_.shard_rows(rows, *shard).start
                  for layer, rows in zip(cfg.engram_layer_ids, cfg.engram_num_embeddings)}
        model.engram_lookup = engram_placement_.ShardedEngramLookup(ops, None, starts)
    return model


def _engram_shard(shard: bool) -> tuple[int, int] | None:
    """(rank, world) of the rows this rank holds with ``engram_shard``, None without (or in one process)."""
    import torch.distributed as dist

    if not shard:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("engram_shard splits the Engram tables over the ranks of a parallel engine; this one "
                         "has a single process (drop engram_shard, or run data_parallel_size > 1)")
    return dist.get_rank(), dist.get_world_size()


ARCHITECTURE = Architecture(
    name="DeepseekV41ForCausalLM",
    model_types=("deepseek_v41",),
    config_class=DeepseekV41Config,
    manifest=manifest,
    cache_layout=cache_layout,
    load_model=load_model,
    default_numerics=default_numerics,
    numerics=NUMERICS,
    build_weights=build_weights,
    prepare_params=stack_shared_experts,
    kv_layouts={"deepseek": "fp4_ds"},
    replay_layers=replay_layers,
    drafters={"dspark": DeepseekV41DSpark},
)

__all__ = ["ARCHITECTURE", "NUMERICS", "DeepseekV41Config", "DeepseekV41Model", "ModelWeights", "load_model",
           "manifest"]

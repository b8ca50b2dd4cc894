"""What every rank of a parallel layout allocates, predicted before anything is loaded (``deepinfer plan``):
weight bytes (every rank holds the attention, shared-expert and dense weights; with expert parallel only
its own physical expert slots, redundant ones included) and KV bytes (the paged pools and state slots
the memory plan sizes from the rank's budget, as the worker will)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from deepinfer_core.config import CacheConfig, ModelConfig, SchedulerConfig, resolve_dtype
from deepinfer_core.engine.memory import plan_pools
from deepinfer_core.models import default_numerics
from deepinfer_core.model.cache import bytes_per_block, bytes_per_state_slot
from deepinfer_core.model.kv_cache_spec import KVCacheSpec, resolve_kv_cache_spec
from deepinfer_core.model.loader import expected_shapes, has_drafter_weights, parameter_dtype


@dataclass
class RankMemory:
    rank: int
    device: int
    expert_slots: int  # routed-expert slots held (per MoE layer)
    weight_bytes: int  # all weights, routed experts included
    expert_bytes: int  # of which routed experts
    kv_bytes: int  # paged pools and state slots
    num_blocks: int
    num_window_blocks: int
    num_state_slots: int
    kv_layout: str = "dense"
    entry_bytes: int = 0  # one window or compressed entry
    #: per source token, across all layers: compressed pools (entries, indexer keys, boundary records),
    #: kept for the whole sequence, and window pools, kept for the sliding window; dense_*: the same in
    #: dense entries of the model's dtype
    compressed_bytes_per_token: float = 0.0
    window_bytes_per_token: float = 0.0
    dense_compressed_bytes_per_token: float = 0.0
    dense_window_bytes_per_token: float = 0.0

    def as_dict(self) -> dict[str, int | float | str]:
        return asdict(self)


def weight_bytes(cfg: ModelConfig, dtype: torch.dtype, with_mtp: bool, num_experts: int) -> tuple[int, int]:
    """(all weight bytes, routed-expert bytes) of a model holding ``num_experts`` routed slots per layer."""
    total = experts = 0
    for name, shape in expected_shapes(cfg, with_mtp, num_experts).items():
        size = parameter_dtype(cfg, name, dtype).itemsize
        for dim in shape:
            size *= dim
        total += size
        if ".ffn.experts." in name:
            experts += size
    return total, experts


def plan_memory(args: Any) -> list[RankMemory]:
    """Per rank, for :class:`~deepinfer_core.engine.args.EngineArgs` ``args`` (float weights)."""
    from deepinfer_core.default_model import default_model_path
    from deepinfer_core.engine.args import parallel_config_of
    from deepinfer_core.platform import Platform
    from deepinfer_core.plugins import load_backend
    from deepinfer_core.worker.executor import place_ranks

    if args.quantization is not None:
        raise ValueError("the per-rank memory plan covers float weights; for a quantised checkpoint, "
                         "`deepinfer plan CONFIG` gives its footprint from its config.json")
    path = Path(args.model) if args.model is not None else default_model_path()
    cfg = ModelConfig.from_pretrained(path)
    backend = load_backend(args.backend)
    hook = backend.hook
    pc = parallel_config_of(args)
    cache = CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                        num_window_blocks=args.num_window_blocks,
                        cpu_kv_cache_bytes=args.kv_cache_bytes, gpu_memory_utilization=args.gpu_memory_utilization,
                        enable_prefix_caching=args.enable_prefix_caching)
    hook.deepinfer_configure(model_config=cfg, cache_config=cache)
    sched = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                            max_model_len=args.max_model_len or int(cfg.max_position_embeddings),
                            enable_chunked_prefill=args.enable_chunked_prefill)
    device = torch.device(args.device) if args.device else hook.deepinfer_init_device(local_rank=0)
    platform = hook.deepinfer_platform(device=device) or Platform(device)
    dtype = resolve_dtype(args.dtype, platform.default_dtype)
    if platform.measures_memory:
        raise ValueError(f"{device.type} sizes its KV pools from the memory left after a profiling forward; "
                         "the plan covers budget-sized pools (CPU)")
    numerics = args.numerics or default_numerics(cfg)
    spec = resolve_kv_cache_spec(hook, cfg, cache, dtype, numerics)
    with_mtp = has_drafter_weights(cfg, path)
    world = pc.data_parallel_size
    slots = pc.num_physical_experts(cfg.n_routed_experts) // pc.expert_parallel_size
    weights, experts = weight_bytes(cfg, dtype, with_mtp, slots)
    sizes = plan_pools(cfg, cache, sched, dtype, platform.memory_budget(cache), spec)
    comp, window = bytes_per_block(cfg, cache.block_size, dtype, spec)
    # the cache allocates one row more of each pool than the plan hands out (see ModelCache)
    kv = ((sizes.num_blocks + 1) * comp + (sizes.num_window_blocks + 1) * window
          + (sizes.num_state_slots + 1) * bytes_per_state_slot(cfg, dtype, spec))
    dense_comp, dense_window = bytes_per_block(cfg, cache.block_size, dtype, KVCacheSpec.default(cfg, cache.block_size,
                                                                                                 dtype))
    bs = cache.block_size
    per_token = dict(kv_layout=spec.layout, entry_bytes=spec.entry_bytes, compressed_bytes_per_token=comp / bs,
                     window_bytes_per_token=window / bs, dense_compressed_bytes_per_token=dense_comp / bs,
                     dense_window_bytes_per_token=dense_window / bs)
    _, plan = place_ranks(backend, pc)
    return [RankMemory(r, plan.device_of_rank.get(r, 0), slots, weights, experts, kv, sizes.num_blocks,
                       sizes.num_window_blocks, sizes.num_state_slots, **per_token) for r in range(world)]


def measured_memory(model: Any, cache: Any) -> dict[str, int]:
    """What a rank holds: the bytes of its model's weights (routed experts apart) and of its cache tensors."""
    total = experts = 0
    for name, t in model.named_parameters():
        size = t.numel() * t.element_size()
        total += size
        if ".ffn.experts." in name:
            experts += size
    return {"weight_bytes": total, "expert_bytes": experts, "kv_bytes": storage_bytes(vars(cache), set())}


def storage_bytes(obj: Any, seen: set[int]) -> int:
    """Bytes of the tensor storages in ``obj`` (nested dicts, lists, tuples), each storage counted once
    across calls sharing ``seen``."""
    if isinstance(obj, torch.Tensor):
        key = obj.untyped_storage().data_ptr()
        if key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, dict):
        return sum(storage_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(storage_bytes(v, seen) for v in obj)
    return 0

"""``deepinfer plan``: memory predicted before anything is loaded, from the one estimate
(:mod:`deepinfer_core.engine.memory`) the engine sizes its pools with.

- :func:`plan_memory`: what every rank of a parallel layout allocates for a set of engine arguments:
  weight bytes (every rank holds the attention, shared-expert and dense weights; with expert parallel
  only its own physical expert slots, redundant ones included) and KV bytes (the paged pools and state
  slots the memory plan sizes from the rank's budget, as the worker will).
- :func:`footprint`: what a model needs from its config alone (``deepinfer plan CONFIG``): weight bytes as
  stored (DeepSeek's published layout) and as loaded, per rank under N-way expert parallelism, KV bytes
  per token for each layer type, window and state bytes per sequence, and the longest context / the most
  sequences that fit a device beside the weights (activations and CUDA graph pools not counted).
- :func:`measured_memory`: what a rank holds, to check the predictions against.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from deepinfer_core.config import CacheConfig, ModelConfig, SchedulerConfig, resolve_dtype
from deepinfer_core.engine.memory import kv_bytes, layer_kv_bytes, plan_pools, weight_bytes
from deepinfer_core.model.cache_layout import cache_layout
from deepinfer_core.model.kv_cache_spec import KVCacheSpec, resolve_kv_cache_spec
from deepinfer_core.model.loader import has_drafter_weights
from deepinfer_core.models import default_numerics


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
    slots = pc.num_physical_experts(cfg.n_routed_experts) // pc.expert_parallel_size
    rank = plan_rank(cfg, dtype, spec, cache, sched, platform.memory_budget(cache), slots,
                     has_drafter_weights(cfg, path), drafter_slots(cfg, pc, args))
    _, plan = place_ranks(backend, pc)
    return [dataclasses.replace(rank, rank=r, device=plan.device_of_rank.get(r, 0))
            for r in range(pc.data_parallel_size)]


def drafter_slots(cfg: ModelConfig, pc: Any, args: Any) -> int | None:
    """The slots of its drafter's own experts a rank keeps under expert parallel (:func:`own_drafter_experts`:
    the worker shards them as the target's); None: all of them."""
    from deepinfer_core.parallel.ep import own_drafter_experts

    own = own_drafter_experts(cfg, args)
    if own is None or pc.expert_parallel_size <= 1:
        return None
    return pc.num_physical_experts(own) // pc.expert_parallel_size


def plan_rank(cfg: ModelConfig, dtype: torch.dtype, spec: KVCacheSpec, cache: CacheConfig, sched: SchedulerConfig,
              budget: int, expert_slots: int, with_mtp: bool = True, drafter_expert_slots: int | None = None
              ) -> RankMemory:
    """What one rank (rank 0, device 0) holding ``expert_slots`` routed experts per MoE layer (and
    ``drafter_expert_slots`` of a drafter's own, all by default) allocates (float weights) with a KV budget
    of ``budget`` bytes, in the KV layout ``spec``."""
    weights = weight_bytes(cfg, dtype, with_mtp=with_mtp, num_experts=expert_slots,
                           drafter_experts=drafter_expert_slots)
    sizes = plan_pools(cfg, cache, sched, dtype, budget, spec)
    kv = kv_bytes(cfg, cache.block_size, dtype, spec)
    dense = kv_bytes(cfg, cache.block_size, dtype, KVCacheSpec.default(cfg, cache.block_size, dtype))
    return RankMemory(0, 0, expert_slots, weights["dequantised"], weights["dequantised_experts"], kv.allocated(sizes),
                      sizes.num_blocks, sizes.num_window_blocks, sizes.num_state_slots, spec.layout, spec.entry_bytes,
                      kv.compressed_per_token, kv.window_per_token, dense.compressed_per_token, dense.window_per_token)


@dataclass
class LayerKV:
    kind: str  # "sliding", "csa" (rate 4 with indexer), "hca" (rate 128) or "mtp"
    layers: int
    compressed_bytes_per_token: float  # kept for the whole sequence
    window_bytes_per_token: float  # kept for the sliding window only


@dataclass
class Footprint:
    stored_bytes: int
    stored_expert_bytes: int
    loaded_bytes: int  # the engine's parameters: FP8 / FP4 kept where the checkpoint has them
    loaded_expert_bytes: int
    dequantised_bytes: int  # every weight in the model dtype (float32 where the engine keeps float32)
    devices: int
    rank_bytes: int  # one rank's loaded weights under ``devices``-way expert parallelism
    kv: list[LayerKV]
    window_bytes_per_seq: int  # the window pools of one sequence (its last sliding_window tokens)
    state_bytes_per_seq: int  # its compressor state slot
    device_memory: int | None = None
    context: int = 0  # the context ``max_seqs`` is for
    longest_context: int | None = None  # of one sequence on one rank
    max_seqs: int | None = None  # of ``context`` tokens on one rank
    notes: list[str] = field(default_factory=list)
    table_bytes: int = 0  # of the loaded bytes (and of every rank's): lookup tables kept FP8 (Engram)
    #: where each Engram placement puts the tables' bytes (:func:`engram_bytes`), empty without tables
    engram: list[EngramPlacementBytes] = field(default_factory=list)

    @property
    def compressed_bytes_per_token(self) -> float:
        return sum(k.compressed_bytes_per_token for k in self.kv)

    def as_dict(self) -> dict:
        return {**asdict(self), "compressed_bytes_per_token": self.compressed_bytes_per_token}


@dataclass
class EngramPlacementBytes:
    """Where one Engram placement puts the tables, per rank on its device and per node in host memory."""

    placement: str  # "device", "device sharded", "host", "host sharded", "file"
    device_bytes_per_rank: int
    host_bytes_per_node: int  # pinned or shared host memory (one copy per node); file: 0 (page cache)
    fits: bool | None = None  # the device's memory holds the rank's weights with it (None: not asked)
    note: str = ""


def engram_bytes(table_bytes: int, devices: int, rank_bytes_without: int,
                 device_memory: int | None) -> list[EngramPlacementBytes]:
    """What each placement of ``table_bytes`` of Engram tables costs with ``devices`` ranks on one node, beside
    ``rank_bytes_without`` of other weights a rank; whether the rank's weights fit ``device_memory``."""
    shard = -(-table_bytes // devices)
    rows = [EngramPlacementBytes("device", table_bytes, 0, note="a copy on every rank's device"),
            EngramPlacementBytes("host", 0, table_bytes, note="pinned, one copy per node shared by its ranks, "
                                                              "read in place over unified addressing"),
            EngramPlacementBytes("file", 0, 0, note="the checkpoint's files mapped: page cache as rows are read")]
    if devices > 1:
        rows[1:1] = [EngramPlacementBytes("device sharded", shard, 0, note=f"rows split over {devices} ranks, "
                                                                           "a lookup collective a layer")]
    for row in rows:
        if device_memory is not None:
            row.fits = rank_bytes_without + row.device_bytes_per_rank <= device_memory
    return rows


def _kind(cfg: ModelConfig, layer: int) -> str:
    """What the plan calls a layer, from the branches it owns or reads: a drafter's, sliding-window only,
    V4's CSA (overlapping windows with indexer keys) and HCA, V4.1's KV sources and the readers of
    another layer's pools."""
    if layer >= cfg.num_hidden_layers:
        return "mtp"
    lc = cache_layout(cfg).layers[layer]
    if not lc.branches:
        return "sliding"
    if not lc.owned:
        return "reader"
    if "index" in lc.owned:
        return "csa" if lc.specs["index"].overlap else "source"
    return "hca"


def footprint(cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16, numerics: str = "deepseek", devices: int = 1,
              device_memory: int | None = None, block_size: int = 128, context: int | None = None,
              redundant_experts: int = 0) -> Footprint:
    """The footprint of ``cfg`` on ``devices`` ranks (expert parallel over them, attention data parallel:
    every rank holds its own KV) of ``device_memory`` bytes each; ``context`` (default: the config's
    ``max_position_embeddings``) is the sequence length ``max_seqs`` counts; ``redundant_experts``: EPLB's
    replicas per MoE layer, spread over the ranks with the logical experts."""
    if devices < 1:
        raise ValueError(f"devices must be at least 1, got {devices}")
    if redundant_experts < 0:
        raise ValueError(f"redundant experts must be >= 0, got {redundant_experts}")
    w = weight_bytes(cfg, dtype, numerics)
    slots = math.ceil((cfg.n_routed_experts + redundant_experts) / devices)
    rank = weight_bytes(cfg, dtype, numerics, num_experts=slots)["loaded"]
    spec = KVCacheSpec.default(cfg, block_size, dtype, numerics)
    kinds: dict[str, LayerKV] = {}
    for i, (comp, window) in enumerate(layer_kv_bytes(cfg, spec)):
        kv = kinds.setdefault(_kind(cfg, i), LayerKV(_kind(cfg, i), 0, 0.0, 0.0))
        kv.layers += 1
        kv.compressed_bytes_per_token += comp / block_size
        kv.window_bytes_per_token += window / block_size
    pools = kv_bytes(cfg, block_size, dtype, spec)
    fp = Footprint(w["stored"], w["stored_experts"], w["loaded"], w["loaded_experts"], w["dequantised"], devices,
                   rank, list(kinds.values()), pools.window_per_seq, pools.state_slot, device_memory,
                   context or cfg.max_position_embeddings, table_bytes=w["loaded_tables"])
    if fp.table_bytes:
        fp.engram = engram_bytes(fp.table_bytes, devices, rank - fp.table_bytes, device_memory)
        if device_memory is not None and not fp.engram[0].fits:
            fits = [e.placement for e in fp.engram if e.fits]
            without = (rank - fp.table_bytes) / 1e9
            fp.notes.append("the Engram tables do not fit on the device beside the other weights; "
                            + (f"{', '.join(fits)} fit ({without:.1f} GB a rank without them; the KV figures "
                               "above count them on the device)" if fits else "no placement fits"))
    if device_memory is not None:
        free = device_memory - fp.rank_bytes
        fixed = fp.window_bytes_per_seq + fp.state_bytes_per_seq
        if free <= fixed:
            fp.longest_context, fp.max_seqs = 0, 0
            fp.notes.append(f"the weights of one rank ({fp.rank_bytes / 1e9:.1f} GB) leave no room for KV on "
                            f"{device_memory / 1e9:.0f} GB devices")
        else:
            fp.longest_context = int((free - fixed) // fp.compressed_bytes_per_token)
            fp.max_seqs = int(free // (fixed + fp.context * fp.compressed_bytes_per_token))
    return fp


#: the share of the device the weights and the Engram tables may fill for ``"device"`` (the rest: KV, activations)
ENGRAM_DEVICE_SHARE = 0.7
#: the share of the host's available memory a ``"host"`` copy may fill
ENGRAM_HOST_SHARE = 0.5


def engram_placement_for(table_bytes: int, host_available: int, device_free: int | None,
                         other_bytes: int = 0) -> tuple[str, str]:
    """(placement, why) of Engram tables of ``table_bytes`` beside ``other_bytes`` of other weights:
    ``"device"`` where weights and tables fill at most :data:`ENGRAM_DEVICE_SHARE` of the device's
    ``device_free`` bytes (None: the device is the host, whose ``host_available`` bytes count instead),
    else ``"host"`` where the tables fill at most :data:`ENGRAM_HOST_SHARE` of ``host_available``, else
    ``"file"`` (read in place from the checkpoint)."""
    gb = 1e9
    if device_free is None:  # the host is the device: a copy, or the file's pages
        if table_bytes <= ENGRAM_HOST_SHARE * host_available:
            return "device", f"{table_bytes / gb:.2f} GB fit the host's {host_available / gb:.1f} GB available"
        return "file", f"{table_bytes / gb:.2f} GB exceed half the host's {host_available / gb:.1f} GB available"
    if other_bytes + table_bytes <= ENGRAM_DEVICE_SHARE * device_free:
        return "device", (f"{table_bytes / gb:.2f} GB fit beside {other_bytes / gb:.1f} GB of weights in the "
                          f"device's {device_free / gb:.1f} GB free")
    if table_bytes <= ENGRAM_HOST_SHARE * host_available:
        return "host", (f"{table_bytes / gb:.2f} GB do not fit the device's {device_free / gb:.1f} GB free beside "
                        f"the weights; the host has {host_available / gb:.1f} GB available")
    return "file", (f"{table_bytes / gb:.2f} GB fit neither the device ({device_free / gb:.1f} GB free) nor half "
                    f"the host's {host_available / gb:.1f} GB available")


def host_available_bytes() -> int:
    """The host memory available to new allocations (``MemAvailable``; physical pages where unknown)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def choose_engram_placement(table_bytes: int, device: torch.device, other_bytes: int = 0) -> tuple[str, str]:
    """:func:`engram_placement_for` with the memory this machine has now (the device's free memory through
    ``torch.accelerator``)."""
    free = None
    if device.type != "cpu":
        free, _ = torch.accelerator.get_memory_info(device)
    return engram_placement_for(table_bytes, host_available_bytes(), free, other_bytes)


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

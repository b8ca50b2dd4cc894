"""Size the paged pools and state slots from a memory budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_core.config import CacheConfig, ModelConfig, SchedulerConfig
from deepinfer_core.model.cache import bytes_per_block, bytes_per_state_slot


@dataclass
class PoolSizes:
    num_blocks: int
    num_window_blocks: int
    num_state_slots: int
    budget_bytes: int


def plan_pools(cfg: ModelConfig, cache: CacheConfig, sched: SchedulerConfig, dtype: torch.dtype,
               device: torch.device) -> PoolSizes:
    """Window blocks: enough for every running sequence's window plus one step's chunk; the rest of the
    budget becomes compressed blocks, which is what grows with sequence length."""
    bs = cache.block_size
    comp_bytes, window_bytes = bytes_per_block(cfg, bs, dtype)
    slot_bytes = bytes_per_state_slot(cfg, dtype)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * cache.gpu_memory_utilization)
    else:
        budget = cache.cpu_kv_cache_bytes
    slots = sched.max_num_seqs
    window_per_seq = -(-cfg.sliding_window // bs) + 1
    num_window = cache.num_window_blocks or (
        slots * window_per_seq + -(-sched.max_num_batched_tokens // bs) + slots
    )
    remaining = budget - slots * slot_bytes - num_window * window_bytes
    if cache.num_blocks is not None:
        num_blocks = cache.num_blocks
    else:
        if remaining <= 0:
            raise ValueError(
                f"a KV budget of {budget / 2**20:.0f} MiB cannot hold {slots} sequences' windows and state; "
                "lower max_num_seqs or raise the budget"
            )
        num_blocks = int(remaining // max(comp_bytes, 1))
        num_blocks = min(num_blocks, slots * -(-sched.max_model_len // bs))
    if num_blocks < 1 or num_window < window_per_seq:
        raise ValueError(f"memory plan leaves {num_blocks} compressed and {num_window} window blocks; raise the budget")
    return PoolSizes(num_blocks, num_window, slots, budget)

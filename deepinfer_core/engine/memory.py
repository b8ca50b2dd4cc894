"""Size the paged pools and state slots from a memory budget."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from deepinfer_core.config import CacheConfig, ModelConfig, SchedulerConfig
from deepinfer_core.model.cache import ModelCache, bytes_per_block, bytes_per_state_slot
from deepinfer_core.model.kv_cache_spec import KVCacheSpec
from deepinfer_core.model.metadata import SeqSpan, build_forward_batch
from deepinfer_core.models.interface import Model
from deepinfer_core.platform import Platform


@dataclass
class PoolSizes:
    num_blocks: int
    num_window_blocks: int
    num_state_slots: int
    budget_bytes: int


def profile_activation_bytes(model: Model, sched: SchedulerConfig, block_size: int,
                             platform: Platform, spec: KVCacheSpec | None = None, query_len: int = 1) -> int:
    """Peak device memory of the forwards a step can run, beyond weights and cache (what the pools must
    leave free), at the longest context: a full token budget as the last chunk of a ``max_model_len``
    prompt, plus one decode step of as many sequences as a step holds, each ``max_model_len`` long with
    ``query_len`` new tokens (1 + drafts when speculating: the largest decode graph keeps that much in its
    pool), plus the sampler's per-sequence vocab-sized buffers, the graphs' shared logits buffers and, when
    speculating, the undo log buffers of the verification graphs.

    The profiling cache holds one chunk's blocks, which every block table reuses: the shapes and the work
    of a long context without its KV memory."""
    device, tokens = model.device, sched.max_num_batched_tokens
    longest = max(sched.max_model_len, tokens)
    blocks = -(-tokens // block_size) + 1
    cache = ModelCache(model.cfg, blocks, blocks, 1, block_size, model.dtype, device, spec=spec)
    table = [i % blocks for i in range(-(-longest // block_size))]
    specs, window = model.compressor_specs(), model.cfg.sliding_window
    prefill = build_forward_batch([0] * tokens, [SeqSpan(longest - tokens, tokens, table, table, 0)], specs,
                                  block_size, window, None, device)
    seqs = min(sched.max_num_seqs, max(1, tokens // query_len))
    decode = build_forward_batch([0] * seqs * query_len,
                                 [SeqSpan(longest - query_len, query_len, table, table, 0)] * seqs, specs,
                                 block_size, window, list(range(seqs * query_len)), device)
    peak = platform.peak_memory_of(partial(model.forward, prefill, cache))
    peak += platform.peak_memory_of(partial(model.forward, decode, cache))
    undo = 0
    if query_len > 1:  # the verification graphs' undo log buffers, sized for the largest batch
        from deepinfer_core.spec_decode.rollback import CacheUndo

        saved = CacheUndo.every_token(cache, decode, model.cfg.num_hidden_layers).saved
        undo = sum(s.values.nbytes for s in saved) * -(-sched.max_num_seqs // seqs)
    del cache, prefill, decode
    sampler = 8 * sched.max_num_seqs * model.cfg.vocab_size * 4
    graph_outputs = sched.max_num_seqs * (1 + (query_len if query_len > 1 else 0)) * model.cfg.vocab_size * 4
    return peak + sampler + graph_outputs + undo


def plan_pools(cfg: ModelConfig, cache: CacheConfig, sched: SchedulerConfig, dtype: torch.dtype,
               budget: int, spec: KVCacheSpec | None = None) -> PoolSizes:
    """Window blocks: enough for every running sequence's window plus one step's chunk; the rest of the
    budget becomes compressed blocks, which is what grows with sequence length.

    ``budget`` comes from the platform: on a GPU ``gpu_memory_utilization`` of the whole device, less
    what is allocated now (the weights) and the activation peak (:func:`profile_activation_bytes`)."""
    bs = cache.block_size
    comp_bytes, window_bytes = bytes_per_block(cfg, bs, dtype, spec)
    slot_bytes = bytes_per_state_slot(cfg, dtype, spec)
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

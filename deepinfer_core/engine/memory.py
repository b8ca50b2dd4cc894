"""The memory estimate, one for the engine's memory plan and for ``deepinfer plan``: weight bytes (as
stored, as loaded, dequantised; for any number of routed-expert slots), KV bytes per block and per state
slot, what the pools of a plan allocate, the activation peak of a step (profiled on the device), and the
pool sizes a budget holds (:func:`plan_pools`, which the worker sizes its cache with)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch

from deepinfer_core.config import CacheConfig, ModelConfig, SchedulerConfig
from deepinfer_core.model.cache import (
    ModelCache,
    bytes_per_block,
    bytes_per_state_slot,
    layer_bytes_per_block,
)
from deepinfer_core.model.cache_layout import cache_layout
from deepinfer_core.model.kv_cache_spec import KVCacheSpec
from deepinfer_core.model.loader import (
    expected_file_names,
    fp8_weight_names,
    manifest_of,
    quant_config,
)
from deepinfer_core.model.manifest import EXPERT_FILE_NAME, stored_bytes
from deepinfer_core.model.metadata import SeqSpan, build_forward_batch
from deepinfer_core.models.interface import Model
from deepinfer_core.platform import Platform


@dataclass
class PoolSizes:
    num_blocks: int
    num_window_blocks: int
    num_state_slots: int
    budget_bytes: int


def weight_bytes(cfg: ModelConfig, dtype: torch.dtype, numerics: str = "transformers", with_mtp: bool = True,
                 num_experts: int | None = None, drafter_experts: int | None = None) -> dict[str, int]:
    """Weight bytes of ``cfg``, the drafter's included with ``with_mtp``: ``stored`` as the checkpoint's files
    hold them (every expert); for a model holding ``num_experts`` routed-expert slots per MoE layer (all
    its experts by default; ``drafter_experts`` slots of a drafter's own experts), ``loaded`` as FP8 mode
    keeps them (E4M3 and packed FP4 where the checkpoint declares them) and ``dequantised`` every weight in
    ``dtype`` (float32 where the engine keeps float32, what a float run holds) but the lookup tables, which
    every run keeps FP8. Each with its routed-expert part (``*_experts``); ``loaded_tables``: those tables
    (DeepSeek-V4.1's Engram), part of both."""
    keys = ("stored", "stored_experts", "loaded", "loaded_experts", "dequantised", "dequantised_experts",
            "loaded_tables")
    out = dict.fromkeys(keys, 0)
    manifest = manifest_of(cfg)
    for name, shape in expected_file_names(cfg, with_mtp=with_mtp).items():
        b = stored_bytes(manifest.stored_format(name), shape, manifest.block_of(name))
        out["stored"] += b
        out["stored_experts"] += b if EXPERT_FILE_NAME.match(name) else 0
    fp4 = quant_config(cfg).expert_dtype == "fp4"
    fp8 = fp8_weight_names(cfg, numerics) if quant_config(cfg).declared else set()
    for name, shape in manifest.loaded_shapes(with_mtp, num_experts, drafter_experts).items():
        n, expert = math.prod(shape), manifest.rows[name].experts
        plain = n * manifest.parameter_dtype(name, dtype).itemsize
        if expert and fp4:
            kept = n // 2 + n // 32  # packed e2m1 + one e8m0 scale per 32
        elif manifest.rows[name].kept:  # E4M3 + an E8M0 scale per tile
            rows, cols = manifest.rows[name].block
            kept = n + math.prod(shape[:-2]) * math.ceil(shape[-2] / rows) * math.ceil(shape[-1] / cols)
        elif name in fp8:  # E4M3 + a float32 scale per 128x128 tile
            kept = n + math.prod(shape[:-2]) * math.ceil(shape[-2] / 128) * math.ceil(shape[-1] / 128) * 4
        else:
            kept = plain
        out["dequantised"] += kept if manifest.rows[name].kept else plain
        out["dequantised_experts"] += plain if expert else 0
        out["loaded"] += kept
        out["loaded_experts"] += kept if expert else 0
        out["loaded_tables"] += kept if manifest.rows[name].kept else 0
    return out


@dataclass(frozen=True)
class KVBytes:
    """What the cache of a model costs in one KV layout: per block of ``block_size`` source tokens, across
    all compressed pools (entries, indexer keys, boundary records; kept for the whole sequence) and all
    window pools (kept for the sliding window), and per state slot (one sequence's compressor state)."""

    block_size: int
    compressed_per_block: int
    window_per_block: int
    state_slot: int
    window_blocks_per_seq: int  # the blocks one sequence's window spans, the one it writes included

    @property
    def compressed_per_token(self) -> float:
        return self.compressed_per_block / self.block_size

    @property
    def window_per_token(self) -> float:
        return self.window_per_block / self.block_size

    @property
    def window_per_seq(self) -> int:
        return self.window_per_block * self.window_blocks_per_seq

    def allocated(self, sizes: PoolSizes) -> int:
        """The bytes the cache allocates for ``sizes``: one row more of each pool than the plan hands out
        (see ModelCache)."""
        return ((sizes.num_blocks + 1) * self.compressed_per_block + (sizes.num_window_blocks + 1)
                * self.window_per_block + (sizes.num_state_slots + 1) * self.state_slot)


def kv_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype, spec: KVCacheSpec | None = None) -> KVBytes:
    """The cache's cost in the layout of ``spec`` (default: ``dtype`` entries)."""
    comp, window = bytes_per_block(cfg, block_size, dtype, spec)
    return KVBytes(block_size, comp, window, bytes_per_state_slot(cfg, dtype, spec),
                   -(-cfg.sliding_window // block_size) + 1)


def layer_kv_bytes(cfg: ModelConfig, spec: KVCacheSpec) -> list[tuple[int, int]]:
    """Per layer (the drafter's after the target's): the (compressed-pool, window-pool) bytes one block
    costs in the pools it owns."""
    return [layer_bytes_per_block(layer, spec) for layer in cache_layout(cfg).layers]


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
    ngram = getattr(model, "ngram_size", 0)  # an n-gram model's batches carry each span's history


    def history(context_len: int) -> list[int] | None:  # the tokens before a span at context_len, at most n-1
        return [0] * min(ngram - 1, context_len) if ngram else None

    prefill = build_forward_batch([0] * tokens, [SeqSpan(longest - tokens, tokens, table, table, 0,
                                                         history=history(longest - tokens))],
                                  specs, block_size, window, None, device, ngram=ngram)
    seqs = min(sched.max_num_seqs, max(1, tokens // query_len))
    decode_span = SeqSpan(longest - query_len, query_len, table, table, 0, history=history(longest - query_len))
    decode = build_forward_batch([0] * seqs * query_len, [decode_span] * seqs,
                                 specs, block_size, window, list(range(seqs * query_len)), device, ngram=ngram)
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
    kv = kv_bytes(cfg, bs, dtype, spec)
    comp_bytes, window_bytes, slot_bytes = kv.compressed_per_block, kv.window_per_block, kv.state_slot
    slots = sched.max_num_seqs
    window_per_seq = kv.window_blocks_per_seq
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

"""EngineArgs: every option of an engine, the one object ``LLM``, ``AsyncLLM``, ``deepinfer serve`` and
``deepinfer plan`` build an engine (:func:`~deepinfer_core.engine.factory.make_engine`) or a memory plan
from; and the parallel layout those options ask for."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer_core.config import EPLBConfig, ParallelConfig, StructuredOutputsConfig
from deepinfer_core.parallel.eplb_state import eplb_config_of


@dataclass
class EngineArgs:
    model: str | Path | None = None
    backend: str = "cpu_ref"
    dtype: str | torch.dtype | None = None
    device: str | None = None
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings, capped by the KV pools
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    max_replay_tokens: int = 512
    gpu_memory_utilization: float = 0.9
    kv_cache_bytes: int = 2 << 30
    block_size: int = 128
    num_blocks: int | None = None
    num_window_blocks: int | None = None
    seed: int = 0
    allow_reference_fallback: bool = False
    batch_invariant: bool = False  # also on with DEEPINFER_BATCH_INVARIANT=1
    enforce_eager: bool = False  # never capture graphs of the forward (CUDA graphs are used on cuda otherwise)
    max_cudagraph_capture_size: int | None = None  # largest decode batch run from a graph (max_num_seqs)
    async_scheduling: bool = False  # schedule step N+1 while the device runs step N (zero-overhead)
    quantization: str | None = None  # "fp8": linear and expert weights in E4M3 with 128x128 block scales
    #: "deepseek" | "transformers"; None: "deepseek" where config.json has quantization_config
    numerics: str | None = None
    data_parallel_size: int = 1  # attention data parallel: ranks (processes), each its own scheduler and KV
    enable_expert_parallel: bool = False  # shard the routed experts over the data-parallel ranks
    data_parallel_rank: int | None = None  # set in a rank's process: its engine core (no front-end)
    distributed_timeout_s: float = 600.0  # most a rank may take to answer, or a collective may wait
    # speculative decoding (vLLM's shape): {"method": "mtp", "num_speculative_tokens": k} and optionally
    # "schedule": "fixed" (verify every draft) or "confidence" (DSpark's admission of (seq, position) pairs)
    speculative_config: dict | None = None
    enable_eplb: bool = False  # expert-parallel load balancing: redundant experts, rearranged by measured load
    eplb_config: dict | EPLBConfig | None = None  # window_size, step_interval, num_redundant_experts, ...
    distributed_executor_backend: str | None = None  # "external_launcher": this process is a rank torchrun started
    cpu_threads: int | None = None  # torch intra-op threads for CPU ops; None: 1 for small models, else torch's
    #: where a model's Engram tables live: "device" | "host" (pinned, read in place) | "file" (the checkpoint's
    #: mapping, never copied); None: the memory plan's choice, logged
    engram_placement: str | None = None
    engram_shard: bool = False  # split the Engram tables' rows over the ranks (a lookup collective a layer)
    # vLLM's: {"disable_any_whitespace": True} makes every JSON-constrained output compact (default: free
    # whitespace between JSON tokens, as in vLLM); {"backend": "auto" | "xgrammar"}
    structured_outputs_config: dict | StructuredOutputsConfig | None = None
    # SWA bounded replay (DeepSeek-V4.1): a prefill runs the layers after the last KV source only on the
    # prompt's tail (window + the longest draft backtracking). "mask" | "compact" (the same semantics: mask
    # runs every token and hides what the cut drops, compact computes only the tail); None: compact where
    # the model can be cut, else off; False: the full prefill (as the reference runs it)
    bounded_replay: bool | str | None = None


def parallel_config_of(args: EngineArgs) -> ParallelConfig:
    """Expert parallel spans the data-parallel ranks (vLLM's rule, without tensor parallel)."""
    dp = args.data_parallel_size
    if not isinstance(dp, int) or dp < 1:
        raise ValueError(f"data_parallel_size must be an integer >= 1, got {dp!r}")
    ep = dp if args.enable_expert_parallel else 1
    backend = args.distributed_executor_backend
    if backend not in (None, "mp", "external_launcher"):
        raise ValueError(f"distributed_executor_backend must be 'mp' or 'external_launcher', got {backend!r}")
    return ParallelConfig(data_parallel_size=dp, expert_parallel_size=ep, enable_eplb=bool(args.enable_eplb),
                          eplb_config=eplb_config_of(args.eplb_config, bool(args.enable_eplb), ep),
                          distributed_executor_backend=backend)

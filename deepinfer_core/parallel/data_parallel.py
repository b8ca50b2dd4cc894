"""Attention data parallel: the front-end of an engine with ``data_parallel_size`` ranks.

Each rank is a process of its own (:mod:`deepinfer_core.parallel.dp_engine_core`) that runs a whole
engine core: an :class:`~deepinfer_core.engine.llm_engine.LLMEngine` with its scheduler, block manager,
KV pools and state slots, and the model (with expert parallel, only its own routed experts). The
front-end, in the caller's process, holds no model: it tokenizes, assigns each request to the rank that
holds its prompt's prefix in its cache (when that rank is not overloaded) or else to the rank with the
least outstanding tokens (:mod:`.prefix_router`), and steps the ranks in lock-step (every step goes to every rank with
expert parallel; a rank with nothing scheduled runs a placeholder step through the MoE collectives).
``make_engine(EngineArgs(data_parallel_size=N))`` builds it, so ``LLM``, ``AsyncLLM`` and the server use
it unchanged.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from deepinfer_core.config import ModelConfig, structured_outputs_config_of
from deepinfer_core.default_model import default_model_path
from deepinfer_core.engine.args import EngineArgs, parallel_config_of
from deepinfer_core.engine.processor import encode_prompt, prompt_ids
from deepinfer_core.outputs import RequestOutput
from deepinfer_core.parallel.dp_engine_core import RankFailure, RankProcesses
from deepinfer_core.parallel.prefix_router import PrefixAffinityRouter
from deepinfer_core.plugins import load_backend
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.spec_decode.metrics import SpecDecodeStats
from deepinfer_core.tokenizer import get_tokenizer
from deepinfer_core.worker.executor import place_ranks


class DataParallelEngine:
    """LLMEngine's public API (``add_request``, ``step``, ``abort_request``, ``has_unfinished_requests``,
    prefix-cache calls) over the ranks' engine cores; ``step`` returns outputs in the order the requests
    were added."""

    def __init__(self, args: EngineArgs):
        self.args = args
        self.parallel_config = pc = parallel_config_of(args)
        structured_outputs_config_of(args.structured_outputs_config)  # checked here, before ranks start
        path = Path(args.model) if args.model is not None else default_model_path()
        self.model_config = cfg = ModelConfig.from_pretrained(path)
        ep = pc.expert_parallel_size
        physical = pc.num_physical_experts(cfg.n_routed_experts)
        if ep > 1 and physical % ep:
            raise ValueError(f"{physical} routed experts cannot be split evenly over {ep} "
                             "expert-parallel ranks")
        if not args.distributed_timeout_s > 0:
            raise ValueError(f"distributed_timeout_s must be > 0, got {args.distributed_timeout_s!r}")
        backend = load_backend(args.backend)
        self.topology, self.plan = place_ranks(backend, pc)
        self.tokenizer = get_tokenizer(path)
        self.num_ranks = pc.data_parallel_size
        device_type = torch.device(args.device).type if args.device else backend.info.device_type
        self.ranks = RankProcesses(args, self.num_ranks, self.plan.device_of_rank, args.distributed_timeout_s,
                                   device_type)
        self._finalizer = weakref.finalize(self, self.ranks.shutdown)
        info = self.ranks.info
        self.rank_info = [info[r] for r in range(self.num_ranks)]
        self.dtype: torch.dtype = info[0]["dtype"]
        self.device = torch.device(info[0]["device"])
        self.scheduler_config = info[0]["scheduler_config"]
        self.pool_sizes = info[0]["pool_sizes"]
        self._counter = itertools.count()
        self._added = itertools.count()
        self._owner: dict[str, int] = {}  # unfinished request -> its rank
        self._order: dict[str, int] = {}  # unfinished request -> when it was added
        self._plan: dict[str, tuple[int, int, int]] = {}  # request -> (n, prompt tokens, most new tokens)
        self._outstanding: dict[str, int] = {}  # request -> tokens it still has to compute
        self.load = [0] * self.num_ranks  # outstanding tokens per rank
        self._busy = [False] * self.num_ranks
        self._stats: list[dict[str, float] | None] = [None] * self.num_ranks  # prefix cache, per rank
        self._spec: list[SpecDecodeStats | None] = [None] * self.num_ranks  # speculative decoding, per rank
        # without prefix caching there is no affinity to keep: a block size nobody reaches
        block = args.block_size if args.enable_prefix_caching else 1 << 62
        self.router = PrefixAffinityRouter(self.num_ranks, block, self.scheduler_config.max_num_batched_tokens)

    # --- requests --------------------------------------------------------------------------------

    def encode(self, prompt: str) -> list[int]:
        return encode_prompt(self.tokenizer, prompt)

    def add_request(self, request_id: str | None, prompt: str | dict | list[int],
                    params: SamplingParams | None = None) -> str:
        """Queue a request on the rank holding its prefix, else the least loaded one; raises ValueError (and
        queues nothing) when invalid."""
        params = params or SamplingParams()
        request_id = str(next(self._counter)) if request_id is None else str(request_id)
        if request_id in self._owner:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = prompt_ids(prompt, self.encode)
        rank = self.router.choose(ids, self.load)
        self.ranks.call(rank, "add", (request_id, {"prompt": text, "prompt_token_ids": ids}, params))
        room = max(self.scheduler_config.max_model_len - len(ids), 0)
        most = room if params.max_tokens is None else min(params.max_tokens, room)
        self._owner[request_id], self._order[request_id] = rank, next(self._added)
        self._plan[request_id] = (params.n, len(ids), most)
        self._set_outstanding(request_id, params.n * (len(ids) + most))
        self._busy[rank] = True
        return request_id

    def _set_outstanding(self, request_id: str, tokens: int) -> None:
        rank = self._owner[request_id]
        self.load[rank] += tokens - self._outstanding.get(request_id, 0)
        self._outstanding[request_id] = tokens

    def _forget(self, request_id: str) -> None:
        if request_id in self._owner:
            self._set_outstanding(request_id, 0)
        for book in (self._owner, self._order, self._plan, self._outstanding):
            book.pop(request_id, None)

    def abort_request(self, request_id: str) -> None:
        """Abort a request (nothing to do once the engine has failed: every rank is gone)."""
        rank = self._owner.get(str(request_id))
        if rank is None or self.ranks.failure is not None:
            return
        self._busy[rank] = self.ranks.call(rank, "abort", str(request_id))
        self._forget(str(request_id))

    def has_unfinished_requests(self) -> bool:
        """Raises the failure once the engine has failed (its requests can never finish)."""
        if self.ranks.failure is not None:
            raise RankFailure(f"the data-parallel engine has failed: {self.ranks.failure}")
        return any(self._busy)

    # --- the step --------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step of every rank (lock-step); the outputs of all ranks, in the requests' order."""
        if not any(self._busy):
            return []
        if self.parallel_config.expert_parallel_size > 1:
            ranks = range(self.num_ranks)  # idle ranks take part in the MoE collectives
        else:
            ranks = [r for r in range(self.num_ranks) if self._busy[r]]
        answers = self.ranks.call_all(ranks, "step")
        outputs: list[RequestOutput] = []
        for rank, (outs, busy, stats, spec) in answers.items():
            self._busy[rank], self._stats[rank], self._spec[rank] = busy, stats, spec
            outputs.extend(outs)
        outputs.sort(key=lambda out: self._order.get(out.request_id, -1))
        for out in outputs:
            if out.request_id not in self._owner:
                continue
            if out.finished:
                self._forget(out.request_id)
            else:
                _, _, most = self._plan[out.request_id]
                self._set_outstanding(out.request_id, sum(max(most - len(c.token_ids), 0) for c in out.outputs))
        return outputs

    # --- prefix cache, lifetime ------------------------------------------------------------------

    def reset_prefix_cache(self) -> None:
        self.ranks.call_all(range(self.num_ranks), "reset_prefix_cache")
        self._stats = [None] * self.num_ranks

    def prefix_cache_stats(self) -> dict[str, float]:
        """Summed over the ranks (as of each rank's last step: they come with its answer)."""
        missing = [r for r in range(self.num_ranks) if self._stats[r] is None]
        if missing:
            for rank, rank_stats in self.ranks.call_all(missing, "prefix_cache_stats").items():
                self._stats[rank] = rank_stats
        stats: dict[str, float] = {}
        for rank_stats in self._stats:
            for key, value in rank_stats.items():
                if key != "hit_rate":
                    stats[key] = stats.get(key, 0) + value
        stats["hit_rate"] = stats["hit_tokens"] / stats["query_tokens"] if stats.get("query_tokens") else 0.0
        return stats

    def spec_decode_stats(self) -> dict | None:
        """Speculative decoding counters summed over the ranks (as of each rank's last step); None without
        speculation."""
        if self.args.speculative_config is None:
            return None
        total = SpecDecodeStats()
        for stats in self._spec:
            if stats is not None:
                total.add(stats)
        return total.as_dict()

    def expert_load(self) -> torch.Tensor | None:
        """``[layer, expert]``: the (token, expert) pairs routed to each logical expert since the last call,
        summed over the ranks (counted on each rank's device); None without expert parallel."""
        per_rank = self.ranks.call_all(range(self.num_ranks), "expert_load")
        counts = [per_rank[r] for r in range(self.num_ranks) if per_rank[r] is not None]
        return torch.stack(counts).sum(0) if counts else None

    def rearrange_experts(self, load: torch.Tensor | None = None) -> dict[str, Any]:
        """EPLB now, between steps, on every rank (``load[layer, expert]``: the target's, or a dict of expert
        group name -> its load; a group given none: its measured window); the statistics of the
        rearrangement. Raises without EPLB."""
        if not self.parallel_config.enable_eplb:
            raise RuntimeError("EPLB is off (enable_eplb=True turns it on)")
        return self.ranks.call_all(range(self.num_ranks), "rearrange", load)[0]

    def eplb_stats(self) -> list[dict[str, Any]]:
        """Per rank: EPLB's steps, slot layout and rearrangements so far (empty dicts without EPLB)."""
        per_rank = self.ranks.call_all(range(self.num_ranks), "eplb_stats")
        return [per_rank[r] for r in range(self.num_ranks)]

    def rank_memory(self) -> list[dict[str, int]]:
        """Per rank: the bytes its weights (routed experts apart) and its cache tensors take."""
        per_rank = self.ranks.call_all(range(self.num_ranks), "memory")
        return [per_rank[r] for r in range(self.num_ranks)]

    def rank_counters(self) -> list[dict[str, int]]:
        """Per rank: steps taken, of which placeholder steps (nothing scheduled there), and forwards run."""
        per_rank = self.ranks.call_all(range(self.num_ranks), "counters")
        return [per_rank[r] for r in range(self.num_ranks)]

    def collective_rpc(self, method: Callable[..., Any], args: tuple = ()) -> list[Any]:
        """``method(engine_core, *args)`` on every rank, in its process (``method``: a module-level function,
        sent by reference); the results in rank order."""
        per_rank = self.ranks.call_all(range(self.num_ranks), "collective_rpc", (method, tuple(args)))
        return [per_rank[r] for r in range(self.num_ranks)]

    @property
    def rank_pids(self) -> list[int]:
        return self.ranks.pids

    def shutdown(self) -> None:
        """End the ranks' processes (also done when the engine is collected or the program exits)."""
        self._finalizer()

"""Ranks started by ``torchrun`` (``distributed_executor_backend="external_launcher"``, vLLM's name):
every process is one rank of the data-parallel (and expert-parallel) engine, with its own engine core,
and is given its own requests (the script splits them); nobody spawns anything.

The process group comes from torchrun's environment (env:// rendezvous: ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``). Lock-step: each :meth:`ExternalLauncherEngine.step`
first all-reduces "has unfinished requests" over the ranks; when any rank has work, every rank runs a
step (a placeholder step through the MoE collectives where it has nothing), else none does. A rank whose
own requests are done keeps meeting the others' steps in :meth:`~ExternalLauncherEngine.shutdown` (call
it on every rank when the script is done), so a script may give the ranks unequal work.

Faults: a forward that fails under expert parallel raises on its rank (the collectives can no longer line
up); its peers' collectives then fail after ``distributed_timeout_s``; torchrun ends the rest.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from deepinfer_core.engine.args import EngineArgs, parallel_config_of
from deepinfer_core.engine.llm_engine import LLMEngine
from deepinfer_core.outputs import RequestOutput
from deepinfer_core.parallel.dp_engine_core import RankCore, RankExecutor
from deepinfer_core.parallel.process_group import destroy_process_group

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class ExternalLauncherEngine:
    """LLMEngine's API for one torchrun rank (unknown attributes go to the rank's engine core)."""

    def __init__(self, args: EngineArgs):
        missing = [name for name in TORCHRUN_ENV if name not in os.environ]
        if missing:
            raise RuntimeError(f"distributed_executor_backend='external_launcher' runs under torchrun, but "
                               f"{', '.join(missing)} is not set")
        world = parallel_config_of(args).data_parallel_size
        if int(os.environ["WORLD_SIZE"]) != world:
            raise ValueError(f"torchrun started {os.environ['WORLD_SIZE']} ranks, data_parallel_size is {world}")
        self.rank, self.world_size = int(os.environ["RANK"]), world
        self.core = LLMEngine(dataclasses.replace(args, data_parallel_rank=self.rank), executor_class=RankExecutor)
        self.rank_core = RankCore(self.core)
        self.closed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["core"], name)

    def _any_rank_busy(self) -> bool:
        flag = torch.tensor([1 if self.core.has_unfinished_requests() else 0], device=self.core.device)
        return bool(self.core.executor.communicator.all_reduce(flag).item())

    def step(self) -> list[RequestOutput]:
        """One lock-step step of every rank (a collective: every rank calls it, as ``LLM.generate`` does
        while it has requests and :meth:`shutdown` does after); this rank's outputs."""
        if not self._any_rank_busy():
            return []
        return self.rank_core.step(None)[0]

    def has_unfinished_requests(self) -> bool:
        """This rank's requests only (no collective)."""
        return self.core.has_unfinished_requests()

    def rearrange_experts(self, load: torch.Tensor | None = None) -> dict[str, Any]:
        """EPLB now (a collective: every rank calls it between the same steps, with the same ``load``)."""
        return self.rank_core.rearrange(load)

    def eplb_stats(self) -> dict[str, Any]:
        return self.rank_core.eplb_stats(None)

    def spec_decode_stats(self) -> dict | None:
        """This rank's speculative decoding counters (None without speculation)."""
        return self.core.spec_decode_stats()

    def rank_counters(self) -> dict[str, int]:
        return self.rank_core.counters(None)

    def shutdown(self) -> None:
        """Step along with the other ranks until none has work, then leave the process group."""
        if self.closed:
            return
        self.closed = True
        while self._any_rank_busy():
            self.rank_core.step(None)
        destroy_process_group()

"""Executor: drives the workers of an engine and collects their ModelRunnerOutput.

The engine talks to an executor only through :class:`~deepinfer_core.engine.scheduler_output.SchedulerOutput`
and :class:`~deepinfer_core.worker.outputs.ModelRunnerOutput`, both plain picklable data, so the same
engine drives one in-process worker (:class:`UniProcExecutor`) or worker processes.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from deepinfer_core.comm import Communicator
from deepinfer_core.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from deepinfer_core.engine.memory import PoolSizes
from deepinfer_core.engine.scheduler_output import SchedulerOutput
from deepinfer_core.plugins import LoadedBackend
from deepinfer_core.spec_decode.confidence import StepProfile
from deepinfer_core.topology import ClusterTopology, ParallelPlan, plan_single_host, single_host_cpu_topology
from deepinfer_core.worker.outputs import AsyncModelRunnerOutput
from deepinfer_core.worker.worker import Worker


def place_ranks(backend: LoadedBackend, parallel_config: ParallelConfig) -> tuple[ClusterTopology, ParallelPlan]:
    """The backend's view of the machine and its placement of ranks on devices (core defaults otherwise)."""
    hook = backend.hook
    topology = hook.deepinfer_discover_topology() or single_host_cpu_topology()
    plan = hook.deepinfer_plan_parallel(topology=topology, parallel_config=parallel_config) or plan_single_host(
        topology, parallel_config.data_parallel_size, parallel_config.expert_parallel_size)
    return topology, plan


class Executor(ABC):
    """Interface: ``execute_model`` launches a step on every worker; the result's ``get_output`` waits."""

    pool_sizes: PoolSizes

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> AsyncModelRunnerOutput:
        """Launch the step described by ``scheduler_output``."""

    def shutdown(self) -> None:  # noqa: B027 (an optional hook: a single process has nothing to release)
        pass


class UniProcExecutor(Executor):
    """One worker in this process: rank 0 of a world of one, or the rank ``args.data_parallel_rank`` of a
    data-parallel engine (whose front-end runs an engine core with this executor in every rank's process)."""

    def __init__(self, args: Any, backend: LoadedBackend, model_config: ModelConfig, path: Path,
                 scheduler_config: SchedulerConfig, cache_config: CacheConfig, parallel_config: ParallelConfig,
                 batch_invariant: bool = False):
        self.parallel_config = parallel_config
        self.topology, self.plan = place_ranks(backend, parallel_config)
        rank = getattr(args, "data_parallel_rank", None) or 0
        local_rank = self.plan.device_of_rank.get(rank, 0)
        if parallel_config.distributed_executor_backend == "external_launcher":
            local_rank = int(os.environ.get("LOCAL_RANK", local_rank))  # torchrun placed this rank
        self.driver_worker = Worker(args, backend, model_config, path, scheduler_config, cache_config,
                                    parallel_config, rank=rank, local_rank=local_rank,
                                    batch_invariant=batch_invariant)
        worker = self.driver_worker
        worker.init_device()
        self.communicator: Communicator | None = worker.communicator
        worker.load_model()
        self.pool_sizes = worker.initialize_cache()

    def execute_model(self, scheduler_output: SchedulerOutput) -> AsyncModelRunnerOutput:
        return self.driver_worker.execute_model(scheduler_output)

    @property
    def step_profile(self) -> StepProfile | None:
        """The worker's timing of its decode graphs (speculative decoding's confidence scheduling)."""
        return getattr(self.driver_worker.model_runner, "step_profile", None)

    def execute_dummy(self) -> None:
        """A placeholder step (nothing scheduled here) through the expert-parallel collectives."""
        self.driver_worker.execute_dummy()

"""make_engine: the engine that :class:`~deepinfer_core.engine.args.EngineArgs` ask for, each with
LLMEngine's public API (``add_request``, ``step``, ``abort_request``, ``has_unfinished_requests``, ...), so
``LLM``, ``AsyncLLM`` and ``deepinfer serve`` drive any of them the same way."""

from __future__ import annotations

from deepinfer_core.engine.args import EngineArgs, parallel_config_of
from deepinfer_core.engine.llm_engine import LLMEngine
from deepinfer_core.parallel.data_parallel import DataParallelEngine
from deepinfer_core.parallel.external_launcher import ExternalLauncherEngine

Engine = LLMEngine | DataParallelEngine | ExternalLauncherEngine


def make_engine(args: EngineArgs) -> Engine:
    """One process's :class:`LLMEngine`; with ``data_parallel_size > 1`` the data-parallel front-end, which
    spawns a process per rank and runs an LLMEngine in each (:class:`DataParallelEngine`), or, with
    ``distributed_executor_backend="external_launcher"``, this torchrun rank's engine
    (:class:`ExternalLauncherEngine`). A rank's own process (``data_parallel_rank`` set) gets an LLMEngine."""
    if args.data_parallel_rank is None and parallel_config_of(args).data_parallel_size > 1:
        if args.distributed_executor_backend == "external_launcher":
            return ExternalLauncherEngine(args)
        return DataParallelEngine(args)
    return LLMEngine(args)

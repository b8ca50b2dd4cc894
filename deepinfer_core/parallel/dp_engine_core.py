"""The engine cores of a data-parallel engine, one per rank: every rank runs an :class:`LLMEngine` over a
:class:`RankExecutor` (rank ``r`` of the torch.distributed group) and serves the front-end's commands
through a :class:`RankCore`, in a process of its own that :class:`RankProcesses` spawns and drives over a
pipe for the front-end (:class:`~deepinfer_core.parallel.data_parallel.DataParallelEngine`); under
torchrun each rank's process is one already (:mod:`deepinfer_core.parallel.external_launcher`).

The front-end sends ``(command, payload)``; a rank answers ``("ok", result)``, ``("invalid", message)``
(a request it refused: ValueError) or ``("error", traceback)``. Commands: ``add``, ``abort``, ``step``,
``reset_prefix_cache``, ``prefix_cache_stats``, ``counters``, ``expert_load``, ``rearrange``, ``eplb_stats``,
``memory``, ``collective_rpc``, ``stop``. A rank whose step scheduled nothing runs a
placeholder step through the MoE collectives (:meth:`RankExecutor.execute_dummy`; a replay of the
step's agreed graph size where the ranks run graphs), so that the ranks always meet in the same
collectives.

CPU ranks start from a fork server (``forkserver``, Python 3.14's default on Linux) that has imported torch
and the engine once: a rank forked from it starts in a fraction of the seconds a fresh interpreter takes
(the server never runs a CPU op, so no OpenMP pool is forked), with the front-end's environment at the
time it starts. Accelerator ranks, and every rank under ``DEEPINFER_WORKER_MULTIPROC_METHOD=spawn``
(vLLM's ``VLLM_WORKER_MULTIPROC_METHOD``), start as fresh interpreters.

Faults: a rank that dies is seen at once (its process sentinel); one that does not answer within the
timeout, or answers with an error, fails the engine too. :class:`RankFailure` names the rank(s) and every
process is ended (``shutdown``), none is left behind. Collectives on the group time out after
``distributed_timeout_s``; the front-end waits a few seconds longer for answers, so that a rank blocked
by a hung peer answers with its timeout and the peer is the one named as silent.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.multiprocessing as mp

from deepinfer_core.engine.llm_engine import LLMEngine
from deepinfer_core.engine.scheduler_output import SchedulerOutput
from deepinfer_core.model.mapped import residence
from deepinfer_core.parallel.memory_plan import measured_memory
from deepinfer_core.parallel.process_group import STARTUP_TIMEOUT_S, destroy_process_group
from deepinfer_core.worker.executor import UniProcExecutor
from deepinfer_core.worker.outputs import AsyncModelRunnerOutput

logger = logging.getLogger(__name__)
ANSWER_GRACE_S = 5.0  # the front-end waits this much longer than a collective may


class RankFailure(RuntimeError):
    """A rank of a data-parallel engine died, hung or failed; the engine is shut down.
    ``invalid_arguments``: when every rank failed with a ValueError, rank 0's message."""

    invalid_arguments: str | None = None


class RankExecutor(UniProcExecutor):
    """A rank's executor: counts the steps it launched (a step that launched none is followed by a
    placeholder step) and remembers a forward that raised (with expert parallel that is fatal: the
    ranks' collectives would no longer line up)."""

    num_launched = 0
    failed: BaseException | None = None

    def execute_model(self, scheduler_output: SchedulerOutput) -> AsyncModelRunnerOutput:
        self.num_launched += 1
        try:
            return super().execute_model(scheduler_output)
        except BaseException as exc:
            self.failed = exc
            raise


class RankCore:
    """The commands a rank's process serves, over its engine core."""

    def __init__(self, engine: LLMEngine):
        self.engine, self.executor = engine, engine.executor
        self.expert_parallel = engine.parallel_config.expert_parallel_size > 1
        self.num_steps = self.num_placeholder_steps = 0

    def info(self) -> dict[str, Any]:
        worker = self.executor.driver_worker
        disp = worker.ep_dispatcher
        return {"pid": os.getpid(), "dtype": self.engine.dtype, "device": str(self.engine.device),
                "scheduler_config": self.engine.scheduler_config, "pool_sizes": self.engine.pool_sizes,
                "local_experts": None if disp is None else (disp.local_experts.start, disp.local_experts.stop),
                # where each Engram table's bytes are (device, a file's mapping, shared or private host memory)
                "engram_tables": {name: residence(t) for name, t in worker.model.named_parameters()
                                  if ".engram.embed." in name}}

    def add(self, payload: tuple[str, Any, Any]) -> None:
        self.engine.add_request(*payload)

    def abort(self, request_id: str) -> bool:
        self.engine.abort_request(request_id)
        return self.engine.has_unfinished_requests()

    def step(self, _: Any) -> tuple[list[Any], bool, dict[str, float], Any]:
        launched = self.executor.num_launched
        outputs = self.engine.step()
        if self.expert_parallel and self.executor.failed is not None:
            raise RuntimeError("a forward failed; with expert parallel the ranks cannot go on") \
                from self.executor.failed
        self.num_steps += 1
        if self.executor.num_launched == launched:
            self.num_placeholder_steps += 1
            self.executor.execute_dummy()
        self.executor.driver_worker.eplb_step()
        drafts = self.engine.drafts
        return (outputs, self.engine.has_unfinished_requests(), self.engine.prefix_cache_stats(),
                None if drafts is None else drafts.stats)

    def rearrange(self, load: torch.Tensor | None) -> dict[str, Any]:
        state = self.executor.driver_worker.eplb_state
        if state is None:
            raise RuntimeError("EPLB is off (enable_eplb=True turns it on)")
        return state.rearrange(load)

    def memory(self, _: Any) -> dict[str, int]:
        worker = self.executor.driver_worker
        return measured_memory(worker.model, worker.cache)

    def eplb_stats(self, _: Any) -> dict[str, Any]:
        state = self.executor.driver_worker.eplb_state
        return {} if state is None else state.summary()

    def expert_load(self, _: Any) -> torch.Tensor | None:
        load = self.executor.driver_worker.model.expert_load
        return None if load is None else load.take()

    def counters(self, _: Any) -> dict[str, int]:
        return {"steps": self.num_steps, "placeholder_steps": self.num_placeholder_steps,
                "forwards": self.executor.num_launched, "preemptions": self.engine.scheduler.num_preemptions}

    def reset_prefix_cache(self, _: Any) -> None:
        self.engine.reset_prefix_cache()

    def collective_rpc(self, payload: tuple[Callable[..., Any], tuple]) -> Any:
        """``method(engine, *args)`` on this rank's engine core (``method`` pickled by reference: a
        module-level function); every rank runs it, so it may hold collectives."""
        method, args = payload
        return method(self.engine, *args)

    def prefix_cache_stats(self, _: Any) -> dict[str, float]:
        return self.engine.prefix_cache_stats()


def _rank_main(rank: int, env: dict[str, str], args: Any, threads: int, conn: Connection) -> None:
    """A rank's process: build the engine core, then answer the front-end's commands until ``stop`` (or
    until the front-end is gone)."""
    # the front-end's environment now, not the fork server's from when it started
    os.environ.clear()
    os.environ.update(env)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front-end ends the ranks
    torch.set_num_threads(threads)
    try:
        try:
            core = RankCore(LLMEngine(args, executor_class=RankExecutor))
            conn.send(("ok", core.info()))
        except BaseException as exc:
            conn.send(_error(exc))
            return
        while True:
            try:
                command, payload = conn.recv()
            except (EOFError, OSError):
                return  # the front-end is gone
            if command == "stop":
                conn.send(("ok", None))
                return
            try:
                reply = ("ok", getattr(core, command)(payload))
            except ValueError as exc:
                reply = ("invalid", str(exc)) if command == "add" else _error(exc)
            except BaseException as exc:
                reply = _error(exc)
            conn.send(reply)
    except (BrokenPipeError, EOFError, OSError):
        pass
    finally:
        destroy_process_group()


def _error(exc: BaseException) -> tuple[str, tuple[str, str]]:
    """``("error", (summary, traceback, is a ValueError))``: the summary names the exception and its causes."""
    chain, seen = [], exc
    while seen is not None and len(chain) < 4:
        chain.append(f"{type(seen).__name__}: {seen}".strip())
        seen = seen.__cause__ or seen.__context__
    return "error", (" <- ".join(chain), traceback.format_exc(), isinstance(exc, ValueError))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exit_text(code: int | None) -> str:
    if code is None:
        return "no exit code"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


#: how rank processes start: "forkserver" (where the platform has it) or "spawn"
MULTIPROC_METHOD_ENV = "DEEPINFER_WORKER_MULTIPROC_METHOD"
#: what the fork server imports before it forks a rank
_FORKSERVER_PRELOAD = ["deepinfer_core.parallel.dp_engine_core"]


def rank_start_context(device_type: str = "cpu") -> Any:
    """The multiprocessing context that starts the ranks on ``device_type``
    (``DEEPINFER_WORKER_MULTIPROC_METHOD``; default ``forkserver`` for CPU ranks where the platform has it,
    ``spawn`` for accelerator ranks, whose start is the device's and the weights', not the imports')."""
    available = [m for m in ("forkserver", "spawn") if m in mp.get_all_start_methods()]
    method = os.environ.get(MULTIPROC_METHOD_ENV) or (available[0] if device_type == "cpu" else "spawn")
    if method not in available:
        raise ValueError(f"{MULTIPROC_METHOD_ENV}={method!r}: rank processes start by one of "
                         f"{', '.join(available)} on this platform")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_FORKSERVER_PRELOAD)  # no effect once the server runs
    return ctx


class RankProcesses:
    """Starts the ranks' processes (:func:`rank_start_context`) and exchanges commands with them."""

    def __init__(self, args: Any, world_size: int, device_of_rank: dict[int, int], timeout_s: float,
                 device_type: str = "cpu"):
        self.world_size, self.timeout_s = world_size, float(timeout_s)
        self.failure: RankFailure | None = None
        self.closed = False
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        ctx = rank_start_context(device_type)
        port = str(_free_port())
        threads = max(1, (os.cpu_count() or 1) // world_size)
        for rank in range(world_size):
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(rank),
                   "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(device_of_rank.get(rank, 0))}
            rank_args = dataclasses.replace(args, data_parallel_rank=rank)
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, args=(rank, env, rank_args, threads, child), daemon=True,
                               name=f"deepinfer-dp-rank{rank}")
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        try:
            self.info = self._collect(range(world_size), max(self.timeout_s, STARTUP_TIMEOUT_S), "starting")
        except RankFailure as exc:
            if exc.invalid_arguments:  # every rank refused the arguments: the caller's error, as one process
                raise ValueError(exc.invalid_arguments) from exc
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def call(self, rank: int, command: str, payload: Any = None) -> Any:
        return self.call_all([rank], command, payload)[rank]

    def call_all(self, ranks: Any, command: str, payload: Any = None) -> dict[int, Any]:
        """Send ``command`` to every rank in ``ranks``, then wait for all their answers; raises ValueError for
        a refused ``add``, RankFailure (after shutting every rank down) for anything else that went wrong."""
        if self.failure is not None:
            raise RankFailure(f"the data-parallel engine has failed before: {self.failure}")
        if self.closed:
            raise RuntimeError("the data-parallel engine was shut down")
        ranks = list(ranks)
        for rank in ranks:
            try:
                self.conns[rank].send((command, payload))
            except (BrokenPipeError, OSError):
                pass  # dead: the wait below reports it
        return self._collect(ranks, self.timeout_s + ANSWER_GRACE_S, command)

    def _collect(self, ranks: list[int] | range, timeout_s: float, what: str) -> dict[int, Any]:
        pending, answers = set(ranks), {}
        dead: dict[int, str] = {}
        errors: dict[int, str] = {}
        invalid = None
        deadline = time.monotonic() + timeout_s
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            waitables = {}
            for rank in pending:
                waitables[self.conns[rank]] = rank
                waitables[self.procs[rank].sentinel] = rank
            for obj in wait(list(waitables), timeout=left):
                rank = waitables[obj]
                if rank not in pending:
                    continue
                conn = self.conns[rank]
                try:
                    message = conn.recv() if obj is conn or conn.poll() else None
                except (EOFError, OSError):
                    message = None
                if message is None:
                    self.procs[rank].join(timeout=1)
                    dead[rank] = _exit_text(self.procs[rank].exitcode)
                    pending.discard(rank)
                    continue
                pending.discard(rank)
                status, value = message
                if status == "ok":
                    answers[rank] = value
                elif status == "invalid":
                    invalid = value
                else:
                    errors[rank] = value
            if dead:
                break  # a dead rank fails the engine at once
            if errors:  # the others may be waiting in a collective with it: give them a moment to say so
                deadline = min(deadline, time.monotonic() + ANSWER_GRACE_S)
        if dead or errors or pending:
            parts = [f"rank {r} died ({code})" for r, code in sorted(dead.items())]
            if not dead:
                parts += [f"rank {r} gave no answer within {timeout_s:.0f} s (hung?)" for r in sorted(pending)]
            parts += [f"rank {r} failed: {summary}" for r, (summary, _, _) in sorted(errors.items())]
            text = f"data-parallel engine ({what}): " + "; ".join(parts)
            for r, (_, trace, _) in sorted(errors.items()):
                text += f"\n\nrank {r}'s traceback:\n{trace.rstrip()}"
            self.failure = RankFailure(text)
            if errors and not dead and not pending and all(invalid for _, _, invalid in errors.values()):
                first = errors[min(errors)][0]
                self.failure.invalid_arguments = first.removeprefix("ValueError: ")
            self.shutdown(graceful=False)
            raise self.failure
        if invalid is not None:
            raise ValueError(invalid)
        return answers

    def shutdown(self, graceful: bool = True) -> None:
        """End every rank (``graceful``: asked to stop first; then SIGTERM, then SIGKILL): no process is
        left behind. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if graceful:
            for proc, conn in zip(self.procs, self.conns):
                if proc.is_alive():
                    try:
                        conn.send(("stop", None))
                    except (BrokenPipeError, OSError):
                        pass
            end = time.monotonic() + 5
            for proc in self.procs:
                proc.join(timeout=max(0.0, end - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=1)
            if proc.is_alive():
                proc.kill()  # also ends a stopped process
                proc.join(timeout=5)
        for conn in self.conns:
            conn.close()

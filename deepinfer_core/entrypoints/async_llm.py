"""AsyncLLM: an asyncio front over one LLMEngine, stepped by its own thread.

The engine thread owns the engine: it takes commands (add, abort) from a queue between steps, steps
while any request is unfinished, and routes every RequestOutput to the asyncio queue of its request.
``generate`` is an async iterator of a request's growing outputs; leaving it early (a client that
disconnects, a cancelled task) aborts the request, which frees its memory. An invalid request raises
ValueError from ``generate`` and never reaches the loop; an exception inside a step fails the requests
that were in the engine then, and the loop goes on serving new ones.

A text prompt is tokenized (and every prompt checked) in a worker thread before it is queued: a long
prompt takes seconds to tokenize, which on the event loop would stall every connection and on the
engine thread every running request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from deepinfer_core.engine.processor import prompt_ids
from deepinfer_core.outputs import RequestOutput
from deepinfer_core.sampling.params import SamplingParams

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """Too many requests are pending; retry later."""


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (shut down, or failed outside any request)."""


class RequestFailedError(RuntimeError):
    """The engine failed while running this request."""


_ABORTED = object()  # ends the output stream of a request aborted from outside


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float = field(default_factory=time.monotonic)
    in_engine: bool = False
    started: bool = False  # has produced an output
    num_seqs: int = 1  # the request's n: what it counts against ``max_pending_requests``


class AsyncLLM:
    """``AsyncLLM(engine)``; ``await``-free to build, the loop thread starts on first use (or ``start()``)."""

    def __init__(self, engine: Any, max_pending_requests: int | None = None, idle_wait_s: float = 0.5):
        self.engine = engine
        self.max_pending_requests = max_pending_requests
        self.idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.dead_reason: str | None = None
        self._ids = itertools.count()
        self.num_steps = 0
        self.num_step_failures = 0
        self.num_aborted = 0  # requests aborted before they finished (a client gone, a cancelled task)
        self.stats: dict[str, float] = {}
        self.spec_decode_stats: dict | None = None  # the engine's speculative decoding counters, if it speculates

    @classmethod
    def from_engine_args(cls, engine_args: Any, **kwargs: Any) -> AsyncLLM:
        from deepinfer_core.engine.factory import make_engine

        return cls(make_engine(engine_args), **kwargs)

    # --- what the server reads -------------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_config(self) -> Any:
        return self.engine.model_config

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_reason is None

    @property
    def num_pending(self) -> int:
        return len(self._streams)

    @property
    def num_running(self) -> int:
        """Pending requests that have produced output (the others still wait for their first step)."""
        return sum(1 for s in list(self._streams.values()) if s.started)

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="deepinfer-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._fail_all(EngineDeadError("the engine was shut down"))

    # --- requests --------------------------------------------------------------------------------

    async def generate(self, prompt: Any, params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its RequestOutput after each step it took part in (the last has
        ``finished``). Raises ValueError for an invalid request, QueueFullError when its ``n`` sequences
        would take the sequences pending past ``max_pending_requests``, RequestFailedError when the engine
        failed on it."""
        self.start()
        if self.dead_reason is not None or self._stopping:
            raise EngineDeadError(self.dead_reason or "the engine is shutting down")
        rid = str(request_id) if request_id is not None else f"req-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        params = params or SamplingParams()
        stream = _Stream(loop, asyncio.Queue(), num_seqs=params.n)
        with self._lock:
            self._check_room(stream.num_seqs)
            if rid in self._streams:
                raise ValueError(f"request id {rid!r} is already in use")
            self._streams[rid] = stream
        added = loop.create_future()
        finished = False
        try:
            try:
                prompt = await asyncio.to_thread(self._prepare, prompt, params)
            except ValueError:
                self._drop(rid)
                finished = True  # never queued: nothing to abort
                raise
            self._send(("add", rid, prompt, params, added))
            await added
            while True:
                item = await stream.queue.get()
                while isinstance(item, RequestOutput) and not stream.queue.empty():
                    item = stream.queue.get_nowait()  # outputs are cumulative: the latest says it all
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item is _ABORTED:
                    finished = True
                    return
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._send(("abort", rid))

    def _check_room(self, num_seqs: int) -> None:
        """With ``self._lock`` held: ``max_pending_requests`` bounds the sequences queued or running, each
        request counting its ``n`` (n=100000 is not one request's worth of work). A request that could
        never fit is invalid; one that does not fit now must wait for room."""
        limit = self.max_pending_requests
        if limit is None:
            return
        if num_seqs > limit:
            raise ValueError(f"n is {num_seqs}, more than the {limit} sequences this server holds pending")
        pending = sum(s.num_seqs for s in self._streams.values())
        if pending + num_seqs > limit:
            raise QueueFullError(f"{pending} sequences are pending and this request adds {num_seqs} (the most "
                                 f"is {limit}); retry later")

    def _prepare(self, prompt: Any, params: SamplingParams) -> Any:
        """In a worker thread: a text prompt becomes ``{"prompt", "prompt_token_ids"}``, its images (decoding
        one takes a while) ``"mm_items"`` with the ids expanded over their spans, and the ids are checked
        where the engine can check them off its thread (it checks again, cheaply: a valid prompt is shorter
        than ``max_model_len``). Raises ValueError for an invalid prompt or image."""
        if self.tokenizer is None:
            return prompt  # nothing to tokenize with: the engine accepts token ids or says why not
        text, ids = prompt_ids(prompt, self.engine.encode)
        processor = getattr(self.engine, "processor", None)
        if processor is None:  # the engine processes the images itself
            mm = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
            return {"prompt": text, "prompt_token_ids": ids, **({"multi_modal_data": mm} if mm else {})}
        ids, items = processor.multimodal(prompt, ids)
        processor.validate(ids, params)
        return {"prompt": text, "prompt_token_ids": ids, **({"mm_items": items} if items else {})}

    def abort(self, request_id: str) -> None:
        """Abort a request: the engine drops it and its ``generate`` ends without a finished output."""
        self._send(("abort", str(request_id)))

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    # --- the engine thread -----------------------------------------------------------------------

    @staticmethod
    def _post(stream: _Stream, item: Any) -> None:
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    @staticmethod
    def _resolve(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, exc: BaseException | None) -> None:
        def set_it() -> None:
            if not fut.done():
                fut.set_result(None) if exc is None else fut.set_exception(exc)
        try:
            loop.call_soon_threadsafe(set_it)
        except RuntimeError:
            pass

    def _drop(self, rid: str) -> _Stream | None:
        with self._lock:
            return self._streams.pop(rid, None)

    def _handle(self, command: tuple) -> None:
        if command[0] == "add":
            _, rid, prompt, params, fut = command
            stream = self._streams.get(rid)
            if stream is None:
                return
            try:
                self.engine.add_request(rid, prompt, params)
            except Exception as exc:  # ValueError: the request is invalid; anything else: still only its own
                self._drop(rid)
                if not isinstance(exc, ValueError):
                    logger.exception("adding request %s failed", rid)
                    exc = RequestFailedError(f"the engine could not add the request: {exc}")
                self._resolve(stream.loop, fut, exc)
                return
            stream.in_engine = True
            self._resolve(stream.loop, fut, None)
        elif command[0] == "abort":
            rid = command[1]
            stream = self._drop(rid)
            if stream is None:
                return
            self.num_aborted += 1
            if stream.in_engine:
                try:
                    self.engine.abort_request(rid)
                except Exception:
                    logger.exception("aborting request %s failed", rid)
            self._post(stream, _ABORTED)

    def _drain(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            self._handle(command)

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain()
                if not self.engine.has_unfinished_requests():
                    self._update_stats()
                    self._wake.wait(self.idle_wait_s)
                    self._wake.clear()
                    continue
                self._step()
        except BaseException as exc:  # a failure outside any step: nothing can be served any more
            logger.exception("the engine loop died")
            self.dead_reason = f"the engine loop died: {exc}"
            self._fail_all(EngineDeadError(self.dead_reason))

    def _step(self) -> None:
        live = [rid for rid, s in list(self._streams.items()) if s.in_engine]
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self.num_step_failures += 1
            logger.exception("an engine step failed; failing its %d requests", len(live))
            for rid in live:
                stream = self._drop(rid)
                try:
                    self.engine.abort_request(rid)
                except Exception:
                    logger.exception("aborting request %s after a failed step failed", rid)
                if stream is not None:
                    self._post(stream, RequestFailedError(f"the engine failed while running the request: {exc}"))
            return
        self.num_steps += 1
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.started = True
            if out.finished:
                self._drop(out.request_id)
            self._post(stream, out)
        self._update_stats()

    def _update_stats(self) -> None:
        """Memory, prefix-cache and speculative decoding figures, read in the engine thread between steps."""
        stats: dict[str, float] = {}
        bm = getattr(self.engine, "block_manager", None)
        for name, attr in ("compressed", "blocks"), ("window", "window_blocks"), ("state", "slots"):
            pool = getattr(bm, attr, None)
            if pool is not None and getattr(pool, "size", 0):
                stats[f"{name}_pool_usage"] = 1.0 - pool.num_free / pool.size
        if "compressed_pool_usage" in stats:  # vLLM's figure: the paged KV blocks
            stats["kv_cache_usage"] = stats["compressed_pool_usage"]
        prefix = getattr(self.engine, "prefix_cache_stats", None)
        if callable(prefix):
            try:
                stats.update({f"prefix_cache_{k}": float(v) for k, v in prefix().items()})
            except Exception:
                pass
        self.stats = stats
        drafts = getattr(self.engine, "drafts", None)
        if drafts is not None:  # the counters only: the gate's per-bucket figures are not for every step
            self.spec_decode_stats = drafts.stats.as_dict()
        elif callable(getattr(self.engine, "spec_decode_stats", None)):  # a data-parallel front-end's, summed
            self.spec_decode_stats = self.engine.spec_decode_stats()

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            self._post(stream, exc)

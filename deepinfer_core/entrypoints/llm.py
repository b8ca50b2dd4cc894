"""The offline API: ``LLM(model=None, backend="cpu_ref").generate(prompts, sampling_params)``."""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from deepinfer_core.engine.args import EngineArgs
from deepinfer_core.engine.factory import Engine, make_engine
from deepinfer_core.outputs import RequestOutput
from deepinfer_core.sampling.params import RequestOutputKind, SamplingParams

PromptType = str | dict | list[int]


class LLM:
    """Build an engine by backend name; ``model=None`` is the embedded default checkpoint.

    Safe to share between threads: calls are serialised. A ``generate`` (or ``chat``) call runs whole
    while another thread's call waits, so every call gets the outputs a sequential run gives; a
    ``stream`` takes the engine one step at a time and may interleave with them. For requests that run
    together as they come, use ``AsyncLLM`` (what the server uses). ``llm_engine`` itself is not
    thread-safe: drive it from one thread, or through this object.
    """

    def __init__(self, model: str | Path | None = None, backend: str = "cpu_ref", dtype: Any = None,
                 **engine_args: Any):
        known = {f.name for f in fields(EngineArgs)}
        unknown = sorted(set(engine_args) - known)
        if unknown:
            raise TypeError(f"unknown engine arguments {unknown}; known: {sorted(known)}")
        self._attach(make_engine(EngineArgs(model=model, backend=backend, dtype=dtype, **engine_args)))

    @classmethod
    def from_engine(cls, engine: Engine) -> LLM:
        """The offline API over an engine built elsewhere (a preloaded model, a benchmark's random one)."""
        llm = cls.__new__(cls)
        llm._attach(engine)
        return llm

    def _attach(self, engine: Engine) -> None:
        self.llm_engine = engine
        self._router = OutputRouter(engine)
        self._ids = itertools.count()
        # whoever holds it drives the engine, which is not thread-safe; a generate call holds it from its
        # first add to its last output, a stream only for one step (never across a yield). Reentrant: a
        # stream closed by the collector inside a call of the same thread aborts without a deadlock.
        self._lock = threading.RLock()

    def reset_prefix_cache(self) -> None:
        with self._lock:
            self.llm_engine.reset_prefix_cache()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion and return the final outputs, in the order of ``prompts``.

        Every prompt is checked before anything runs: an invalid one (empty, token ids outside the
        vocabulary, longer than ``max_model_len``, ...) raises ``ValueError`` naming its index, and
        nothing of this call is left in the engine (vLLM's behaviour). A request that fails while
        running ends alone with ``error`` set (``finish_reason="error"``)."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        # only the final outputs are returned: the engine builds no others
        final = {id(p): replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
                 if isinstance(p, SamplingParams) and p.output_kind is not RequestOutputKind.FINAL_ONLY else p
                 for p in params}
        with self._lock:
            return self._run_all(prompts, [final[id(p)] for p in params], use_tqdm)

    def _run_all(self, prompts: list[PromptType], params: list[SamplingParams], use_tqdm: bool
                 ) -> list[RequestOutput]:
        """Queue every prompt (or raise, see ``generate``) and step until each has its final output."""
        order = self._add_all(prompts, params)
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(prompts), desc="generating", unit="req", disable=not use_tqdm)
        try:
            pending = order
            while pending:
                self._router.pump()
                for rid in pending:
                    for out in self._router.take(rid):
                        if out.finished:
                            results[rid] = out
                            bar.update(1)
                pending = [rid for rid in pending if rid not in results]
        finally:
            bar.close()
            self._drop([rid for rid in order if rid not in results], order)
        return [results[rid] for rid in order]

    def _add_all(self, prompts: list[PromptType], params: list[SamplingParams]) -> list[str]:
        """Queue every prompt or none: the first invalid one raises ``ValueError`` naming its index,
        after the requests queued before it are aborted (none of them has run: nothing stepped yet)."""
        added: list[str] = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                rid = f"gen-{next(self._ids)}"
                try:
                    self._router.add(rid, prompt, p)
                except ValueError as exc:
                    raise ValueError(f"prompt {i}: {exc}") from exc
                added.append(rid)
        except BaseException:
            self._drop(added, added)
            raise
        return added

    def _drop(self, abort: Iterable[str], forget: Iterable[str] = ()) -> None:
        """Abort the requests ``abort`` (freeing what they hold) and forget the outputs of ``forget``."""
        for rid in abort:
            self._router.abort(rid)
        for rid in forget:
            self._router.forget(rid)

    def chat(self, messages: Any, sampling_params: SamplingParams | None = None, thinking: bool = False,
             tools: list[dict] | None = None, reasoning_effort: int | str | None = None,
             **kwargs: Any) -> list[RequestOutput]:
        """Generate assistant turns for one conversation (or a list of them) in the model's chat format
        (DeepSeek-V4's or V4.1's, by its architecture); each output carries the parsed message as
        ``chat_messages``. ``reasoning_effort``: V4.1 takes 1..100 or low/high/max."""
        from deepinfer_core.entrypoints.chat_utils import chat

        return chat(self, messages, sampling_params, thinking=thinking, tools=tools,
                    reasoning_effort=reasoning_effort, **kwargs)

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield the growing output of one request after every step it took part in (other calls on this
        ``LLM``, interleaved with the iteration, keep their own outputs)."""
        rid = f"stream-{next(self._ids)}"
        with self._lock:
            self._router.add(rid, prompt, sampling_params or SamplingParams())
        try:
            while True:
                with self._lock:
                    outs = self._router.take(rid)
                    if not outs:
                        self._router.pump()
                        continue
                for out in outs:
                    yield out
                    if out.finished:
                        return
        finally:
            with self._lock:
                self._drop([rid], [rid])


class OutputRouter:
    """Steps the engine on behalf of every caller and files each output under its request, so concurrent
    ``generate`` and ``stream`` calls on one engine each get exactly their own outputs, in order."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.queues: dict[str, deque[RequestOutput]] = {}

    def add(self, request_id: str, prompt: PromptType, params: SamplingParams) -> None:
        self.engine.add_request(request_id, prompt, params)  # ValueError: nothing queued
        self.queues[request_id] = deque()

    def pump(self) -> None:
        """One engine step; raises if nothing is left to step (a caller waits for a request that is gone)."""
        if not self.engine.has_unfinished_requests():
            raise RuntimeError("the engine has no unfinished request, yet a caller still waits for an output")
        for out in self.engine.step():
            queue = self.queues.get(out.request_id)
            if queue is not None:
                queue.append(out)

    def take(self, request_id: str) -> list[RequestOutput]:
        queue = self.queues.get(request_id)
        if not queue:
            return []
        outs = list(queue)
        queue.clear()
        return outs

    def abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)

    def forget(self, request_id: str) -> None:
        self.queues.pop(request_id, None)

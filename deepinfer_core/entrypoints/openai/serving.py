"""The completions and chat-completions handlers: OpenAI request -> engine requests -> OpenAI response
(one JSON body, or server-sent events when ``stream`` is set)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from deepinfer_core.entrypoints.async_llm import AsyncLLM, EngineDeadError, QueueFullError, RequestFailedError
from deepinfer_core.entrypoints.chat_utils import (
    ChatPrompt,
    build_chat_prompt,
    chat_encoding_for,
    image_token_id_for,
)
from deepinfer_core.entrypoints.openai.metrics import ServerMetrics
from deepinfer_core.entrypoints.openai.protocol import APIError, ChatCompletionRequest, CompletionRequest, _Sampling
from deepinfer_core.outputs import RequestOutput
from deepinfer_core.sampling.params import SamplingParams, StructuredOutputsParams

MAX_LOGPROBS = 20
DISCONNECT_POLL_S = 0.1


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def _sampling_params(req: _Sampling, max_tokens: int | None, logprobs: int | None,
                     structured: StructuredOutputsParams | None = None) -> SamplingParams:
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported", "logit_bias")
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise APIError(400, f"logprobs must be between 0 and {MAX_LOGPROBS}, got {logprobs}", "logprobs")
    if structured is None and req.structured_outputs is not None:
        try:
            structured = StructuredOutputsParams(**req.structured_outputs)
        except (TypeError, ValueError) as exc:
            raise APIError(400, f"invalid structured_outputs: {exc}", "structured_outputs") from None
    given = {
        "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "min_p": req.min_p,
        "presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
    }
    try:
        return SamplingParams(
            n=req.n, max_tokens=max_tokens, min_tokens=req.min_tokens, stop=req.stop,
            stop_token_ids=req.stop_token_ids, seed=req.seed, ignore_eos=req.ignore_eos, logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens, structured_outputs=structured,
            **{k: v for k, v in given.items() if v is not None},
        )
    except ValueError as exc:
        raise APIError(400, str(exc).removeprefix("invalid SamplingParams: ")) from None


class OpenAIServing:
    def __init__(self, async_llm: AsyncLLM, model_names: list[str], metrics: ServerMetrics,
                 default_thinking: bool = False):
        self.async_llm = async_llm
        self.model_names = model_names
        self.metrics = metrics
        self.default_thinking = default_thinking

    @property
    def tokenizer(self) -> Any:
        return self.async_llm.tokenizer

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_names}",
                           "model", "model_not_found")

    def _token_text(self, token_id: int) -> str:
        tok = self.tokenizer
        return tok.decode([token_id]) if tok is not None else f"token_id:{token_id}"

    # --- running engine requests -----------------------------------------------------------------

    async def _start(self, prompt: Any, params: SamplingParams, rid: str) -> tuple[AsyncIterator, AsyncIterator]:
        """Queue a request and wait for its first output, so that errors are known before answering."""
        tracker = self.metrics.tracker()
        gen = self.async_llm.generate(prompt, params, rid)
        try:
            first = await gen.__anext__()
        except StopAsyncIteration:
            raise APIError(500, f"request {rid} ended without output") from None
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        except QueueFullError as exc:
            raise APIError(429, str(exc), code="queue_full") from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_dead") from None
        except RequestFailedError as exc:
            raise APIError(500, str(exc)) from None
        tracker.observe(first)
        return self._outputs(first, gen, tracker), gen

    @staticmethod
    async def _outputs(first: RequestOutput, gen: AsyncIterator, tracker: Any) -> AsyncIterator[RequestOutput]:
        yield first
        if first.finished:
            return
        try:
            async for out in gen:
                tracker.observe(out)
                yield out
        finally:
            await gen.aclose()

    async def _start_all(self, prompts: list[Any], params: SamplingParams, base: str) -> list[AsyncIterator]:
        """Start one request per prompt; the outputs of each (the first already in); none left on error."""
        results = await asyncio.gather(*(self._start(p, params, f"{base}-{i}") for i, p in enumerate(prompts)),
                                       return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            for r in results:
                if not isinstance(r, BaseException):
                    await r[1].aclose()
            raise failed[0]
        return [stream for stream, _ in results]

    @staticmethod
    async def _merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The outputs of several requests as they come, tagged with the request's position."""
        if len(streams) == 1:
            async for out in streams[0]:
                yield 0, out
            return
        merged: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
            try:
                async for out in stream:
                    await merged.put((i, out))
                await merged.put((i, done))
            except BaseException as exc:
                await merged.put((i, exc))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        try:
            left = len(tasks)
            while left:
                i, item = await merged.get()
                if item is done:
                    left -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _collect(self, request: Request, streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
        """Run requests to the end; a client that goes away cancels (and so aborts) them."""
        final: dict[int, RequestOutput] = {}

        async def run() -> None:
            async for i, out in self._merge(streams):
                final[i] = out

        task = asyncio.ensure_future(run())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if not task.done() and await request.is_disconnected():
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    raise APIError(499, "the client disconnected")
            task.result()
        finally:
            if not task.done():
                task.cancel()
        return [final[i] for i in range(len(streams))]

    @staticmethod
    def _check_error(out: RequestOutput) -> None:
        if out.error:
            raise APIError(500, f"the request failed: {out.error}")

    @staticmethod
    def _usage(outs: list[RequestOutput]) -> dict[str, Any]:
        prompt = sum(len(o.prompt_token_ids) for o in outs)
        completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
        cached = sum(o.num_cached_tokens for o in outs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _stream_response(self, events: Callable[[], AsyncIterator[str]]) -> StreamingResponse:
        async def body() -> AsyncIterator[str]:
            try:
                async for event in events():
                    yield event
            except (RequestFailedError, EngineDeadError, APIError) as exc:
                status = exc.status if isinstance(exc, APIError) else 500
                yield sse(APIError(status, str(exc)).body())
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # --- /v1/completions -------------------------------------------------------------------------

    def _completion_prompts(self, prompt: Any) -> list[Any]:
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise APIError(400, "prompt is empty", "prompt")
        if all(isinstance(p, int) for p in prompt):
            return [{"prompt_token_ids": list(prompt)}]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) for p in prompt):
            return [{"prompt_token_ids": list(p)} for p in prompt]
        raise APIError(400, "prompt must be a string, a list of strings, a list of token ids or a list of "
                            "token-id lists", "prompt")

    def _completion_logprobs(self, ids: list[int], steps: list[dict[int, float]] | None, offset: int) -> dict | None:
        if steps is None:
            return None
        tokens, token_logprobs, top, offsets = [], [], [], []
        for tid, step in zip(ids, steps):
            text = self._token_text(tid)
            tokens.append(text)
            token_logprobs.append(step.get(tid))
            top.append({self._token_text(t): lp for t, lp in sorted(step.items(), key=lambda kv: -kv[1])})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    async def create_completion(self, req: CompletionRequest, request: Request) -> Response:
        self.check_model(req.model)
        if req.suffix:
            raise APIError(400, "suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of other than n is not supported", "best_of")
        if req.echo and req.logprobs is not None:
            raise APIError(400, "echo with logprobs (prompt logprobs) is not supported", "echo")
        structured = None
        if req.response_format is not None:
            from deepinfer_core.entrypoints.chat_utils import structured_outputs_for

            try:
                structured = structured_outputs_for(req.response_format)
            except ValueError as exc:
                raise APIError(400, str(exc), "response_format") from None
        params = _sampling_params(req, req.max_tokens, req.logprobs, structured)
        prompts = self._completion_prompts(req.prompt)
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        model = req.model or self.model_names[0]
        streams = await self._start_all(prompts, params, rid)
        n = params.n

        def echo(out: RequestOutput) -> str:
            if not req.echo:
                return ""
            if out.prompt is not None:
                return out.prompt
            return self.tokenizer.decode(out.prompt_token_ids) if self.tokenizer is not None else ""

        if not req.stream:
            outs = await self._collect(request, streams)
            choices = []
            for i, out in enumerate(outs):
                self._check_error(out)
                for c in out.outputs:
                    prefix = echo(out)
                    choices.append({
                        "index": i * n + c.index, "text": prefix + c.text,
                        "logprobs": self._completion_logprobs(c.token_ids, c.logprobs, len(prefix)),
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                    })
            return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": model,
                                 "choices": choices, "usage": self._usage(outs)})

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def events() -> AsyncIterator[str]:
            sent_text: dict[int, int] = {}
            sent_tokens: dict[int, int] = {}
            ended: set[int] = set()
            last: dict[int, RequestOutput] = {}
            async for i, out in self._merge(streams):
                last[i] = out
                if out.error:
                    raise APIError(500, f"the request failed: {out.error}")
                for c in out.outputs:
                    index = i * n + c.index
                    if index in ended:
                        continue
                    text_from, tok_from = sent_text.get(index), sent_tokens.get(index, 0)
                    prefix = echo(out) if text_from is None else ""
                    text_from = text_from or 0
                    delta = c.text[text_from:]
                    done = c.finish_reason is not None
                    if not delta and not prefix and not done and len(c.token_ids) == tok_from:
                        continue
                    sent_text[index], sent_tokens[index] = len(c.text), len(c.token_ids)
                    if done:
                        ended.add(index)
                    lps = None
                    if c.logprobs is not None:
                        lps = self._completion_logprobs(c.token_ids[tok_from:], c.logprobs[tok_from:], text_from)
                    yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                               "choices": [{"index": index, "text": prefix + delta, "logprobs": lps,
                                            "finish_reason": c.finish_reason if done else None,
                                            "stop_reason": c.stop_reason if done else None}]})
            if include_usage:
                yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                           "choices": [], "usage": self._usage([last[i] for i in sorted(last)])})

        return self._stream_response(events)

    # --- /v1/chat/completions --------------------------------------------------------------------

    def _thinking(self, req: ChatCompletionRequest) -> bool:
        value: Any = req.thinking
        if isinstance(value, dict):
            value = value.get("type", "enabled") != "disabled"
        kwargs = req.chat_template_kwargs or {}
        for key in ("thinking", "enable_thinking"):
            if key in kwargs:
                value = bool(kwargs[key])
        return self.default_thinking if value is None else bool(value)

    def _chat_logprobs(self, ids: list[int], steps: list[dict[int, float]] | None, top_n: int) -> dict | None:
        if steps is None:
            return None

        def entry(tid: int, lp: float) -> dict[str, Any]:
            text = self._token_text(tid)
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

        content = []
        for tid, step in zip(ids, steps):
            item = entry(tid, step.get(tid, float("-inf")))
            item["top_logprobs"] = [entry(t, lp) for t, lp in sorted(step.items(), key=lambda kv: -kv[1])[:top_n]]
            content.append(item)
        return {"content": content}

    def _chat_prompt(self, req: ChatCompletionRequest) -> ChatPrompt:
        choice = req.tool_choice
        if isinstance(choice, dict) or choice == "required":
            raise APIError(400, "tool_choice 'required' or a named function is not supported; use 'auto' or 'none'",
                           "tool_choice")
        tools = req.tools if choice != "none" else None
        top_n = req.top_logprobs
        if top_n is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        logprobs = (top_n or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = _sampling_params(req, max_tokens, logprobs)
        model_config = getattr(self.async_llm, "model_config", None)
        try:
            # image parts: data: URLs decoded here (the server fetches nothing); the engine's front checks
            # each image, so an unusable one is this request's 400 alone
            return build_chat_prompt(self.tokenizer, req.messages, params, thinking=self._thinking(req),
                                     tools=tools, response_format=req.response_format,
                                     encoding=chat_encoding_for(model_config),
                                     image_token_id=image_token_id_for(model_config),
                                     reasoning_effort=req.reasoning_effort)
        except ValueError as exc:
            param = "reasoning_effort" if str(exc).startswith("reasoning_effort") else "messages"
            raise APIError(400, str(exc), param) from None

    @staticmethod
    def _message(msg: dict[str, Any]) -> dict[str, Any]:
        out = {"role": "assistant", "content": msg["content"] if msg["content"] or not msg["tool_calls"] else None,
               "reasoning_content": msg["reasoning_content"]}
        if msg["tool_calls"]:
            out["tool_calls"] = msg["tool_calls"]
        return out

    async def create_chat_completion(self, req: ChatCompletionRequest, request: Request) -> Response:
        self.check_model(req.model)
        # the conversation is encoded and tokenized in a worker thread: a long one takes seconds, and on the
        # event loop those would stall every connection
        prompt = await run_in_threadpool(self._chat_prompt, req)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        model = req.model or self.model_names[0]
        top_n = req.top_logprobs or 0
        streams = await self._start_all([prompt.engine_prompt], prompt.params, rid)

        if not req.stream:
            out, = await self._collect(request, streams)
            self._check_error(out)
            choices = []
            for c in out.outputs:
                msg = prompt.parse(c.text)
                finish = "tool_calls" if msg["tool_calls"] else c.finish_reason
                choices.append({"index": c.index, "message": self._message(msg),
                                "logprobs": self._chat_logprobs(c.token_ids, c.logprobs, top_n),
                                "finish_reason": finish, "stop_reason": c.stop_reason})
            return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": model,
                                 "choices": choices, "usage": self._usage([out])})

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(index: int, delta: dict, finish: str | None = None, logprobs: dict | None = None) -> str:
            return sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]})

        async def events() -> AsyncIterator[str]:
            parsers: dict[int, Any] = {}
            sent_tokens: dict[int, int] = {}
            ended: set[int] = set()
            last = None
            async for _, out in self._merge(streams):
                last = out
                if out.error:
                    raise APIError(500, f"the request failed: {out.error}")
                for c in out.outputs:
                    if c.index in ended:
                        continue
                    if c.index not in parsers:
                        parsers[c.index] = prompt.stream()
                        yield chunk(c.index, {"role": "assistant", "content": ""})
                    parser, tok_from = parsers[c.index], sent_tokens.get(c.index, 0)
                    done = c.finish_reason is not None
                    lps = None
                    if c.logprobs is not None and len(c.token_ids) > tok_from:
                        lps = self._chat_logprobs(c.token_ids[tok_from:], c.logprobs[tok_from:], top_n)
                    sent_tokens[c.index] = len(c.token_ids)
                    if not done:
                        reasoning, content = parser.update(c.text)
                        if reasoning:
                            yield chunk(c.index, {"reasoning_content": reasoning}, logprobs=lps)
                            lps = None
                        if content or lps:
                            yield chunk(c.index, {"content": content}, logprobs=lps)
                        # vLLM's streaming tool parser: each call's name once, then its arguments in pieces
                        for delta in parser.tool_call_deltas(c.text):
                            yield chunk(c.index, {"tool_calls": [delta]})
                        continue
                    ended.add(c.index)
                    reasoning, content, msg = parser.finish(c.text)
                    if reasoning:
                        yield chunk(c.index, {"reasoning_content": reasoning})
                    if content or lps:
                        yield chunk(c.index, {"content": content}, logprobs=lps)
                    for delta in parser.finish_tool_calls(msg):
                        yield chunk(c.index, {"tool_calls": [delta]})
                    yield chunk(c.index, {}, "tool_calls" if msg["tool_calls"] else c.finish_reason)
            if include_usage and last is not None:
                yield sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                           "choices": [], "usage": self._usage([last])})

        return self._stream_response(events)

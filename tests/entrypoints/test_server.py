"""The OpenAI-compatible server, driven by the official ``openai`` client against a real uvicorn on
127.0.0.1 serving the embedded tiny model: every text equals the offline engine's with the same seeds,
streaming and not (a stream never shows part of a stop string); tools, response_format, n, stop and
logprobs pass through; bad requests get 400 (429 when the queue is full, 401 without the key, 413 for a
body over the limit) and the server keeps serving; a request being tokenized holds up no other; a client
that goes away aborts its request and frees its memory; /metrics labels routes by template and speaks
vLLM's names; a bounded load test ends with zero errors and idle memory.
Both engines are batch-invariant, so batching on the server cannot change a token.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import http.client
import importlib.util
import json
import os
import queue
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from deepinfer_core.chat import encode_messages  # noqa: E402
from deepinfer_core.default_model import v4_model_path  # noqa: E402
from deepinfer_core.engine.args import EngineArgs  # noqa: E402
from deepinfer_core.engine.llm_engine import LLMEngine  # noqa: E402
from deepinfer_core.entrypoints.async_llm import AsyncLLM  # noqa: E402
from deepinfer_core.entrypoints.chat_utils import chat  # noqa: E402
from deepinfer_core.entrypoints.llm import LLM  # noqa: E402
from deepinfer_core.entrypoints.openai.api_server import DEFAULT_MAX_REQUEST_BODY_BYTES, build_app  # noqa: E402
from deepinfer_core.sampling.params import SamplingParams, StructuredOutputsParams  # noqa: E402

needs_xgrammar = pytest.mark.skipif(importlib.util.find_spec("xgrammar") is None,
                                    reason="structured outputs need the optional xgrammar ('deepinfer[structured]')")
MODEL = "deepseek-v4-tiny"
KEY = "test-key"
ENGINE = {"model": str(v4_model_path()), "batch_invariant": True, "block_size": 32, "max_num_seqs": 16}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"location": {"type": "string"}}}}}
CALL = ('<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="location" string="true">Paris</｜DSML｜parameter>\n'
        '</｜DSML｜invoke>\n</｜DSML｜tool_calls>')


class Server:
    def __init__(self, port: int, app, engine: LLMEngine, async_llm: AsyncLLM):
        self.port, self.app, self.engine, self.async_llm = port, app, engine, async_llm
        self.url = f"http://127.0.0.1:{port}"

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", KEY), max_retries=0,
                             timeout=60, **kw)

    def get(self, path: str, key: str | None = KEY) -> tuple[int, bytes]:
        req = urllib.request.Request(self.url + path, headers={"Authorization": f"Bearer {key}"} if key else {})
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until no request is left anywhere; then the block books must balance and the KV cache be idle."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (self.async_llm.num_pending == 0 and not self.engine.has_unfinished_requests()
                    and not self.engine.requests and self.async_llm.stats.get("kv_cache_usage") == 0.0):
                break
            time.sleep(0.02)
        assert self.async_llm.num_pending == 0, "requests left in the async front"
        assert not self.engine.requests and not self.engine.has_unfinished_requests(), "requests left in the engine"
        bm = self.engine.block_manager
        bm.check_invariants()
        assert not bm.owners, "sequences still own memory"
        assert self.async_llm.stats.get("kv_cache_usage") == 0.0


@contextlib.contextmanager
def serving(engine: LLMEngine):
    """A uvicorn server of ``engine`` on a free port of 127.0.0.1, one torch thread, while inside."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    async_llm = AsyncLLM(engine, max_pending_requests=512, idle_wait_s=0.02)
    app = build_app(async_llm, MODEL, api_key=KEY, max_model_len=engine.scheduler_config.max_model_len)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield Server(sock.getsockname()[1], app, engine, async_llm)
    finally:
        uv.should_exit = True
        thread.join(10)
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def server():
    with serving(LLMEngine(EngineArgs(**ENGINE))) as s:
        yield s


@pytest.fixture(scope="module")
def offline():
    return LLM(**ENGINE)


def offline_texts(llm: LLM, prompt, **kw) -> list[str]:
    out = llm.generate([prompt], SamplingParams(**kw), use_tqdm=False)[0]
    assert out.error is None
    return [c.text for c in out.outputs]


# --- plain routes, auth ----------------------------------------------------------------------------


def test_models_health_version_metrics(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert server.client().models.retrieve(MODEL).id == MODEL
    assert server.get("/health", key=None) == (200, b'{"status":"ok"}')
    assert server.get("/version")[0] == 200
    server.client().completions.create(model=MODEL, prompt="import os", max_tokens=3, temperature=0)
    status, body = server.get("/metrics")
    text = body.decode()
    assert status == 200
    for name in ("deepinfer_requests_total", "deepinfer_time_to_first_token_seconds_bucket",
                 "deepinfer_time_per_output_token_seconds", "deepinfer_num_requests_waiting",
                 "deepinfer_num_requests_running", "deepinfer_kv_cache_usage_ratio",
                 "deepinfer_prefix_cache_hit_rate", "deepinfer_generation_tokens_total"):
        assert name in text, name
    assert 'deepinfer_requests_total{code="200",route="/v1/completions"}' in text
    for pool in ("compressed", "window", "state"):  # read from the engine's pools, not defaults
        assert f'deepinfer_cache_pool_usage_ratio{{model_name="{MODEL}",pool="{pool}"}}' in text, pool
        assert f"{pool}_pool_usage" in server.async_llm.stats, pool
    for name in ("vllm:num_requests_running", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:request_success_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:kv_cache_usage_perc"):
        assert name in text, name


def test_metrics_of_a_speculating_server_count_its_drafts(server):
    """An engine with MTP speculation reports vLLM's spec_decode counters on /metrics, equal to the
    engine's own; one without reports none."""
    assert "spec_decode" not in server.get("/metrics")[1].decode()
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    args = EngineArgs(model=ENGINE["model"], block_size=32, max_num_seqs=4, speculative_config=spec)
    with serving(LLMEngine(args)) as s:
        s.client().completions.create(model=MODEL, prompt="def fib(n):", max_tokens=24, temperature=0)
        s.wait_idle()
        text = s.get("/metrics")[1].decode()
        stats = s.engine.spec_decode_stats()
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("deepinfer_spec_decode_") and "per_pos" not in line}
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_proposed_tokens"):
        assert values[f"deepinfer_spec_decode_{key}_total"] == stats[key], key
    assert stats["num_drafts"] > 0 and stats["num_accepted_tokens"] > 0
    per_pos = [line for line in text.splitlines()
               if line.startswith("deepinfer_spec_decode_num_accepted_tokens_per_pos")]
    assert len(per_pos) == 2 and 'position="0"' in per_pos[0]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in per_pos) == stats["num_accepted_tokens"]


def test_api_key_on_every_route_but_health_and_metrics(server):
    with pytest.raises(openai.AuthenticationError, match="API key"):
        server.client(api_key="wrong").completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert server.get("/v1/models", key=None)[0] == 401
    assert server.get("/version", key="nope")[0] == 401
    assert server.get("/nowhere", key=None)[0] == 401
    assert server.get("/health", key=None)[0] == 200
    assert server.get("/metrics", key=None)[0] == 200  # open, as vLLM's is
    from starlette.testclient import TestClient

    # asked to, /metrics needs the key too (an app of its own, never started: it only renders metrics)
    closed = TestClient(build_app(AsyncLLM(server.engine), MODEL, api_key=KEY, require_api_key_for_metrics=True))
    assert closed.get("/metrics").status_code == 401
    assert closed.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def scrape(server) -> dict[tuple[str, tuple], float]:
    """/metrics as ``{(sample name, sorted labels): value}``."""
    status, body = server.get("/metrics", key=None)
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


def test_metrics_route_templates_aborts_and_vllm_names(server):
    """Requests are labelled by route template (every unknown path under one label), aborted requests are
    counted, and vLLM's metric names carry the same figures as ours."""
    client = server.client()
    before = scrape(server)
    resp = client.completions.create(model=MODEL, prompt="import os", max_tokens=5, temperature=0, n=2)
    for path in ("/nope/1", "/nope/2", "/v1/models/other-model", f"/v1/models/{MODEL}"):
        server.get(path)
    server.wait_idle()
    after = scrape(server)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    def requests(route: str, code: str) -> float:
        return delta("deepinfer_requests_total", route=route, code=code)

    assert requests("/v1/completions", "200") == 1
    assert requests("unmatched", "404") == 2 and requests("/v1/models/{model_id:path}", "404") == 1
    assert requests("/v1/models/{model_id:path}", "200") == 1
    assert not any(dict(labels).get("route", "").startswith("/nope") for _, labels in after)
    assert requests("/metrics", "200") == 0  # scrapes are not counted
    vllm = {"model_name": MODEL, "engine": "0"}
    assert delta("vllm:prompt_tokens_total", **vllm) == delta("deepinfer_prompt_tokens_total") == \
        resp.usage.prompt_tokens
    assert delta("vllm:generation_tokens_total", **vllm) == delta("deepinfer_generation_tokens_total") == 10
    assert delta("vllm:request_success_total", finished_reason="length", **vllm) == 2
    assert delta("vllm:time_to_first_token_seconds_count", **vllm) == 1
    assert delta("vllm:e2e_request_latency_seconds_count", **vllm) == 1
    assert delta("vllm:request_generation_tokens_sum", **vllm) == 10
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc", "vllm:prefix_cache_queries_total"):
        assert (name, tuple(sorted(vllm.items()))) in after, name

    conn = _post(server, "/v1/completions", {**LONG, "stream": True}, timeout=30)  # leaves after one chunk
    assert conn.getresponse().readline().startswith(b"data: ")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    server.wait_idle()
    before, after = after, scrape(server)
    assert delta("vllm:request_success_total", finished_reason="abort", **vllm) == 1
    assert delta("deepinfer_request_finished_total", finish_reason="abort") == 1
    assert delta("vllm:generation_tokens_total", **vllm) >= 1  # what it generated before it left counts


# --- completions -----------------------------------------------------------------------------------


def test_completion_equals_offline(server, offline):
    client = server.client()
    for kw in ({"temperature": 0.0, "max_tokens": 12}, {"temperature": 0.8, "top_p": 0.9, "seed": 3, "max_tokens": 12},
               {"temperature": 1.0, "top_k": 5, "seed": 11, "max_tokens": 10, "stop": ["\n"]}):
        extra = {"top_k": kw.pop("top_k")} if "top_k" in kw else {}
        resp = client.completions.create(model=MODEL, prompt="def fibonacci(n):", extra_body=extra, **kw)
        assert [c.text for c in resp.choices] == offline_texts(offline, "def fibonacci(n):", **kw, **extra)
        assert resp.usage.prompt_tokens == len(offline.get_tokenizer().encode("def fibonacci(n):"))
        assert resp.usage.completion_tokens >= 1
    stopped = client.completions.create(model=MODEL, prompt="class A:", max_tokens=40, temperature=0, stop=["\n"])
    assert "\n" not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"


def test_completion_n_logprobs_token_prompts_echo(server, offline):
    client = server.client()
    resp = client.completions.create(model=MODEL, prompt="import", n=3, seed=5, temperature=1.0, max_tokens=8)
    assert [c.text for c in sorted(resp.choices, key=lambda c: c.index)] == offline_texts(
        offline, "import", n=3, seed=5, temperature=1.0, max_tokens=8)
    resp = client.completions.create(model=MODEL, prompt="for i in", max_tokens=6, temperature=0, logprobs=2)
    want = offline.generate(["for i in"], SamplingParams(max_tokens=6, temperature=0, logprobs=2),
                            use_tqdm=False)[0].outputs[0]
    lp = resp.choices[0].logprobs
    assert lp.token_logprobs == [step[t] for t, step in zip(want.token_ids, want.logprobs)]
    assert all(len(top) >= 2 for top in lp.top_logprobs) and "".join(lp.tokens) == want.text
    ids = offline.get_tokenizer().encode("while True:")
    two = client.completions.create(model=MODEL, prompt=[ids, ids[:2]], max_tokens=5, temperature=0)
    assert [c.text for c in two.choices] == [offline_texts(offline, {"prompt_token_ids": p}, max_tokens=5,
                                                           temperature=0)[0] for p in (ids, ids[:2])]
    echoed = client.completions.create(model=MODEL, prompt="x = ", max_tokens=3, temperature=0, echo=True)
    assert echoed.choices[0].text.startswith("x = ")


def test_completion_streaming_equals_offline(server, offline):
    stream = server.client().completions.create(model=MODEL, prompt="def main():", max_tokens=14, temperature=0.7,
                                                seed=2, n=2, stream=True, stream_options={"include_usage": True})
    texts, finish, usage = {0: "", 1: ""}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert [texts[0], texts[1]] == offline_texts(offline, "def main():", max_tokens=14, temperature=0.7, seed=2, n=2)
    assert set(finish) == {0, 1} and usage.completion_tokens == 28


# --- chat ------------------------------------------------------------------------------------------

MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "a sorting function"}]


def test_chat_equals_offline_chat(server, offline):
    client = server.client()
    for thinking in (False, True):
        resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0.6, seed=4,
                                              extra_body={"chat_template_kwargs": {"thinking": thinking}})
        want = chat(offline, MESSAGES, SamplingParams(max_tokens=12, temperature=0.6, seed=4),
                    thinking=thinking)[0].chat_messages[0]
        msg = resp.choices[0].message
        assert (msg.content or "") == want["content"]
        assert msg.reasoning_content == want["reasoning_content"]
        assert (msg.reasoning_content is not None) == thinking
        assert resp.usage.completion_tokens >= 1


def test_offline_chat(offline):
    """LLM.chat's logic: the prompt is the DeepSeek encoding tokenized with one BOS; a list of
    conversations gives one output each; a conversation that cannot be encoded raises ValueError."""
    other = [{"role": "user", "content": "hello"}]
    outs = chat(offline, [MESSAGES, other], SamplingParams(max_tokens=4, temperature=0))
    assert [o.prompt for o in outs] == [encode_messages(MESSAGES), encode_messages(other)]
    for out in outs:
        assert out.error is None and out.prompt_token_ids[0] == 0 and out.prompt_token_ids.count(0) == 1
        assert out.chat_messages[0]["content"] == out.outputs[0].text
    with pytest.raises(ValueError, match="unknown role"):
        chat(offline, [{"role": "robot", "content": "x"}])
    method = offline.chat(other, SamplingParams(max_tokens=4, temperature=0))  # LLM.chat is this logic
    assert [o.outputs[0].token_ids for o in method] == [outs[1].outputs[0].token_ids]


def test_chat_streaming_with_logprobs(server, offline):
    stream = server.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0, stream=True, logprobs=True, top_logprobs=2,
        extra_body={"thinking": {"type": "enabled"}}, stream_options={"include_usage": True})
    reasoning = content = ""
    tokens, first_role, finish, usage = [], None, None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            first_role = first_role or c.delta.role
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
            if c.logprobs is not None:
                tokens += c.logprobs.content
            finish = c.finish_reason or finish
    want = chat(offline, MESSAGES, SamplingParams(max_tokens=10, temperature=0, logprobs=2), thinking=True)[0]
    assert first_role == "assistant" and finish == "length"
    assert (reasoning, content) == (want.chat_messages[0]["reasoning_content"], want.chat_messages[0]["content"])
    assert [t.logprob for t in tokens] == [s[t] for t, s in zip(want.outputs[0].token_ids, want.outputs[0].logprobs)]
    assert all(len(t.top_logprobs) == 2 for t in tokens) and usage.completion_tokens == 10


@needs_xgrammar
def test_chat_tool_calls(server, offline):
    """The tiny model cannot call tools by itself: a structured-output choice makes it write the DSML
    block, which comes back as an OpenAI tool call. Streamed, as vLLM's tool parsers stream: the call's
    id and name in its first delta, then its arguments in several pieces, which concatenated equal the
    non-streamed call's arguments and offline ``LLM.chat``'s, character for character."""
    client = server.client()
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "weather in Paris?"}], tools=[WEATHER],
              max_tokens=200, temperature=0, extra_body={"structured_outputs": {"choice": [CALL]}})

    def streamed():
        deltas, content, finish = [], "", None
        for chunk in client.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                deltas += c.delta.tool_calls or []
                content += c.delta.content or ""
                finish = c.finish_reason or finish
        return deltas, content, finish

    # the streamed request runs beside the non-streamed one, in the same steps: the engine is batch-invariant
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        stream = pool.submit(streamed)
        resp = client.chat.completions.create(**kw)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"location": "Paris"})
    want = chat(offline, kw["messages"], SamplingParams(max_tokens=200, temperature=0,
                                                        structured_outputs=StructuredOutputsParams(choice=[CALL])),
                tools=[WEATHER])[0].chat_messages[0]["tool_calls"]
    assert call.function.arguments == want[0]["function"]["arguments"]
    deltas, content, finish = stream.result()
    assert content == "" and finish == "tool_calls"
    assert {d.index for d in deltas} == {0}
    head, pieces = deltas[0], [d.function.arguments for d in deltas[1:]]
    assert head.id.startswith("call_") and head.type == "function" and head.function.name == "get_weather"
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    assert len(pieces) >= 2, f"the arguments came whole: {pieces}"
    assert "".join(pieces) == call.function.arguments
    history = [*kw["messages"], choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    follow = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=4)
    assert follow.choices[0].message.role == "assistant"


@needs_xgrammar
def test_chat_response_format_json_schema(server, offline):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    rf = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}}
    resp = server.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0,
                                                   response_format=rf)
    want = chat(offline, MESSAGES, SamplingParams(max_tokens=60, temperature=0), response_format=rf)[0]
    text = resp.choices[0].message.content
    assert text == want.chat_messages[0]["content"]
    assert resp.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(text)["a"], int)


def stop_strings(text: str) -> list[str]:
    """Three pieces of ``text`` of 2 to 5 characters from along it: as stop strings they hit, most across
    tokens."""
    assert len(text) >= 24, text
    return [text[k : k + n] for k, n in zip(range(len(text) // 8, len(text) - 5, len(text) // 3), (3, 5, 2))]


def test_streamed_text_never_shows_part_of_a_stop_string(server):
    """For stop strings taken from a non-streamed output, the concatenated stream is exactly the
    non-streamed text (completions and chat): the tail that could still become a stop string is held back."""
    client = server.client()
    kw = dict(model=MODEL, max_tokens=32, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(prompt="def fibonacci(n):", **kw).choices[0].text
    for stop in stop_strings(full):
        whole = client.completions.create(prompt="def fibonacci(n):", stop=[stop], **kw).choices[0]
        assert (whole.text, whole.finish_reason) == (full[: full.index(stop)], "stop"), stop
        chunks = [c.choices[0] for c in client.completions.create(prompt="def fibonacci(n):", stop=[stop],
                                                                  stream=True, **kw)]
        assert "".join(c.text for c in chunks) == whole.text, stop
        assert chunks[-1].finish_reason == "stop"
    full = client.chat.completions.create(messages=MESSAGES, **kw).choices[0].message.content
    for stop in stop_strings(full):
        whole = client.chat.completions.create(messages=MESSAGES, stop=stop, **kw).choices[0]
        assert (whole.message.content, whole.finish_reason) == (full[: full.index(stop)], "stop"), stop
        chunks = [c.choices[0] for c in client.chat.completions.create(messages=MESSAGES, stop=stop, stream=True,
                                                                       **kw) if c.choices]
        assert "".join(c.delta.content or "" for c in chunks) == whole.message.content, stop
        assert chunks[-1].finish_reason == "stop"


# --- errors ----------------------------------------------------------------------------------------


BAD = [
    ("completions", {"prompt": "x", "temperature": -1}, "temperature must be a finite number >= 0"),
    ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ("completions", {"prompt": "x " * 5000}, "max_model_len"),
    ("completions", {"prompt": "x", "max_tokens": 10**9}, "max_tokens is 1000000000, but max_model_len is"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10**9}, "max_tokens is"),
    ("completions", {"prompt": "x", "n": 20}, "n is 20, more than the 16 sequences that run at once"),
    ("completions", {"prompt": "x", "n": 100000}, "n is 100000, more than the 512 sequences this server holds"),
    ("completions", {"prompt": [10**9]}, "outside the vocabulary"),
    ("completions", {"prompt": "x", "logprobs": 99}, "logprobs must be between 0 and 20"),
    pytest.param("completions", {"prompt": "x", "extra_body": {"structured_outputs": {"regex": "("}}}, "parenthesis",
                 marks=needs_xgrammar),
    ("chat", {"messages": [{"role": "wizard", "content": "x"}]}, "unknown role 'wizard'"),
    pytest.param("chat", {"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "b", "schema": {"type": "object", "properties": {
            "a": {"type": "nonsense"}}}}}}, "nonsense", marks=needs_xgrammar),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required", "tools": [WEATHER]},
     "tool_choice"),
    ("chat", {"messages": "not a list"}, "messages"),
    # this tiny model is a V4: OpenAI's levels only (V4.1's 1..100: test_chat_encoding_v41)
    ("chat", {"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "fast"},
     "reasoning_effort must be one of ['none', 'low', 'medium', 'high', 'max'] for this model, got 'fast'"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "reasoning_effort": 50}, "got 50"),
]


@pytest.mark.parametrize("route, kw, message", BAD,
                         ids=[b.values[2] if hasattr(b, "values") else b[2] for b in BAD])
def test_bad_requests_get_400_and_the_server_goes_on(server, route, kw, message):
    client = server.client()
    create = client.completions.create if route == "completions" else client.chat.completions.create
    with pytest.raises(openai.BadRequestError) as err:
        create(model=MODEL, **kw)
    assert err.value.status_code == 400 and message in err.value.message
    assert err.value.body["type"] == "invalid_request_error"
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=2).choices[0].finish_reason == "length"


def test_unknown_model_404_and_full_queue_429(server):
    client = server.client()
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-17", prompt="x", max_tokens=2)
    server.async_llm.max_pending_requests = 2  # sequences: the stream's n=2 takes both
    stream = client.completions.create(model=MODEL, prompt="x", max_tokens=1000, n=2, stream=True,
                                       extra_body={"ignore_eos": True})
    try:
        next(iter(stream))
        with pytest.raises(openai.RateLimitError, match="2 sequences are pending.*retry later"):
            client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    finally:
        stream.close()
        server.async_llm.max_pending_requests = 512
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).choices


def test_failing_step_fails_its_request_only(server):
    engine = server.engine
    real = engine.step

    def broken():
        engine.step = real
        raise RuntimeError("simulated device fault")

    client = server.client()
    engine.step = broken
    with pytest.raises(openai.InternalServerError, match="simulated device fault"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=5)
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=5).choices[0].text
    server.wait_idle()


def test_request_body_over_the_limit_gets_413(server):
    """A declared Content-Length over the limit is refused before the body is sent; a chunked body is
    refused once it passes the limit; the server goes on."""
    limit = DEFAULT_MAX_REQUEST_BODY_BYTES
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.putrequest("POST", "/v1/completions")
    for name, value in (("Content-Type", "application/json"), ("Authorization", f"Bearer {KEY}"),
                        ("Content-Length", str(limit + 1))):
        conn.putheader(name, value)
    conn.endheaders()  # and no body: the answer must not wait for it
    resp = conn.getresponse()
    error = json.loads(resp.read())["error"]
    assert resp.status == 413 and f"limit of {limit} bytes" in error["message"]
    assert error["type"] == "invalid_request_error"
    conn.close()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.putrequest("POST", "/v1/completions")
    for name, value in (("Content-Type", "application/json"), ("Authorization", f"Bearer {KEY}"),
                        ("Transfer-Encoding", "chunked")):
        conn.putheader(name, value)
    conn.endheaders()
    piece = b" " * (1 << 20)
    for _ in range(limit // len(piece) + 1):  # one byte-chunk more than the limit, and no closing chunk
        conn.send(b"%x\r\n%s\r\n" % (len(piece), piece))
    resp = conn.getresponse()
    assert resp.status == 413 and f"limit of {limit} bytes" in json.loads(resp.read())["error"]["message"]
    conn.close()
    assert server.client().completions.create(model=MODEL, prompt="x", max_tokens=2).choices


def test_a_request_being_tokenized_holds_up_no_other(server, monkeypatch):
    """Two large (under-limit) requests, a completion and a chat, sit in the tokenizer, held there by the
    test: meanwhile /health answers and a small completion stream and a small chat stream run to their end.
    (Tokenizing on the event loop would leave /health unanswered, on the engine thread the streams.)"""
    tokenizer = server.engine.tokenizer
    real = tokenizer.encode
    big = "x = 1\n" * (1 << 16)  # 384 KiB of prompt
    arrived: queue.Queue = queue.Queue()
    release = threading.Event()

    def encode(text, *args, **kwargs):
        if len(text) >= len(big):
            arrived.put(text)
            assert release.wait(60), "the test never released the tokenizer"
        return real(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", encode)
    answers: queue.Queue = queue.Queue()

    def send_big(create, **kw) -> None:
        try:
            create(model=MODEL, max_tokens=4, **kw)
            answers.put("answered")
        except openai.APIStatusError as exc:
            answers.put(exc.status_code)

    client = server.client()
    bigs = [threading.Thread(target=send_big, args=(client.completions.create,), kwargs={"prompt": big}),
            threading.Thread(target=send_big, args=(client.chat.completions.create,),
                             kwargs={"messages": [{"role": "user", "content": big}]})]
    try:
        for t in bigs:
            t.start()
        for _ in bigs:
            arrived.get(timeout=30)  # both are being tokenized now, and stay so until released
        assert server.get("/health", key=None) == (200, b'{"status":"ok"}')
        text = "".join(c.choices[0].text for c in client.completions.create(
            model=MODEL, prompt="def f():", max_tokens=8, temperature=0, stream=True))
        reply = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, stream=True) if c.choices)
        assert text and reply
        assert answers.empty() and not release.is_set()  # the large ones are still in the tokenizer
    finally:
        release.set()
        for t in bigs:
            t.join(60)
    assert sorted(answers.get_nowait() for _ in bigs) == [400, 400]  # longer than max_model_len
    server.wait_idle()


# --- disconnects -----------------------------------------------------------------------------------


def _post(server, path: str, body: dict, timeout: float) -> http.client.HTTPConnection:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json",
                                                  "Authorization": f"Bearer {KEY}"})
    return conn


LONG = {"model": MODEL, "prompt": "def f():", "max_tokens": 3000, "ignore_eos": True}


def test_streaming_disconnect_aborts(server):
    conn = _post(server, "/v1/completions", {**LONG, "stream": True}, timeout=30)
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    assert server.async_llm.num_pending == 1
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    start = time.monotonic()
    server.wait_idle(timeout=10)
    assert time.monotonic() - start < 5  # 3000 tokens would take far longer: it was aborted


def test_non_streaming_disconnect_aborts(server):
    conn = _post(server, "/v1/chat/completions", {**LONG, "messages": MESSAGES}, timeout=0.5)
    with pytest.raises(TimeoutError):
        conn.getresponse()
    conn.close()
    start = time.monotonic()
    server.wait_idle(timeout=10)
    assert time.monotonic() - start < 5


# --- load ------------------------------------------------------------------------------------------

PROMPTS = ["def add(a, b):", "import sys\n", "class Stack:", "for x in range(10):", "# parse the header\n",
           "with open(path) as f:"]


def test_load_many_clients(server, offline):
    """32 concurrent clients (twice the engine's max_num_seqs) x 4 requests, half streaming, every fifth stream
    dropped after its first chunk: no errors, every completed text equals the offline engine's, the engine drains
    to idle."""
    clients, per_client, max_tokens = 32, 4, 10
    assert clients > ENGINE["max_num_seqs"]  # requests wait for a sequence slot
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    jobs = [(c, r) for c in range(clients) for r in range(per_client)]
    results: dict[tuple[int, int], str] = {}
    ttft: list[float] = []
    tpot: list[float] = []
    errors: list[BaseException] = []

    def spec(c: int, r: int) -> tuple[str, int]:
        return PROMPTS[(c + r) % len(PROMPTS)], (c * per_client + r) % 7

    async def one(c: int, r: int) -> None:
        prompt, seed = spec(c, r)
        kw = dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0.9, seed=seed,
                  extra_body={"ignore_eos": True})
        start = time.monotonic()
        try:
            if (c + r) % 2 == 0:
                resp = await client.completions.create(**kw)
                results[c, r] = resp.choices[0].text
                return
            stream = await client.completions.create(stream=True, **kw)
            text, first, count = "", None, 0
            async for chunk in stream:
                now = time.monotonic()
                if first is None:
                    first = now
                    ttft.append(now - start)
                    if (c * per_client + r) % 5 == 1:
                        await stream.close()
                        return
                count += 1
                text += chunk.choices[0].text
            if count > 1:
                tpot.append((time.monotonic() - first) / (count - 1))
            results[c, r] = text
        except BaseException as exc:  # noqa: BLE001 - collected and reported below
            errors.append(exc)

    async def main() -> float:
        begin = time.monotonic()
        await asyncio.gather(*(one(c, r) for c, r in jobs))
        await client.close()
        return time.monotonic() - begin

    elapsed = asyncio.run(main())
    assert not errors, errors[:3]
    specs = sorted({spec(*key) for key in results})
    outs = offline.generate([p for p, _ in specs], [SamplingParams(max_tokens=max_tokens, temperature=0.9, seed=seed,
                                                                   ignore_eos=True) for _, seed in specs],
                            use_tqdm=False)
    wanted = {s: out.outputs[0].text for s, out in zip(specs, outs)}
    for key, text in results.items():
        assert text == wanted[spec(*key)], key
    dropped = sum(1 for c, r in jobs if (c + r) % 2 and (c * per_client + r) % 5 == 1)
    assert len(results) == len(jobs) - dropped
    server.wait_idle()

    def pct(xs: list[float], q: float) -> float:
        return statistics.quantiles(xs, n=100)[q - 1] if len(xs) > 1 else (xs or [0.0])[0]

    print(f"\nload: {len(jobs)} requests from {clients} clients in {elapsed:.2f}s, {dropped} dropped; "
          f"TTFT p50 {pct(ttft, 50) * 1e3:.0f} ms p90 {pct(ttft, 90) * 1e3:.0f} ms p99 {pct(ttft, 99) * 1e3:.0f} ms; "
          f"TPOT p50 {pct(tpot, 50) * 1e3:.1f} ms p90 {pct(tpot, 90) * 1e3:.1f} ms p99 {pct(tpot, 99) * 1e3:.1f} ms")


# --- the command ------------------------------------------------------------------------------------


def test_deepinfer_serve_command(tmp_path):
    """`deepinfer serve` on the embedded default model (the trained tiny V4.1): binds 127.0.0.1, answers, stops
    on SIGINT."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "deepinfer_core.entrypoints.cli", "serve", "--port", str(port),
                             "--max-num-seqs", "4", "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                time.sleep(0.1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=30)
        assert client.models.list().data[0].id == "deepseek-v41-tiny"
        reply = client.chat.completions.create(model="deepseek-v41-tiny", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=3)
        assert reply.choices[0].finish_reason == "length"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    assert proc.returncode == 0, (tmp_path / "serve.log").read_text()
    assert f"on http://127.0.0.1:{port}/v1" in (tmp_path / "serve.log").read_text()

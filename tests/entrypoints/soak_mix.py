"""The soak test's clients: each loops until a deadline over a random mix of valid greedy requests
(completions and chat, streaming and not, compared with offline references), client disconnects,
oversized requests and malformed ones, while a sampler reads the server's resident memory.

Every outcome goes into a ``Tally``: a valid request that does not answer 200 with the offline text and
finish reason is an error, and so is a refused request answered with another status than its own (413
for a body over the limit, 400 for the rest). A disconnect has no expected outcome: the drain check after
the soak is what proves the server aborted it.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import openai

BODY_LIMIT = 256 << 10  # the server's --max-request-body-bytes: small, so an oversized body is cheap to send
SAMPLE_EVERY_S = 0.5

_CODE = "def parse_header(line: str) -> dict[str, str]:\n    fields = {}\n    for part in line.split(';'):\n"
COMPLETION_PROMPTS = [
    "def add(a, b):", "import sys\n", "class Stack:", "for x in range(10):", "# parse the header\n",
    _CODE * 3, _CODE * 3 + "    return fields\n",  # over two blocks of 32 tokens, sharing them: prefix-cache hits
]
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "a sorting function"}],
    [{"role": "user", "content": "explain this:\n" + _CODE * 2}],
]


@dataclass(frozen=True)
class Target:
    """The server under test; ``model`` is the name it serves (read from /v1/models)."""

    url: str
    port: int
    key: str
    model: str


@dataclass(frozen=True)
class Spec:
    """One valid greedy request; ``prompt`` is a completion prompt, ``messages`` a chat."""

    max_tokens: int
    prompt: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None
    stop: str | None = None

    def message_list(self) -> list[dict[str, str]]:
        return [{"role": r, "content": c} for r, c in self.messages or ()]


@dataclass(frozen=True)
class Reference:
    text: str
    finish_reason: str


@dataclass
class Tally:
    by_action: dict[str, int] = field(default_factory=dict)
    completed: int = 0  # valid requests answered and compared
    latencies: list[float] = field(default_factory=list)  # of the valid requests, seconds
    errors: list[str] = field(default_factory=list)
    rss_kib: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, VmRSS)

    def count(self, action: str) -> None:
        self.by_action[action] = self.by_action.get(action, 0) + 1

    def percentile(self, q: int) -> float:
        xs = self.latencies
        return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else (xs or [0.0])[0]


def base_specs() -> list[Spec]:
    """The valid requests without stop strings; ``with_stops`` adds one stopped variant of each."""
    specs = [Spec(max_tokens=m, prompt=p) for p in COMPLETION_PROMPTS for m in (6, 16)]
    specs += [Spec(max_tokens=m, messages=tuple((x["role"], x["content"]) for x in conv))
              for conv in CONVERSATIONS for m in (6, 16)]
    return specs


def with_stops(refs: dict[Spec, Reference]) -> list[Spec]:
    """A stop string for each reference that has one to give: the first three printable ASCII characters,
    not all blank, from its middle on (so that it matches)."""
    out = []
    for spec, ref in refs.items():
        for k in range(len(ref.text) // 2, len(ref.text) - 2):
            stop = ref.text[k:k + 3]
            if spec.stop is None and stop.isascii() and stop.isprintable() and stop.strip():
                out.append(Spec(spec.max_tokens, spec.prompt, spec.messages, stop=stop))
                break
    return out


# --- the actions -----------------------------------------------------------------------------------


async def valid(client: openai.AsyncOpenAI, model: str, rng: random.Random, refs: dict[Spec, Reference],
                tally: Tally) -> None:
    spec = rng.choice(list(refs))
    stream = rng.random() < 0.5
    kw: dict[str, Any] = dict(model=model, max_tokens=spec.max_tokens, temperature=0, stream=stream)
    if spec.stop is not None:
        kw["stop"] = [spec.stop]
    name = f"{'chat' if spec.messages else 'completion'}{'-stream' if stream else ''}"
    tally.count(name)
    start = time.monotonic()
    try:
        if spec.messages:
            text, reason = await _chat(client, spec.message_list(), stream, kw)
        else:
            text, reason = await _completion(client, spec.prompt, stream, kw)
    except Exception as exc:  # noqa: BLE001 - a valid request must not fail: recorded as an error
        tally.errors.append(f"{name} {spec}: {type(exc).__name__}: {exc}")
        return
    tally.latencies.append(time.monotonic() - start)
    want = refs[spec]
    if (text, reason) != (want.text, want.finish_reason):
        tally.errors.append(f"{name} {spec}: got {(text, reason)!r}, offline {(want.text, want.finish_reason)!r}")
    else:
        tally.completed += 1


async def _completion(client: openai.AsyncOpenAI, prompt: str | None, stream: bool,
                      kw: dict[str, Any]) -> tuple[str, str | None]:
    resp = await client.completions.create(prompt=prompt, **kw)
    if not stream:
        return resp.choices[0].text, resp.choices[0].finish_reason
    text, reason = "", None
    async for chunk in resp:
        for choice in chunk.choices:
            text += choice.text
            reason = choice.finish_reason or reason
    return text, reason


async def _chat(client: openai.AsyncOpenAI, messages: list[dict[str, str]], stream: bool,
                kw: dict[str, Any]) -> tuple[str, str | None]:
    resp = await client.chat.completions.create(messages=messages, **kw)
    if not stream:
        return resp.choices[0].message.content or "", resp.choices[0].finish_reason
    text, reason = "", None
    async for chunk in resp:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reason = choice.finish_reason or reason
    return text, reason


async def disconnect(client: openai.AsyncOpenAI, model: str, rng: random.Random, tally: Tally) -> None:
    """A long request the client abandons: a stream closed after a few chunks, a stream whose task is
    cancelled, or a plain request given up after a random wait."""
    kw: dict[str, Any] = dict(model=model, prompt=rng.choice(COMPLETION_PROMPTS), max_tokens=200, temperature=0,
                              extra_body={"ignore_eos": True})
    how = rng.choice(("close-stream", "cancel-stream", "cancel-request"))
    tally.count(f"disconnect-{how}")
    try:
        if how == "close-stream":
            stream = await client.completions.create(stream=True, **kw)
            chunks = rng.randint(1, 4)
            async for _ in stream:
                chunks -= 1
                if chunks == 0:
                    break
            await stream.close()
        elif how == "cancel-stream":
            async def consume() -> None:
                async for _ in await client.completions.create(stream=True, **kw):
                    pass

            await asyncio.wait_for(consume(), timeout=rng.uniform(0.05, 2.0))
        else:
            await asyncio.wait_for(client.completions.create(**kw), timeout=rng.uniform(0.05, 2.0))
    except asyncio.TimeoutError:
        pass
    except Exception as exc:  # noqa: BLE001 - before the client left, the request was valid
        tally.errors.append(f"disconnect-{how}: {type(exc).__name__}: {exc}")


_LONG_PROMPT = "x " * 5000  # 10 KB, under the body limit, but over max_model_len (4096) in tokens
_HUGE = "x" * (BODY_LIMIT + 1)
OVERSIZED: dict[str, tuple[int, str, dict[str, Any]]] = {  # name: (status, route, arguments)
    "body-over-limit": (413, "completions", {"prompt": _HUGE}),
    "chat-body-over-limit": (413, "chat", {"messages": [{"role": "user", "content": _HUGE}]}),
    "prompt-over-context": (400, "completions", {"prompt": _LONG_PROMPT}),
    "chat-over-context": (400, "chat", {"messages": [{"role": "user", "content": _LONG_PROMPT}]}),
    "max-tokens-over-context": (400, "completions", {"prompt": "x", "max_tokens": 10**9}),
}
INVALID: dict[str, tuple[int, str, dict[str, Any]]] = {
    "negative-temperature": (400, "completions", {"prompt": "x", "temperature": -1}),
    "logprobs-99": (400, "completions", {"prompt": "x", "logprobs": 99}),
    "token-outside-vocab": (400, "completions", {"prompt": [10**9]}),
    "unknown-role": (400, "chat", {"messages": [{"role": "wizard", "content": "x"}]}),
    "messages-not-a-list": (400, "chat", {"messages": "not a list"}),
}
MALFORMED: dict[str, bytes] = {  # raw bodies of POST /v1/completions, each answered 400
    "truncated-json": b'{"model": "m", "prompt": "x", ',
    "not-json": b"prompt=x&max_tokens=4",
    "json-array": b"[1, 2, 3]",
    "max-tokens-a-word": b'{"model": "m", "prompt": "x", "max_tokens": "many"}',
}


async def refused(client: openai.AsyncOpenAI, model: str, rng: random.Random, tally: Tally, table: dict) -> None:
    name = rng.choice(list(table))
    status, route, kw = table[name]
    tally.count(name)
    create = client.completions.create if route == "completions" else client.chat.completions.create
    try:
        await create(model=model, **{"max_tokens": 4, **kw})
    except openai.APIStatusError as exc:
        if exc.status_code != status:
            tally.errors.append(f"{name}: answered {exc.status_code}, not {status}: {exc.message}")
        return
    except Exception as exc:  # noqa: BLE001 - a refusal must be an answer, not a broken connection
        tally.errors.append(f"{name}: {type(exc).__name__}: {exc}")
        return
    tally.errors.append(f"{name}: answered 200, not {status}")


async def malformed(target: Target, rng: random.Random, tally: Tally) -> None:
    name = rng.choice(list(MALFORMED))
    tally.count(name)
    body = MALFORMED[name]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", target.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
                     % (target.key.encode(), len(body), body))
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), timeout=60)
        await reader.read()
        writer.close()
        await writer.wait_closed()
    except Exception as exc:  # noqa: BLE001
        tally.errors.append(f"{name}: {type(exc).__name__}: {exc}")
        return
    parts = status_line.split()
    if len(parts) < 2 or parts[1] != b"400":
        tally.errors.append(f"{name}: answered {status_line!r}, not 400")


# --- the clients and the sampler ------------------------------------------------------------------


async def client_loop(index: int, target: Target, deadline: float, refs: dict[Spec, Reference],
                      tally: Tally) -> None:
    """One client: requests back to back until ``deadline``; about 60% valid, 15% disconnects, 25% refused."""
    rng = random.Random(index)
    client = openai.AsyncOpenAI(base_url=target.url + "/v1", api_key=target.key, max_retries=0, timeout=90)
    model = target.model
    try:
        while time.monotonic() < deadline:
            roll = rng.random()
            if roll < 0.60:
                await valid(client, model, rng, refs, tally)
            elif roll < 0.75:
                await disconnect(client, model, rng, tally)
            elif roll < 0.85:
                await refused(client, model, rng, tally, OVERSIZED)
            elif roll < 0.93:
                await refused(client, model, rng, tally, INVALID)
            else:
                await malformed(target, rng, tally)
    finally:
        await client.close()


async def sample_rss(pid: int, start: float, stop: asyncio.Event, tally: Tally) -> None:
    while not stop.is_set():
        tally.rss_kib.append((time.monotonic() - start, rss_kib(pid)))
        try:
            await asyncio.wait_for(stop.wait(), SAMPLE_EVERY_S)
        except asyncio.TimeoutError:
            pass


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for process {pid}")


async def soak(target: Target, pid: int, clients: int, duration_s: float,
               refs: dict[Spec, Reference], grace_s: float = 120.0) -> tuple[Tally, float]:
    """Run ``clients`` client loops for ``duration_s``; returns the tally and the wall time. A client still
    busy ``grace_s`` after the deadline is a hang, recorded as an error."""
    tally = Tally()
    start = time.monotonic()
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_rss(pid, start, stop, tally))
    tasks = [asyncio.create_task(client_loop(i, target, start + duration_s, refs, tally))
             for i in range(clients)]
    done, pending = await asyncio.wait(tasks, timeout=duration_s + grace_s)
    for task in pending:
        task.cancel()
    if pending:
        tally.errors.append(f"{len(pending)} clients still waiting {grace_s:.0f} s after the deadline (a hang)")
    for task in done:
        if task.exception() is not None:
            tally.errors.append(f"a client loop died: {task.exception()!r}")
    stop.set()
    await sampler
    return tally, time.monotonic() - start

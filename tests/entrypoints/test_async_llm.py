"""AsyncLLM over a scripted engine: outputs routed to their requests, invalid requests refused without
harm, cancellation aborts, a failing step fails only the requests that were in it, a full queue refuses.
(The real engine behind the HTTP server is covered in test_server.py.)"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from deepinfer_core.entrypoints.async_llm import AsyncLLM, EngineDeadError, QueueFullError, RequestFailedError
from deepinfer_core.outputs import CompletionOutput, RequestOutput
from deepinfer_core.sampling.params import SamplingParams


class ScriptedEngine:
    """One token per step per request; the text is the request id repeated. Steps in ``fail_steps`` raise."""

    tokenizer = None
    model_config = SimpleNamespace(vocab_size=100)

    def __init__(self, fail_steps=()):
        self.live: dict[str, list] = {}
        self.aborted: list[str] = []
        self.num_steps = 0
        self.fail_steps = set(fail_steps)

    def add_request(self, request_id, prompt, params):
        if prompt == "bad":
            raise ValueError("the prompt is bad")
        if request_id in self.live:
            raise ValueError("in use")
        self.live[request_id] = [0, params.max_tokens]

    def step(self):
        self.num_steps += 1
        time.sleep(0.002)
        if self.num_steps in self.fail_steps:
            raise RuntimeError("device fell over")
        outs = []
        for rid, state in list(self.live.items()):
            state[0] += 1
            done = state[0] >= state[1]
            outs.append(RequestOutput(rid, None, [5], [CompletionOutput(0, rid[:1] * state[0], [7] * state[0],
                                                                        "length" if done else None)], done))
            if done:
                del self.live[rid]
        return outs

    def abort_request(self, request_id):
        if self.live.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_unfinished_requests(self):
        return bool(self.live)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


@pytest.fixture
def engine():
    return ScriptedEngine()


@pytest.fixture
def allm(engine):
    front = AsyncLLM(engine, idle_wait_s=0.05)
    yield front
    front.shutdown()


async def collect(allm, prompt, max_tokens, rid):
    return [out async for out in allm.generate(prompt, SamplingParams(max_tokens=max_tokens), rid)]


def test_outputs_reach_their_own_request(allm):
    async def main():
        return await asyncio.gather(*(collect(allm, "p", 3 + i, f"{chr(97 + i)}{i}") for i in range(8)))

    results = run(main())
    for i, outs in enumerate(results):
        final = outs[-1]
        assert final.finished and final.request_id == f"{chr(97 + i)}{i}"
        assert final.outputs[0].text == chr(97 + i) * (3 + i)
        assert all(not o.finished for o in outs[:-1])
    assert allm.num_pending == 0


def test_invalid_request_raises_and_the_loop_goes_on(allm):
    async def main():
        with pytest.raises(ValueError, match="the prompt is bad"):
            await collect(allm, "bad", 3, "x")
        return await collect(allm, "p", 2, "y")

    assert run(main())[-1].finished
    assert allm.num_pending == 0


def test_leaving_early_aborts(allm, engine):
    async def main():
        gen = allm.generate("p", SamplingParams(max_tokens=1000), "early")
        async for _ in gen:
            break
        await gen.aclose()

        async def consume():
            await collect(allm, "p", 1000, "cancelled")

        task = asyncio.ensure_future(consume())
        while "cancelled" not in engine.live:
            await asyncio.sleep(0.005)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for _ in range(200):
            if not engine.live:
                break
            await asyncio.sleep(0.01)

    run(main())
    assert sorted(engine.aborted) == ["cancelled", "early"]
    assert not engine.live and allm.num_pending == 0


def test_abort_from_outside_ends_the_stream(allm, engine):
    async def main():
        outs = []
        async for out in allm.generate("p", SamplingParams(max_tokens=1000), "r"):
            outs.append(out)
            if len(outs) == 2:
                allm.abort("r")
        return outs

    outs = run(main())
    assert not outs[-1].finished and engine.aborted == ["r"]


def test_failed_step_fails_its_requests_only():
    engine = ScriptedEngine(fail_steps={3})
    allm = AsyncLLM(engine, idle_wait_s=0.05)

    async def main():
        first = await asyncio.gather(collect(allm, "p", 10, "a"), collect(allm, "p", 10, "b"),
                                     return_exceptions=True)
        after = await collect(allm, "p", 2, "c")
        return first, after

    try:
        first, after = run(main())
    finally:
        allm.shutdown()
    assert all(isinstance(r, RequestFailedError) and "device fell over" in str(r) for r in first)
    assert after[-1].finished and allm.num_step_failures == 1
    assert not engine.live


def test_full_queue_and_duplicate_ids_are_refused(engine):
    allm = AsyncLLM(engine, max_pending_requests=1, idle_wait_s=0.05)

    async def main():
        gen = allm.generate("p", SamplingParams(max_tokens=1000), "one")
        await gen.__anext__()
        with pytest.raises(QueueFullError, match="retry later"):
            await collect(allm, "p", 2, "two")
        allm.max_pending_requests = 2
        with pytest.raises(ValueError, match="already in use"):
            await collect(allm, "p", 2, "one")
        await gen.aclose()

    try:
        run(main())
    finally:
        allm.shutdown()


def test_pending_limit_counts_sequences(engine):
    """``max_pending_requests`` bounds sequences: a request counts its n. One that does not fit beside
    those pending waits for room (QueueFullError, 429); one whose n alone is over the limit never fits
    (ValueError, 400)."""
    allm = AsyncLLM(engine, max_pending_requests=3, idle_wait_s=0.05)

    async def main():
        gen = allm.generate("p", SamplingParams(max_tokens=1000, n=2), "two")
        await gen.__anext__()
        with pytest.raises(QueueFullError, match="2 sequences are pending and this request adds 2"):
            await collect_params(allm, SamplingParams(max_tokens=2, n=2), "more")
        with pytest.raises(ValueError, match="n is 4, more than the 3 sequences"):
            await collect_params(allm, SamplingParams(max_tokens=2, n=4), "never")
        fits = await collect_params(allm, SamplingParams(max_tokens=2), "one")
        await gen.aclose()
        return fits

    try:
        assert run(main())[-1].finished
    finally:
        allm.shutdown()
    assert allm.num_pending == 0


async def collect_params(allm, params, rid):
    return [out async for out in allm.generate("p", params, rid)]


def test_shut_down_front_refuses(engine):
    allm = AsyncLLM(engine)
    allm.start()
    allm.shutdown()
    with pytest.raises(EngineDeadError):
        run(collect(allm, "p", 2, "late"))


def test_stats_give_each_cache_pools_usage(engine):
    """``stats`` (what /metrics reads) holds the used fraction of every pool of the engine's block manager:
    compressed KV blocks (also vLLM's ``kv_cache_usage``), window blocks and state slots."""
    from deepinfer_core.engine.block_manager import Pool

    pools = {"blocks": Pool("compressed", 8), "window_blocks": Pool("window", 4), "slots": Pool("state", 5)}
    for pool, n in zip(pools.values(), (2, 3, 1)):
        for _ in range(n):
            pool.allocate()
    engine.block_manager = SimpleNamespace(**pools)
    front = AsyncLLM(engine, idle_wait_s=0.05)
    try:
        front._update_stats()
        assert front.stats == pytest.approx({"compressed_pool_usage": 0.25, "window_pool_usage": 0.75,
                                             "state_pool_usage": 0.2, "kv_cache_usage": 0.25})
    finally:
        front.shutdown()

"""Async scheduling gives exactly the outputs of synchronous steps.

Every workload runs on two engines built alike but for ``async_scheduling``; tokens, logprobs, text,
finish and stop reasons, cumulative logprobs, num_cached_tokens and errors must be equal (logprobs bit
for bit). The async engine counts the steps it overlapped and the samples it dropped (a sequence that
stopped after the next step was launched), so a test also proves that overlap happened. Engines come
from ``make_llm``: block books checked after every step, every pool free at the end.

Without batch-invariant ops a sequence that may stop on its in-flight token forces a synchronous step
(its extra row would move the other rows' arithmetic), so the default-mode workloads that must overlap
are length-limited; the batch-invariant ones overlap with stops too.
"""

from __future__ import annotations

import dataclasses
import random

import engine_fixtures
import pytest
from engine_fixtures import make_prompt, token_prompts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer_core.sampling.params import SamplingParams, StructuredOutputsParams

make_llm = engine_fixtures.make_llm
one_torch_thread = engine_fixtures.one_torch_thread
tiny_path = engine_fixtures.tiny_path

VOCAB = 384


def counted(llm):
    """Count the async engine's overlapped and drained steps and the samples it dropped."""
    engine = llm.llm_engine
    engine.counts = {"overlapped": 0, "drained": 0, "dropped": 0}
    can_overlap, finish = engine._can_overlap, engine._finish

    def _can_overlap(prev):
        ok = can_overlap(prev)
        engine.counts["overlapped" if ok else "drained"] += 1
        return ok

    def _finish(launched, touched, *rest):
        engine.counts["dropped"] += sum(s.finish_reason is not None for s in launched.sampled)
        finish(launched, touched, *rest)

    engine._can_overlap, engine._finish = _can_overlap, _finish
    return llm


def pair(make_llm, model, **kw):
    return make_llm(model, async_scheduling=False, **kw), counted(make_llm(model, async_scheduling=True, **kw))


def summary(outs):
    return [(o.request_id, o.prompt_token_ids, o.finished, o.num_cached_tokens, o.error,
             [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason, c.logprobs, c.cumulative_logprob)
              for c in o.outputs]) for o in outs]


def generate_both(sync, async_, prompts, params):
    outs = [llm.generate(prompts, params, use_tqdm=False) for llm in (sync, async_)]
    a, b = summary(outs[0]), summary(outs[1])
    for x, y in zip(a, b):
        assert x[1:] == y[1:], f"request {x[0]}: sync {x[1:]}\nasync {y[1:]}"
    return outs[0]


def mixed_workload(seed: int, count: int, stops: bool = True, max_len: int = 70):
    """Greedy and seeded random requests (filters, n=2, logprobs), some with stop tokens that hit often."""
    rng = random.Random(seed)
    prompts = [make_prompt(rng.randint(1, max_len), seed=seed * 100 + i) for i in range(count)]
    params = []
    for _ in prompts:
        params.append(SamplingParams(
            temperature=rng.choice([0.0, 0.7, 1.3]), top_k=rng.choice([0, 0, 20]), top_p=rng.choice([1.0, 0.9]),
            min_p=rng.choice([0.0, 0.0, 0.05]), seed=rng.choice([None, rng.randrange(10**6)]),
            max_tokens=rng.randint(1, 14), n=rng.choice([1, 1, 2]), logprobs=rng.choice([None, 0, 3]),
            ignore_eos=not stops or rng.random() < 0.5,
            stop_token_ids=rng.sample(range(2, VOCAB), rng.choice([0, 6, 12])) if stops else [],
        ))
    return token_prompts(prompts), params


# float64 of tiny and tiny_hc4 (slow): the same schedule in the other dtype; v41's float64 stays
@pytest.mark.parametrize("config, dtype", [
    pytest.param(c, d, marks=[pytest.mark.slow] if d == "float64" and c != "v41" else [])
    for c in ("tiny", "tiny_hc4", "v41") for d in ("float32", "float64")])
def test_length_limited_workload_overlaps_and_matches(tiny_path, make_llm, config, dtype):
    sync, async_ = pair(make_llm, tiny_path(config), dtype=dtype, max_num_batched_tokens=48)
    prompts, params = mixed_workload(1, 14, stops=False)
    generate_both(sync, async_, prompts, params)
    counts = async_.llm_engine.counts
    assert counts["overlapped"] > counts["drained"]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "batch_invariant"])
def test_stops_mid_batch(tiny_path, make_llm, dtype, batch_invariant):
    sync, async_ = pair(make_llm, tiny_path("tiny"), dtype=dtype, batch_invariant=batch_invariant)
    prompts, params = mixed_workload(2, 16)
    outs = generate_both(sync, async_, prompts, params)
    assert {c.finish_reason for o in outs for c in o.outputs} == {"stop", "length"}
    counts = async_.llm_engine.counts
    if batch_invariant:  # stops are overlapped: some sequences stopped with their next step launched
        assert counts["overlapped"] > 0 and counts["dropped"] > 0
    else:
        assert counts["dropped"] == 0


_STOPS: dict[str, str] = {}


def readable_stop(path) -> str:
    """A stop string the greedy output of the first test prompt contains (from a synchronous run)."""
    from deepinfer_core.entrypoints.llm import LLM

    if str(path) not in _STOPS:
        llm = LLM(str(path), block_size=16, dtype="float64")
        outs = llm.generate(token_prompts([make_prompt(9, seed=s) for s in range(6)]),
                            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        text = outs[0].outputs[0].text  # the first prompt's: the test's first request must stop on it
        _STOPS[str(path)] = text[len(text) // 2 : len(text) // 2 + 2]
    return _STOPS[str(path)]


@pytest.mark.parametrize("config, batch_invariant", [("tiny", False), ("tiny", True), ("v41", False)],
                         ids=["default", "batch_invariant", "v41"])
def test_stop_strings_eos_min_tokens_penalties_and_grammar(tiny_path, make_llm, config, batch_invariant):
    stop = readable_stop(tiny_path(config))
    sync, async_ = pair(make_llm, tiny_path(config), dtype="float32", batch_invariant=batch_invariant)
    prompts = token_prompts([make_prompt(9, seed=s) for s in range(6)] + [make_prompt(20, seed=40)] * 2)
    params = [SamplingParams(temperature=0, max_tokens=12, stop=[stop], ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=12, stop=[stop, "zz"]),
              SamplingParams(temperature=0.9, seed=4, max_tokens=10, min_tokens=6, stop_token_ids=[5, 9, 11]),
              SamplingParams(temperature=0, max_tokens=10, presence_penalty=1.0, frequency_penalty=0.5),
              SamplingParams(temperature=0.7, seed=5, max_tokens=8, repetition_penalty=1.3, logprobs=2),
              SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0.6, seed=6, max_tokens=10,
                             structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe"])),
              SamplingParams(temperature=0, max_tokens=7, n=2, ignore_eos=True)]
    outs = generate_both(sync, async_, prompts, params)
    assert outs[0].outputs[0].finish_reason == "stop" and outs[0].outputs[0].stop_reason == stop
    assert outs[6].outputs[0].text in ("yes", "no", "maybe")


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "batch_invariant"])
def test_penalised_requests_overlap_and_count_every_token(tiny_path, make_llm, batch_invariant):
    """A plain step's samples are counted into the penalty state on the device as they are drawn, so
    penalised requests no longer keep step N+1 waiting for N's tokens on the host; their outputs are
    the synchronous engine's (each penalty, greedy and seeded, a prompt repeated so counts build up)."""
    sync, async_ = pair(make_llm, tiny_path("tiny"), dtype="float64", batch_invariant=batch_invariant)
    prompts = token_prompts([make_prompt(n, seed=70 + n) for n in (3, 9, 17)] + [make_prompt(5, seed=1) * 4])
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, presence_penalty=1.5),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, frequency_penalty=0.9),
              SamplingParams(temperature=0.8, seed=7, max_tokens=22, ignore_eos=True, repetition_penalty=1.6),
              SamplingParams(temperature=0.6, seed=8, max_tokens=18, ignore_eos=True, presence_penalty=-0.5,
                             frequency_penalty=0.4, logprobs=2)]
    outs = generate_both(sync, async_, prompts, params)
    assert async_.llm_engine.counts["overlapped"] >= 20 and not async_.llm_engine.counts["drained"]
    counts = [len(o.outputs[0].token_ids) for o in outs]
    assert counts == [24, 20, 22, 18]


BUDGETS = {
    "chunk8": dict(max_num_batched_tokens=8),
    "chunk13-3seqs": dict(max_num_batched_tokens=13, max_num_seqs=3),
    "unchunked": dict(enable_chunked_prefill=False, max_num_batched_tokens=80),
}


# batch_invariant past chunk8 (slow): its kernels under the other budgets, which the default kernels already run
@pytest.mark.parametrize("batch_invariant, engine_args", [
    pytest.param(b, args, id=f"{'batch_invariant' if b else 'default'}-{name}",
                 marks=[pytest.mark.slow] if b and i else [])
    for b in (False, True) for i, (name, args) in enumerate(BUDGETS.items())])
def test_token_budgets_and_chunked_prefill(tiny_path, make_llm, engine_args, batch_invariant):
    sync, async_ = pair(make_llm, tiny_path("tiny"), dtype="float32", batch_invariant=batch_invariant, **engine_args)
    prompts, params = mixed_workload(3, 10, stops=batch_invariant)
    generate_both(sync, async_, prompts, params)
    assert async_.llm_engine.counts["overlapped"] > 0


@pytest.mark.parametrize("config, batch_invariant", [("tiny", False), ("tiny", True), ("v41", False)],
                         ids=["default", "batch_invariant", "v41"])
def test_preemption_with_a_tiny_pool(tiny_path, make_llm, config, batch_invariant):
    kw = dict(dtype="float64", batch_invariant=batch_invariant, num_blocks=10, num_window_blocks=8,
              max_num_batched_tokens=32)
    sync, async_ = pair(make_llm, tiny_path(config), **kw)
    prompts, params = mixed_workload(4, 12, stops=batch_invariant, max_len=60)
    params = [dataclasses.replace(p, max_tokens=16) for p in params]
    generate_both(sync, async_, prompts, params)
    assert sync.llm_engine.scheduler.num_preemptions > 0
    assert async_.llm_engine.scheduler.num_preemptions == sync.llm_engine.scheduler.num_preemptions
    counts = async_.llm_engine.counts
    assert counts["overlapped"] > 0 and counts["drained"] > 0


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "batch_invariant"])
def test_prefix_sharing(tiny_path, make_llm, batch_invariant):
    sync, async_ = pair(make_llm, tiny_path("tiny"), dtype="float32", batch_invariant=batch_invariant,
                        max_num_batched_tokens=40, num_blocks=24)
    rng = random.Random(5)
    base = make_prompt(80, seed=5)
    family = [base[:n] + make_prompt(rng.randrange(0, 5), 300 + n) for n in (3, 16, 17, 31, 32, 33, 48, 64, 80)]
    params = [SamplingParams(temperature=rng.choice([0.0, 0.8]), seed=7, max_tokens=rng.randint(2, 9),
                             ignore_eos=not batch_invariant, logprobs=2) for _ in family]
    first = generate_both(sync, async_, token_prompts(family), params)
    again = generate_both(sync, async_, token_prompts(family[::-1]), params[::-1])
    for p in family:  # one by one: each finds what the others left in the cache
        generate_both(sync, async_, token_prompts([p]), params[0])
    assert sum(o.num_cached_tokens for o in again) > sum(o.num_cached_tokens for o in first)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_default_model(make_llm, dtype):
    sync, async_ = pair(make_llm, None, dtype=dtype, block_size=128)
    prompts = ["def fibonacci(n):", "import torch\n", "class Stack:", "for i in range(10):"]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=1, max_tokens=10, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0.8, seed=2, max_tokens=16, n=2, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=8, stop=["\n"])]
    generate_both(sync, async_, prompts, params)
    assert async_.llm_engine.counts["overlapped"] > 0


def test_stream_matches_and_closing_it_aborts(tiny_path, make_llm):
    sync, async_ = pair(make_llm, tiny_path("tiny"), dtype="float64")
    prompt = {"prompt_token_ids": make_prompt(13, seed=8)}
    params = SamplingParams(temperature=0.9, seed=2, max_tokens=9, ignore_eos=True, logprobs=1)
    streams = [list(llm.stream(prompt, params)) for llm in (sync, async_)]
    assert summary(streams[0][-1:])[0][1:] == summary(streams[1][-1:])[0][1:]
    for seen in streams:  # growing, finished once, at the end
        assert [len(o.outputs[0].token_ids) for o in seen] == list(range(1, 10))
        assert [o.finished for o in seen] == [False] * 8 + [True]
    stream = async_.stream(prompt, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    next(stream), next(stream)
    stream.close()  # a step is in flight: its sample is dropped and the memory returned
    assert not async_.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("abort_after", [1, 2, 5])
def test_abort_while_a_step_is_in_flight(tiny_path, make_llm, abort_after):
    """The others' outputs do not change (batch-invariant: whatever the schedule), the aborted request
    reports nothing more, and every block comes back."""
    sync, async_ = pair(make_llm, tiny_path("tiny"), dtype="float32", batch_invariant=True)
    prompts, params = mixed_workload(6, 6)
    expected = summary(sync.generate(prompts, params, use_tqdm=False))
    engine = async_.llm_engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp)
    done, victim = {}, "r3"
    for _ in range(abort_after):
        for out in engine.step():
            done[out.request_id] = out
    if victim not in done or not done[victim].finished:
        assert engine._inflight is not None
        engine.abort_request(victim)
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id != victim
            done[out.request_id] = out
    for i, exp in enumerate(expected):
        if f"r{i}" != victim:
            assert summary([done[f"r{i}"]])[0][1:] == exp[1:]


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 10**6), count=st.integers(1, 12), budget=st.sampled_from([8, 24, 64, 256]),
       num_blocks=st.sampled_from([None, 14, 24]))
def test_random_workloads(tiny_path, make_llm, seed, count, budget, num_blocks):
    kw = dict(dtype="float32", batch_invariant=True, max_num_batched_tokens=budget)
    if num_blocks:
        kw.update(num_blocks=num_blocks, num_window_blocks=10)
    sync, async_ = pair(make_llm, tiny_path("tiny"), **kw)
    prompts, params = mixed_workload(seed, count, max_len=60)
    generate_both(sync, async_, prompts, params)

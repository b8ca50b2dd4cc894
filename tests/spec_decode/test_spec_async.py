"""Speculative decoding with async scheduling: step N+1 is scheduled while step N is in flight, its
sequences' spans (token of N and drafts) placeholders that the worker shifts by N's accepted drafts and
fills in. Greedy outputs equal those of speculation without async and of no speculation, token for
token (float64, cpu_ref), across the scenarios of ``test_spec_decode`` (chunked prefill, preemption,
aborts, prefix hits, stop tokens and strings, max_tokens inside a draft); seeded sampling gives the
outputs of synchronous speculation. Every async engine counts its overlapped steps, so a test also
proves that overlap happened.

The drafts are driven by an oracle on the worker's side (the engine's own copy of a sequence's drafts
is a placeholder while the step that proposed them is in flight). Between steps an async engine's
sequence may also hold the blocks its in-flight drafts write: the per-step memory check here allows
exactly those on top of ``engine_fixtures.check_every_step``'s.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

import engine_fixtures
import pytest
from engine_fixtures import greedy, make_prompt, run_tokens, token_prompts
from spec_fixtures import other_token, price_by_graphs, spec
from test_spec_decode import (
    CONFIGS,
    MAX_TOKENS,
    ORACLE_CASES,
    PROMPTS,
    VARIANTS,
    check_prefix_hits_on_speculated_outputs,
    check_the_others_unchanged,
    mixed,
    reference,
    run_with_aborts,
)

from deepinfer_core.entrypoints.llm import LLM
from deepinfer_core.sampling.params import SamplingParams, StructuredOutputsParams

make_llm = engine_fixtures.make_llm
one_torch_thread = engine_fixtures.one_torch_thread
tiny_path = engine_fixtures.tiny_path


def check_async_step(engine) -> None:
    """``check_every_step``'s books, allowing the window and compressed blocks of in-flight drafts; and
    count the steps overlapped (N+1 launched before N ended) and drained (N ended first)."""
    step, can_overlap = engine.step, engine._can_overlap
    engine.counts = {"overlapped": 0, "drained": 0}

    def _can_overlap(prev):
        ok = can_overlap(prev)
        engine.counts["overlapped" if ok else "drained"] += 1
        return ok

    def checked_step():
        outputs = step()
        bm = engine.block_manager
        bm.check_invariants()
        for seq in engine.scheduler.running:
            c, u, bs = seq.num_computed_tokens, seq.num_unresolved_drafts, bm.block_size
            held = {i for i, b in enumerate(seq.window_block_table) if b >= 0}
            assert held == set(range(max(0, c - bm.window + 1) // bs, -(-(c + u) // bs))), "window blocks"
            assert -(-c // bs) <= len(seq.block_table) <= -(-max(len(seq), c + u) // bs), "compressed blocks"
        return outputs

    engine._can_overlap, engine.step, engine._checked = _can_overlap, checked_step, True


@pytest.fixture
def make_async() -> Iterator[Callable[..., LLM]]:
    """``make_async(model, **engine_args)`` -> an LLM with async scheduling on cpu_ref, checked every step
    and drained at the end."""
    yield from engine_fixtures.llm_factory(check_async_step, async_scheduling=True)


def worker_oracle(llm: LLM, ref: dict, wrong: Callable[[object, int, int], bool] = lambda s, m, j: False) -> None:
    """``spec_fixtures.oracle_drafts`` at the worker: the drafts it proposes (and reports) are the
    reference continuation, draft ``j`` wrong where ``wrong(state, num_outputs, j)``."""
    engine = llm.llm_engine
    runner, vocab = engine.runner, engine.model_config.vocab_size
    output, k = runner._output, runner.k

    def patched(*args, **kwargs):
        out = output(*args, **kwargs)
        for i, seq_id in enumerate(out.seq_ids):
            if not out.draft_token_ids[i]:
                continue  # the plain path: no drafts
            state = runner.requests[seq_id]
            r, m = ref[tuple(state.prompt_token_ids)], len(state.output_token_ids)
            tokens = [r[m + j] if m + j < len(r) else 2 for j in range(k)]
            out.draft_token_ids[i] = [other_token(t, vocab) if wrong(state, m, j) else t
                                      for j, t in enumerate(tokens)]
            out.draft_confidences[i] = [0.9] * k
        return out

    runner._output = patched


def expected(ref, prompts, n=MAX_TOKENS):
    return [ref[tuple(p)][:n] for p in prompts]


# k=1 on tiny_hc4 and tiny_hc1 (slow): one draft runs on tiny; the other layouts run with k=3
@pytest.mark.parametrize("config, k", [(c, k) if c == "tiny" or k == 3 else pytest.param(c, k, marks=pytest.mark.slow)
                                       for k in (1, 3) for c in CONFIGS])
def test_mtp_drafts_async_greedy_equal(config, k, tiny_path, make_llm, make_async):
    path = tiny_path(config)
    ref = reference(make_llm, path, PROMPTS)
    sync = run_tokens(make_llm(path, dtype="float64", **spec(k)), PROMPTS, greedy(MAX_TOKENS))
    llm = make_async(path, dtype="float64", **spec(k))
    assert run_tokens(llm, PROMPTS, greedy(MAX_TOKENS)) == sync == expected(ref, PROMPTS)
    engine = llm.llm_engine
    assert engine.spec_decode_stats()["num_draft_tokens"] > 0
    assert engine.counts["overlapped"] > engine.counts["drained"]


# the confidence schedule past the first case is slow: its budgets change the drafts' count, not the crossings
@pytest.mark.parametrize("config, variant, schedule", [
    pytest.param(*case.values, schedule,
                 marks=[*case.marks, *([pytest.mark.slow] if schedule == "confidence" and i else [])])
    for schedule in ("fixed", "confidence") for i, case in enumerate(ORACLE_CASES)])
def test_oracle_drafts_async_greedy_equal(config, variant, schedule, tiny_path, make_llm, make_async):
    """Accepted and rejected drafts at every offset while the next step is already scheduled, through
    chunking and preemption."""
    path = tiny_path(config)
    ref = reference(make_llm, path, PROMPTS)
    llm = make_async(path, dtype="float64", **spec(3, schedule), **VARIANTS[variant])
    worker_oracle(llm, ref, mixed)
    assert run_tokens(llm, PROMPTS, greedy(MAX_TOKENS)) == expected(ref, PROMPTS)
    engine = llm.llm_engine
    stats = engine.spec_decode_stats()
    if schedule == "fixed":  # the confidence schedule's budgets follow measured step times: no fixed counts
        assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
        assert len(stats["accepted_per_position"]) == 3 and stats["accepted_per_position"][2] > 0
    assert engine.counts["overlapped"] > 0
    if variant.startswith("preempt") and schedule == "fixed":
        assert engine.scheduler.num_preemptions > 0 and engine.counts["drained"] > 0


# 1 to 5: the prefill's token and every offset of the first verification; 6 and 7 (slow) offsets 0 and 1 again
@pytest.mark.parametrize("max_tokens", [1, 2, 3, 4, 5, *(pytest.param(m, marks=pytest.mark.slow) for m in (6, 7))])
def test_max_tokens_inside_a_draft_async(max_tokens, tiny_path, make_llm, make_async):
    """All drafts right: the limit falls on every offset of a verification scheduled before the step
    before it ended (the worker drops the drafts past it)."""
    path = tiny_path("tiny")
    prompts = PROMPTS[:4]
    ref = reference(make_llm, path, prompts)
    llm = make_async(path, dtype="float64", **spec(3))
    worker_oracle(llm, ref)
    assert run_tokens(llm, prompts, greedy(max_tokens)) == expected(ref, prompts, max_tokens)


def test_stop_token_inside_accepted_drafts_async(tiny_path, make_llm, make_async):
    path = tiny_path("tiny")
    prompts = PROMPTS[4:8]
    ref = reference(make_llm, path, prompts)
    plain = make_llm(path, dtype="float64")
    llm = make_async(path, dtype="float64", **spec(3))
    worker_oracle(llm, ref)
    for i, p in enumerate(prompts):
        stop = ref[tuple(p)][3 + i]
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, stop_token_ids=[stop])
        want = plain.generate(token_prompts([p]), params, use_tqdm=False)[0].outputs[0]
        got = llm.generate(token_prompts([p]), params, use_tqdm=False)[0].outputs[0]
        assert (got.token_ids, got.finish_reason, got.stop_reason) == (
            want.token_ids, want.finish_reason, want.stop_reason)
        assert got.finish_reason == "stop"
    assert llm.llm_engine.counts["overlapped"] > 0


@pytest.mark.parametrize("abort_at", [(1, 2, 0, 3), (2, 3, 1, 5)])
def test_aborts_while_in_flight_leave_the_others_unchanged(abort_at, tiny_path, make_llm, make_async):
    path = tiny_path("tiny")
    ref = reference(make_llm, path, PROMPTS)
    llm = make_async(path, dtype="float64", **spec(2))
    worker_oracle(llm, ref, mixed)
    engine = llm.llm_engine
    rids = [engine.add_request(None, {"prompt_token_ids": p}, greedy(MAX_TOKENS)) for p in PROMPTS]
    aborted = dict(zip((rids[1], rids[5], rids[9], rids[15]), abort_at))
    inflight = []
    done = run_with_aborts(engine, aborted, lambda: inflight.append(engine._inflight is not None))
    check_the_others_unchanged(done, aborted, rids, ref)
    assert sum(inflight) > 0


def test_prefix_hits_on_speculated_outputs_async(tiny_path, make_llm, make_async):
    check_prefix_hits_on_speculated_outputs(make_llm, tiny_path("tiny"), make_async, worker_oracle)


def seeded_workload(seed: int, count: int):
    rng = random.Random(seed)
    prompts = [make_prompt(rng.randint(1, 60), seed=seed * 100 + i) for i in range(count)]
    params = [SamplingParams(temperature=rng.choice([0.0, 0.7, 1.3]), top_k=rng.choice([0, 20]),
                             top_p=rng.choice([1.0, 0.9]), min_p=rng.choice([0.0, 0.05]), seed=rng.randrange(10**6),
                             max_tokens=rng.randint(1, 14), ignore_eos=rng.random() < 0.5,
                             stop_token_ids=rng.sample(range(2, 384), rng.choice([0, 6])))
              for _ in prompts]
    return token_prompts(prompts), params


def outputs(outs):
    return [[(c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]


@pytest.mark.parametrize("engine_args", [{}, dict(max_num_batched_tokens=13)], ids=["default", "chunk13"])
def test_seeded_sampling_reproduces(engine_args, tiny_path, make_llm, make_async):
    """Seeded requests (temperature, top-k/top-p/min-p, stop tokens): the outputs of synchronous
    speculation, and the same again on a second async run."""
    path = tiny_path("tiny")
    prompts, params = seeded_workload(7, 12)
    ref = reference(make_llm, path, [p["prompt_token_ids"] for p in prompts], max_tokens=20)
    runs = []
    for make in (make_llm, make_async, make_async):
        llm = make(path, dtype="float64", **spec(2), **engine_args)
        worker_oracle(llm, ref, mixed)
        runs.append(outputs(llm.generate(prompts, params, use_tqdm=False)))
    assert runs[0] == runs[1] == runs[2]
    assert llm.llm_engine.counts["overlapped"] > 0 and llm.llm_engine.spec_decode_stats()["num_accepted_tokens"] > 0


def test_plain_path_requests_beside_speculated_ones_async(tiny_path, make_llm, make_async):
    """Penalties, grammars and min_tokens end the step in flight first; logprobs rows take the plain
    path with placeholders; all equal synchronous speculation (logprobs to float64 rounding)."""
    path = tiny_path("tiny")
    prompts = token_prompts(PROMPTS[8:13])
    params = [greedy(MAX_TOKENS, logprobs=2), greedy(MAX_TOKENS),
              SamplingParams(temperature=0.9, seed=3, max_tokens=MAX_TOKENS, presence_penalty=0.5),
              SamplingParams(temperature=0.6, seed=6, max_tokens=10,
                             structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe"])),
              SamplingParams(temperature=0.8, seed=4, max_tokens=MAX_TOKENS, min_tokens=4, stop_token_ids=[5, 9])]
    want = make_llm(path, dtype="float64", **spec(2)).generate(prompts, params, use_tqdm=False)
    llm = make_async(path, dtype="float64", **spec(2))
    got = llm.generate(prompts, params, use_tqdm=False)
    assert outputs(got) == outputs(want)
    for a, b in zip(want, got):
        for x, y in zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or []):
            assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-9 for t in x)
    assert got[1].spec_decode_stats["num_drafts"] > 0
    # only the logprobs row and the speculated one are left at the end: those steps overlap
    assert llm.llm_engine.counts["overlapped"] > 0 and llm.llm_engine.counts["drained"] > 0


def test_trained_model_async_greedy_equal_with_stop_strings(make_llm, make_async):
    """The trained default model's MTP layer (real acceptance), stop strings included."""
    plain = make_llm(None, dtype="float64", block_size=32)
    text = open("data/heldout_slice.txt").read()
    ids = plain.llm_engine.encode(text)
    prompts = [ids[i * 150: i * 150 + 60] for i in range(4)]
    ref = plain.generate(token_prompts(prompts), greedy(24), use_tqdm=False)
    words = [o.outputs[0].text.split() for o in ref]
    stop = next(w[len(w) // 2] for w in words if len(w) > 4)
    stopped = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    ref_stop = plain.generate(token_prompts(prompts), stopped, use_tqdm=False)
    llm = make_async(None, dtype="float64", block_size=32, **spec(2))
    outs = llm.generate(token_prompts(prompts), greedy(24), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert llm.llm_engine.spec_decode_stats()["mean_acceptance_length"] > 1.3
    got = llm.generate(token_prompts(prompts), stopped, use_tqdm=False)
    assert [(o.outputs[0].text, o.outputs[0].finish_reason) for o in got] == [
        (o.outputs[0].text, o.outputs[0].finish_reason) for o in ref_stop]
    assert llm.llm_engine.counts["overlapped"] > llm.llm_engine.counts["drained"]


def test_async_verifies_what_the_sync_engine_verifies_from_the_first_step(make_llm, make_async):
    """The step after a prompt's last chunk is scheduled before that chunk's drafts exist: placeholders stand
    for them, so it verifies them as the synchronous engine's first decode step does, rather than sampling
    one token and drafting a position behind ever after. The trained model, float64: every proposal's
    drafts and the verification counts are the synchronous engine's."""
    runs = {}
    for make in (make_llm, make_async):
        llm = make(None, dtype="float64", block_size=32, **spec(3))
        ids = llm.llm_engine.encode(open("data/heldout_slice.txt").read())
        prompts = [ids[i * 150: i * 150 + 40 + 9 * i] for i in range(4)]
        planner, seen = llm.llm_engine.drafts, []
        offer = planner.offer
        planner.offer = lambda seq, drafts, confs, offer=offer, seen=seen: (
            seen.append((seq.seq_id, list(drafts))) or offer(seq, drafts, confs))
        outs = llm.generate(token_prompts(prompts), greedy(30), use_tqdm=False)
        first = min(s for s, _ in seen)
        proposals = {}
        for seq, drafts in seen:
            proposals.setdefault(seq - first, []).append(drafts)
        runs[make is make_async] = ([o.outputs[0].token_ids for o in outs], proposals,
                                    llm.llm_engine.spec_decode_stats())
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] == runs[False][1]
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert runs[True][2][key] == runs[False][2][key], key


def test_graph_priced_confidence_steps_async_greedy_equal(make_llm, make_async):
    """Steps priced by graphs where a third draft never pays, planned while the step before is in flight
    (from its drafts' confidences): at most two drafts a sequence, one span a step, the plain outputs."""
    ids = make_llm(None, dtype="float64", block_size=32).llm_engine.encode(open("data/heldout_slice.txt").read())
    prompts = token_prompts([ids[i * 120: i * 120 + 50] for i in range(6)])
    ref = make_llm(None, dtype="float64", block_size=32).generate(prompts, greedy(20), use_tqdm=False)
    llm = make_async(None, dtype="float64", block_size=32, **spec(3, "confidence"))
    spans = price_by_graphs(llm, (1.0, 1.1, 1.2, 100.0))
    outs = llm.generate(prompts, greedy(20), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert max(map(max, spans)) == 2
    assert sum(len(set(step) - {0}) <= 1 for step in spans) >= len(spans) - 2
    assert llm.llm_engine.counts["overlapped"] > llm.llm_engine.counts["drained"]


@pytest.mark.parametrize("schedule", ["fixed", "confidence"])
def test_an_overlapped_step_plans_its_draft_budgets_once(schedule, tiny_path, make_llm, make_async):
    """The budgets planned for N+1 while N is in flight stand unless a sequence left in between (the plan,
    at a large batch a pass over every sequence's drafts, is host time of every speculative step)."""
    path = tiny_path("tiny")
    ref = reference(make_llm, path, PROMPTS)
    llm = make_async(path, dtype="float64", **spec(3, schedule))
    engine, calls = llm.llm_engine, {"plan": 0, "step": 0}
    plan, step = engine.drafts.plan, engine.step

    def counted(name, fn):
        def wrapper(*args):
            calls[name] += 1
            return fn(*args)
        return wrapper

    engine.drafts.plan, engine.step = counted("plan", plan), counted("step", step)
    assert run_tokens(llm, PROMPTS, greedy(MAX_TOKENS)) == expected(ref, PROMPTS)
    assert engine.counts["overlapped"] > 5
    assert calls["plan"] < 1.5 * calls["step"], (calls, engine.counts)  # twice a step before

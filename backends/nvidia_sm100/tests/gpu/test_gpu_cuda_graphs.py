"""CUDA graphs of the decode step on nvidia_sm100: every bucket size is captured, decode steps replay
them, and the tokens and logprobs follow the eager engine's (float32, the tiny checkpoints)."""

from __future__ import annotations

import warnings

import pytest
import torch
from gpu_support import BACKEND, TINY_MODELS, gpu_marks, make_prompt

from deepinfer_core.default_model import EMBEDDED_MODEL, v4_model_path
from deepinfer_core.entrypoints.llm import LLM
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.spec_decode.dspark_graph import DSparkGraphs

pytestmark = gpu_marks()

LENGTHS = [1, 5, 9, 16, 17, 33, 40, 63, 64, 70]
TOL = 1e-3


def _run(path, **kw):
    llm = LLM(str(path), backend=BACKEND, dtype="float32", block_size=16, max_num_seqs=16, **kw)
    graphs = llm.llm_engine.runner.graph_runner
    replays = []
    if graphs is not None:
        original = graphs.replay
        graphs.replay = lambda batch: replays.append(batch.padded_to) or original(batch)
    prompts = [{"prompt_token_ids": make_prompt(n, seed=i)} for i, n in enumerate(LENGTHS)]
    params = [SamplingParams(temperature=0, max_tokens=6 + 3 * i, logprobs=2) for i in range(len(LENGTHS))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0] for o in outs], graphs, replays


@pytest.mark.parametrize("name", TINY_MODELS)
def test_graphs_follow_eager(name, tiny_path):
    eager, none, _ = _run(tiny_path(name), enforce_eager=True)
    assert none is None
    graphs_out, graphs, replays = _run(tiny_path(name))
    assert sorted({n for n, _, _ in graphs.graphs}) == graphs.sizes == [1, 2, 4, 8, 16]
    assert {16, 8, 4, 2, 1} & set(replays) and len(replays) > 30, replays
    for e, g in zip(eager, graphs_out):
        for step, (te, tg, lp) in enumerate(zip(e.token_ids, g.token_ids, e.logprobs)):
            top = sorted(lp.values(), reverse=True)
            if te != tg:  # only a near-tie may flip
                assert top[0] - top[1] < TOL, (step, te, tg, top)
                break
            assert abs(g.logprobs[step][tg] - lp[te]) < TOL


def test_graph_bucket_padding_and_eager_fallback(tiny_path):
    """Batches above the largest captured size, and prefill steps, run eagerly in the same engine."""
    llm = LLM(str(tiny_path("tiny")), backend=BACKEND, dtype="float32", block_size=16, max_num_seqs=8,
              max_cudagraph_capture_size=4)
    graphs = llm.llm_engine.runner.graph_runner
    assert graphs.sizes == [1, 2, 4]
    prompts = [{"prompt_token_ids": make_prompt(n, seed=i)} for i, n in enumerate([3, 20, 7, 40, 11, 9])]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    ref = LLM(str(tiny_path("tiny")), backend=BACKEND, dtype="float32", block_size=16, max_num_seqs=8,
              enforce_eager=True).generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(outs, ref))
    assert same >= len(prompts) - 1


def make(**kw) -> LLM:
    """The trained tiny V4 (an MTP layer; the default is a V4.1) on the backend, float32."""
    return LLM(str(v4_model_path()), backend=BACKEND, dtype="float32", max_num_seqs=8, **kw)


def _trained_workload(max_tokens: int, maker=make):
    """Six held-out prompts, greedy requests of ``max_tokens`` and more, and the eager engine's tokens
    without speculation (``maker``: the engine's builder)."""
    plain = maker(enforce_eager=True)
    assert plain.llm_engine.runner.graph_runner is None
    ids = plain.llm_engine.encode(open("data/heldout_slice.txt").read())
    prompts = [{"prompt_token_ids": ids[i * 150: i * 150 + 40 + 7 * i]} for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=max_tokens + 4 * i, ignore_eos=True)
              for i in range(len(prompts))]
    return prompts, params, [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_steps_replay_verification_and_drafting_graphs(k):
    """The trained default model with MTP speculation: verification steps replay the 1 + k graphs (spans
    with fewer drafts filled up, the undo log saved inside them), drafting replays the MTP graphs, and the
    greedy tokens are those of the eager engine without speculation (all but near-ties in float32)."""
    prompts, params, ref = _trained_workload(24)
    llm = make(speculative_config={"method": "mtp", "num_speculative_tokens": k})
    runner = llm.llm_engine.runner
    graphs, drafting = runner.graph_runner, runner.proposer.graphs
    assert graphs is not None and graphs.query_lens == [1, 1 + k] and drafting is not None and drafting.graphs
    assert graphs.prologue is not None  # the verification graphs save the undo log
    verified, drafted = [], []
    replay = graphs.replay_step
    graphs.replay_step = lambda b: verified.append(b.num_tokens // b.padded_to) or replay(b)
    propose = drafting.propose
    drafting.propose = lambda *a: drafted.append(len(a[0])) or propose(*a)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert sum(a == b for a, b in zip(outs, ref)) >= len(prompts) - 1
    assert verified.count(1 + k) >= 5 and len(drafted) >= 5, (verified, drafted)
    stats = llm.llm_engine.spec_decode_stats()
    assert stats["mean_acceptance_length"] > 1.2, stats


def test_penalised_requests_and_logprobs_speculate_through_the_graphs():
    """Penalised requests and requests with logprobs verify drafts (the penalties and logprobs applied to
    the graphs' verification rows), drafting on the device after them: the greedy tokens are the eager
    engine's without speculation (all but near-ties in float32) and so are the logprobs, to TOL."""
    plain = make(enforce_eager=True)
    ids = plain.llm_engine.encode(open("data/heldout_slice.txt").read())
    prompts = [{"prompt_token_ids": ids[i * 150: i * 150 + 40 + 7 * i]} for i in range(4)]
    extra = [dict(repetition_penalty=1.3), dict(logprobs=2), dict(frequency_penalty=0.8, logprobs=1), {}]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **e) for e in extra]
    ref = [o.outputs[0] for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = make(speculative_config={"method": "mtp", "num_speculative_tokens": 3}, async_scheduling=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    same = 0
    for out, want in zip(outs, ref):
        got = out.outputs[0]
        same += got.token_ids == want.token_ids
        assert out.spec_decode_stats["num_accepted_tokens"] > 0, out.spec_decode_stats
        for step, (a, b) in enumerate(zip(got.token_ids, want.token_ids)):
            if a != b:
                break
            if want.logprobs is not None:
                assert abs(got.logprobs[step][a] - want.logprobs[step][b]) < TOL, step
    assert same >= len(prompts) - 1


def test_penalised_requests_overlap_plain_graph_steps():
    """Plain decode through the graphs with async scheduling: penalised requests (their samples counted
    into the penalty state on the device as they are drawn) overlap their steps, and every request's
    tokens are the synchronous engine's, bit for bit."""
    ids = make(enforce_eager=True).llm_engine.encode(open("data/heldout_slice.txt").read())
    prompts = [{"prompt_token_ids": ids[i * 150: i * 150 + 30 + 9 * i]} for i in range(4)]
    extra = [dict(presence_penalty=1.2), dict(frequency_penalty=0.8, logprobs=1),
             dict(temperature=0.8, seed=3, repetition_penalty=1.4), {}]
    params = [SamplingParams(**({"temperature": 0} | e), max_tokens=32, ignore_eos=True) for e in extra]
    sync = [o.outputs[0] for o in make().generate(prompts, params, use_tqdm=False)]
    llm = make(async_scheduling=True)
    engine, overlapped = llm.llm_engine, []
    can_overlap = engine._can_overlap
    engine._can_overlap = lambda prev: overlapped.append(can_overlap(prev)) or overlapped[-1]
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in outs] == [o.token_ids for o in sync]
    assert [o.logprobs for o in outs] == [o.logprobs for o in sync]
    assert sum(overlapped) >= 28


def test_chained_speculative_steps_on_the_device():
    """Async scheduling with MTP speculation (k = 3): greedy verification steps launch while the step
    before is in flight, laid out on the device from its result. The tokens and the acceptance counts are
    those of the same engine when each step waits for the one before, and the eager engine's without
    speculation (all but near-ties in float32)."""
    prompts, params, ref = _trained_workload(40)
    runs = {}
    for chain in (False, True):
        llm = make(speculative_config={"method": "mtp", "num_speculative_tokens": 3}, async_scheduling=True)
        runner, count = llm.llm_engine.runner, []
        chained = runner._execute_chained
        runner._execute_chained = lambda so, chained=chained, count=count: count.append(so) or chained(so)
        if not chain:
            runner._chains = lambda so: False
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        runs[chain] = (outs, len(count), llm.llm_engine.spec_decode_stats())
    assert runs[False][1] == 0 and runs[True][1] >= 10, runs[True][1]
    assert runs[True][0] == runs[False][0]
    assert runs[True][2]["num_accepted_tokens"] == runs[False][2]["num_accepted_tokens"] > 0
    assert sum(a == b for a, b in zip(runs[True][0], ref)) >= len(prompts) - 1


def test_chained_steps_go_on_past_finishing_sequences():
    """A chained step launches in the step after a sequence finished (its ``max_tokens`` or a stop token
    reached): the step before, still in flight, holds the finished sequence, which is forgotten once that
    step's output is in. The tokens are those of the engine when each step waits for the one before."""
    prompts, params, ref = _trained_workload(24)
    stops = [dict(stop_token_ids=[ref[1][14]]), dict(stop_token_ids=[ref[4][25]])]
    params[1], params[4] = (SamplingParams(temperature=0, max_tokens=p.max_tokens, ignore_eos=True, **s)
                            for p, s in zip((params[1], params[4]), stops))
    runs = {}
    for chain in (False, True):
        llm = make(speculative_config={"method": "mtp", "num_speculative_tokens": 3}, async_scheduling=True)
        runner, across = llm.llm_engine.runner, []
        chained = runner._execute_chained

        def launch(so, chained=chained, runner=runner, across=across):
            across.append(bool(set(so.finished_seq_ids) & set(runner._chain.rows)))
            return chained(so)

        runner._execute_chained = launch
        if not chain:
            runner._chains = lambda so: False
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        runs[chain] = (outs, across)
    assert runs[False][1] == [] and sum(runs[True][1]) >= 2, runs[True][1]
    assert runs[True][0] == runs[False][0]
    assert len(runs[True][0][1]) < params[1].max_tokens and len(runs[True][0][4]) < params[4].max_tokens
    assert sum(b[: len(a)] == a for a, b in zip(runs[True][0], ref)) >= len(prompts) - 1


def test_confidence_scheduling_replays_a_graph_of_every_verification_length():
    """Confidence scheduling captures a verification graph of every 1 + j tokens (k = 3); with the draft
    budgets capped at 1 and 2 in turn, chained steps replay the 2- and 3-token graphs, and the tokens are
    those of the same engine when each step waits for the one before."""
    prompts, params, ref = _trained_workload(40)
    runs = {}
    for chain in (False, True):
        llm = make(speculative_config={"method": "mtp", "num_speculative_tokens": 3, "schedule": "confidence"},
                   async_scheduling=True)
        engine, runner, lengths = llm.llm_engine, llm.llm_engine.runner, []
        assert runner.graph_runner.query_lens == [1, 2, 3, 4]
        engine.drafts.gate = None  # speculate in every step
        plan, turn = engine.drafts.plan, [0]

        def capped(scheduler, config, plan=plan, turn=turn):
            plan(scheduler, config)
            turn[0] += 1
            for seq in scheduler.running:
                seq.draft_budget = min(seq.draft_budget, (1, 2, 2)[turn[0] % 3])

        engine.drafts.plan = capped
        chained = runner._execute_chained
        runner._execute_chained = (lambda so, chained=chained, runner=runner, lengths=lengths:
                                   lengths.append(runner._chained_query_len(so.scheduled)) or chained(so))
        if not chain:
            runner._chains = lambda so: False
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        runs[chain] = (outs, set(lengths))
    assert runs[False][1] == set() and {2, 3} <= runs[True][1], runs[True][1]
    assert runs[True][0] == runs[False][0]
    assert sum(a == b for a, b in zip(runs[True][0], ref)) >= len(prompts) - 1


def test_chained_sampled_steps_queue_without_waiting():
    """Seeded sampled requests (temperature with top-k, top-p and min-p; two penalised) chain as greedy ones
    do: their tokens are those of the same engine when each step waits for the one before, and launching a
    chained step makes no call that waits for the device (torch's sync debug mode reports none)."""
    prompts, _, _ = _trained_workload(40)
    params = [SamplingParams(temperature=0.9, top_p=0.95 if i % 2 else 1.0, top_k=40 if i % 3 == 0 else 0,
                             min_p=0.02 if i == 4 else 0.0, seed=100 + i, max_tokens=40 + 4 * i, ignore_eos=True,
                             presence_penalty=0.6 if i in (1, 2) else 0.0, repetition_penalty=1.2 if i == 2 else 1.0)
              for i in range(len(prompts))]
    runs = {}
    for chain in (False, True):
        llm = make(speculative_config={"method": "mtp", "num_speculative_tokens": 3}, async_scheduling=True)
        runner, count, syncs = llm.llm_engine.runner, [], []
        chained = runner._execute_chained

        def launch(so, chained=chained, count=count, syncs=syncs):
            count.append(so)
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as seen:
                    warnings.simplefilter("always")
                    return chained(so)
            finally:
                torch.cuda.set_sync_debug_mode(0)
                syncs.extend(str(w.message) for w in seen if "synchroniz" in str(w.message).lower())

        runner._execute_chained = launch
        if not chain:
            runner._chains = lambda so: False
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        runs[chain] = (outs, len(count), syncs, llm.llm_engine.spec_decode_stats())
    assert runs[False][1] == 0 and runs[True][1] >= 10, runs[True][1]
    assert runs[True][2] == [], runs[True][2][:3]
    assert runs[True][0] == runs[False][0]
    stats = runs[True][3]
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"], stats


def make_v41(**kw) -> LLM:
    """The embedded trained V4.1 (Engram, three DSpark stages) on the backend, float32."""
    return LLM(str(EMBEDDED_MODEL), backend=BACKEND, dtype="float32", max_num_seqs=8, **kw)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_dspark_greedy_with_graphs_equals_eager(k, async_scheduling):
    """The embedded V4.1 with DSpark speculation: verification steps replay the 1 + k graphs (their Engram
    n-gram histories in the static inputs), drafting replays the DSpark graphs (ring seeding and one pass
    over the stages), with async scheduling steps chain on the device; the greedy tokens are those of the
    eager engine with DSpark and of the eager engine without speculation (all but near-ties in float32)."""
    prompts, params, ref = _trained_workload(24, make_v41)
    spec = {"method": "dspark", "num_speculative_tokens": k}
    eager = make_v41(enforce_eager=True, speculative_config=spec)
    eager_outs = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    llm = make_v41(speculative_config=spec, async_scheduling=async_scheduling)
    runner = llm.llm_engine.runner
    graphs, drafting = runner.graph_runner, runner.proposer.graphs
    # no graphs here means an op of the model waits for the host: the engine's warning names it
    assert graphs is not None and graphs.ngram > 0 and graphs.query_lens == [1, 1 + k]
    assert isinstance(drafting, DSparkGraphs) and drafting.graphs and drafting.derive_graphs
    verified, drafted, chained = [], [], []
    replay = graphs.replay_step
    graphs.replay_step = lambda b: verified.append(b.num_tokens // b.padded_to) or replay(b)
    propose = drafting.propose
    drafting.propose = lambda *a: drafted.append(len(a[0])) or propose(*a)
    execute_chained = runner._execute_chained
    runner._execute_chained = lambda so: chained.append(so) or execute_chained(so)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert verified.count(1 + k) >= 5 and len(drafted) >= 5, (verified, drafted)
    assert len(chained) >= 5 if async_scheduling else not chained, len(chained)
    assert sum(a == b for a, b in zip(outs, eager_outs)) >= len(prompts) - 1
    assert sum(a == b for a, b in zip(outs, ref)) >= len(prompts) - 1
    stats = llm.llm_engine.spec_decode_stats()
    assert stats["num_accepted_tokens"] > 0, stats

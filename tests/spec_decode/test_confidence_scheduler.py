"""Confidence scheduling (DSpark's algorithm 1) and the speculative decoding counters."""

from __future__ import annotations

import random

import engine_fixtures
import pytest
from engine_fixtures import token_prompts
from spec_fixtures import price_by_graphs, spec

from deepinfer_core.spec_decode.confidence import (
    AcceptanceCalibrator,
    Candidate,
    ConfidenceScheduler,
    StepProfile,
    StepTimeModel,
)
from deepinfer_core.spec_decode.metrics import SpecDecodeStats

make_llm = engine_fixtures.make_llm
one_torch_thread = engine_fixtures.one_torch_thread


def linear_time(fixed: float, per_token: float, sizes=(1, 4, 16, 64, 256, 1024)) -> StepTimeModel:
    model = StepTimeModel()
    for n in sizes:
        model.observe(n, fixed + per_token * n)
    return model


def test_step_time_model_interpolates_and_extrapolates():
    model = linear_time(0.01, 0.001)
    assert model.seconds(10) == pytest.approx(0.02)
    assert model.seconds(2048) == pytest.approx(0.01 + 0.001 * 2048)
    assert StepTimeModel().seconds(100) == StepTimeModel().seconds(1)  # nothing measured: flat


def test_steps_are_priced_by_the_curve_of_their_batch_size():
    """Speculative steps of 8 sequences cost the same whatever their drafts (the device is not full);
    plain steps of 32 sequences, also 32 tokens, cost more. A step of 8 is priced by its own curve once
    it has two token buckets, so it verifies every draft; the curve over all steps, which mixes the two
    sizes, prices each draft as if it were a sequence and admits fewer."""
    steps = [(32, 0.5, 32)] + [(tokens, 0.2, 8) for tokens in (8, 16, 32)]
    model, mixed = StepTimeModel(), StepTimeModel()
    for _ in range(5):
        for tokens, seconds, seqs in steps:
            model.observe(tokens, seconds, num_seqs=seqs)
            mixed.observe(tokens, seconds)  # the same steps, without their batch sizes
    assert model.seconds(32, 8) == pytest.approx(0.2)
    assert model.seconds(32, 16) == model.seconds(32) == mixed.seconds(32) > 0.3  # no curve of 16: all steps'
    cands = [Candidate(i, [0.8, 0.8, 0.8], 3) for i in range(8)]
    assert sum(trusting(step_time=model).plan(cands, 8, 8, batch=8).values()) == 24
    assert sum(trusting(step_time=mixed).plan(cands, 8, 8, batch=8).values()) < 24


def trusting(**kwargs) -> ConfidenceScheduler:
    """A scheduler whose calibrator trusts the confidences from the start (no optimistic first tests)."""
    return ConfidenceScheduler(calibrator=AcceptanceCalibrator(min_tests=0), **kwargs)


def test_calibration_follows_measured_acceptance():
    cal = AcceptanceCalibrator(min_tests=0)
    assert cal.estimate(0.95) == pytest.approx(0.95)  # the prior trusts the confidence
    for _ in range(200):  # confident drafts that are accepted only half the time
        cal.observe([0.95, 0.95], 1)
    assert cal.estimate(0.95) == pytest.approx(0.5, abs=0.05)
    assert cal.tested[9] == 400  # both drafts were tested: the first passed


def admitted(scheduler: ConfidenceScheduler, num_seqs: int, confidences: list[float]) -> int:
    cands = [Candidate(i, confidences, len(confidences)) for i in range(num_seqs)]
    return sum(scheduler.plan(cands, num_seqs, num_seqs).values())


def test_large_batches_verify_fewer_drafts_per_sequence():
    """A fixed cost per step and a cost per token: one user verifies all its drafts, a batch of 256
    only its likeliest ones."""
    scheduler = trusting(step_time=linear_time(0.02, 0.0002))
    confs = [0.9, 0.8, 0.7, 0.6]
    per_seq = [admitted(scheduler, n, confs) / n for n in (1, 8, 64, 256)]
    assert per_seq[0] == 4
    assert per_seq == sorted(per_seq, reverse=True) and per_seq[-1] < 2, per_seq


def test_pairs_are_admitted_by_survival():
    scheduler = trusting(step_time=linear_time(0.01, 0.001))
    cands = [Candidate(0, [0.95, 0.95, 0.95], 3), Candidate(1, [0.3, 0.9, 0.9], 3), Candidate(2, [0.9], 0)]
    plan = scheduler.plan(cands, 3, 3)
    assert plan[0] >= plan[1] and plan[2] == 0  # no room: nothing, whatever the confidence
    assert plan[0] == 3 and plan[1] <= 1


def graph_profile(ratio_of: dict[int, float], sizes=(1, 2, 4, 8, 16, 32, 64), k: int = 3) -> StepProfile:
    """Graphs of 1 and 1 + k tokens per sequence; the verification graph of size n costs ``ratio_of[n]``
    times the decode graph (1 ms + 10 us per sequence)."""
    seconds = {}
    for n in sizes:
        seconds[n, 1] = 1e-3 + 1e-5 * n
        seconds[n, 1 + k] = seconds[n, 1] * ratio_of.get(n, 1.5)
    return StepProfile(seconds)


def best_prefix(sched: ConfidenceScheduler, candidates, base_tokens, base_accepted, max_tokens, num_seqs, batch):
    """Algorithm 1 spelt out: pairs by descending survival, each priced afresh, the best rate's prefix."""
    pairs = sorted((-s, j, c.key) for c in candidates for j, s in enumerate(sched.survival(c.confidences[:c.room])))
    curve = sched.step_time.curve(batch)

    def seconds(tokens, longest):
        graph = sched.profile.lookup(num_seqs, longest) if sched.profile is not None and num_seqs else None
        return curve(tokens) if graph is None else graph

    tokens, expected, longest, taken = max(1, base_tokens), base_accepted, 1, []
    best, best_len = expected / seconds(tokens, longest), 0
    for neg_s, j, key in pairs:
        if max_tokens is not None and tokens + 1 > max_tokens:
            break
        tokens, expected, longest = tokens + 1, expected - neg_s, max(longest, j + 2)
        taken.append(key)
        if expected / seconds(tokens, longest) > best:
            best, best_len = expected / seconds(tokens, longest), len(taken)
    return {c.key: taken[:best_len].count(c.key) for c in candidates}


def randomly_calibrated(rng: random.Random, k: int) -> ConfidenceScheduler:
    """A scheduler after up to 120 random verifications of ``k`` drafts."""
    sched = ConfidenceScheduler()
    for _ in range(rng.randint(0, 120)):
        sched.observe_verification([rng.random() for _ in range(k)], rng.randint(0, k))
    return sched


def test_plan_admits_the_best_prefix_by_survival_on_random_steps():
    """Steps of 1 to 70 sequences, graphs of some span lengths or none, a token cap or not: the plan (which
    prices a graph step once per longest span) admits what pricing every prefix afresh admits."""
    rng = random.Random(5)
    for _ in range(400):
        k, n = rng.randint(1, 4), rng.randint(1, 70)
        sched = randomly_calibrated(rng, k)
        for _ in range(rng.randint(0, 12)):
            sched.observe_step(rng.randint(1, 300), rng.random() * 1e-2, rng.choice([None, rng.randint(1, 64)]))
        if rng.random() < 0.6:
            lengths = [q for q in range(1, k + 2) if rng.random() < 0.85]
            sched.profile = StepProfile({(s, q): 1e-3 * (1 + 0.01 * s * q + 0.1 * rng.random())
                                         for s in (1, 2, 4, 8, 16, 32, 64) for q in lengths})
        cands = [Candidate(i, [rng.random() for _ in range(rng.randint(0, k))], rng.randint(0, k)) for i in range(n)]
        base = n + (rng.randint(0, 100) if rng.random() < 0.3 else 0)
        args = (base, n, rng.choice([None, base + rng.randint(-2, 3 * n)]), rng.choice([None, n]), n)
        assert sched.plan(cands, *args[:3], num_seqs=args[3], batch=args[4]) == best_prefix(sched, cands, *args)


def test_step_profile_finds_the_graph_a_step_pads_to():
    profile = graph_profile({})
    assert profile.lookup(3, 2) == profile.seconds[4, 4]  # 3 sequences, 1 draft: the (4, 1 + 3) graph
    assert profile.lookup(64, 1) == profile.seconds[64, 1]
    assert profile.lookup(65, 1) is None and profile.lookup(1, 5) is None  # eager: no graph holds it


def test_graph_steps_verify_every_draft_worth_anything_or_none():
    """In a graph a draft costs what the longest costs: a small batch, where the 1 + k graph costs little
    more, verifies every draft, the unlikely ones too (the padding would cost the same); a batch whose
    verification graph costs more than the drafts can return verifies none. Stopping at the first
    draft that lowers the rate would verify none in both."""
    scheduler = trusting(profile=graph_profile({1: 1.3, 2: 1.3, 64: 3.6}))
    sure, unsure = [0.9, 0.8, 0.7], [0.2, 0.2, 0.2]
    assert scheduler.plan([Candidate(0, sure, 3), Candidate(1, unsure, 3)], 2, 2, num_seqs=2) == {0: 3, 1: 3}
    assert scheduler.plan([Candidate(0, sure, 3)], 1, 1, num_seqs=1) == {0: 3}
    assert scheduler.plan([Candidate(0, [0.9], 1)], 1, 1, num_seqs=1) == {0: 1}  # 1.9 tokens for 1.3x
    cands = [Candidate(i, sure, 3) for i in range(64)]
    assert sum(scheduler.plan(cands, 64, 64, num_seqs=64).values()) == 0  # 3.4 tokens at most for 3.6x


def test_with_a_graph_of_every_length_a_large_batch_verifies_fewer_drafts():
    """Graphs of every 1 + j tokens (confidence scheduling's): at batch 64, where each token a sequence costs
    0.3 of a decode step, the first two drafts pay (0.9 and 0.54 of a token each) and the third (0.16)
    does not; one user, whose 1 + j graphs cost little more than a decode, verifies all three."""
    seconds = {}
    for n, per_token in ((1, 0.05), (64, 0.3)):
        for q in range(1, 5):
            seconds[n, q] = 1e-3 * (1 + per_token * (q - 1))
    scheduler = trusting(profile=StepProfile(seconds))
    cands = [Candidate(i, [0.9, 0.6, 0.3], 3) for i in range(64)]
    assert set(scheduler.plan(cands, 64, 64, num_seqs=64).values()) == {2}
    assert scheduler.plan(cands[:1], 1, 1, num_seqs=1) == {0: 3}
    confs = [c.confidences for c in cands]
    assert scheduler.best_span(confs, [3] * 64) == 2 and scheduler.best_span(confs[:1], [3]) == 3
    only_ends = trusting(profile=StepProfile({key: t for key, t in seconds.items() if key[1] in (1, 4)}))
    # graphs of 1 and 1 + 3 tokens only: all three drafts or none; all three give 88 tokens a ms (plain decode
    # 64), where two drafts in a graph of their own give 98
    assert set(only_ends.plan(cands, 64, 64, num_seqs=64).values()) == {3}


def span_rate(sched: ConfidenceScheduler, candidates, span: int) -> float:
    """Estimated accepted tokens per second of an all-decode graph step verifying every usable draft up to
    ``span`` (sequences with no candidate still decode)."""
    n = len(candidates)
    expected = n + sum(sum(sched.survival(c.confidences[:min(c.room, span)])) for c in candidates)
    return expected / sched.profile.lookup(n, 1 + span)


def plan_rate(sched: ConfidenceScheduler, candidates, plan: dict[int, int]) -> float:
    n, longest = len(candidates), 1 + max(plan.values(), default=0)
    expected = n + sum(sum(sched.survival(c.confidences[:plan[c.key]])) for c in candidates)
    return expected / sched.profile.lookup(n, longest)


def test_best_span_is_the_best_rate_and_beats_every_prefix_by_survival():
    """Random graph steps: the span ``best_span`` picks has the best estimated rate of the k + 1 spans (the
    first on ties, none unless it beats plain decode), and no admission of algorithm 1 priced by the
    same graphs does better."""
    rng = random.Random(11)
    for _ in range(300):
        k, n = rng.randint(1, 4), rng.randint(1, 64)
        sched = randomly_calibrated(rng, k)
        sched.profile = StepProfile({(s, q): 1e-3 * (1 + 0.01 * s * q + 0.2 * rng.random())
                                     for s in (1, 2, 4, 8, 16, 32, 64) for q in range(1, k + 2)})
        cands = [Candidate(i, [rng.random() for _ in range(rng.randint(0, k))], rng.randint(0, k)) for i in range(n)]
        span = sched.best_span([c.confidences for c in cands], [c.room for c in cands])
        usable = max((min(c.room, len(c.confidences)) for c in cands), default=0)
        rates = [span_rate(sched, cands, j) for j in range(k + 1)]
        best = max(range(usable + 1), key=lambda j: (rates[j], -j))
        assert span == best or (rates[span] == rates[best] and span <= usable), (span, best, rates)
        prefix = sched.plan(cands, n, n, num_seqs=n, batch=n)
        assert plan_rate(sched, cands, prefix) <= rates[span] * (1 + 1e-12)


def test_best_span_leaves_steps_no_graph_holds_to_the_plan():
    sched = trusting(profile=graph_profile({}, sizes=(1, 2, 4)))
    confs, rooms = [[0.9, 0.8, 0.7]] * 8, [3] * 8
    assert sched.best_span(confs[:4], rooms[:4]) == 3
    assert sched.best_span(confs, rooms) is None  # more sequences than the largest graph
    assert sched.best_span(confs[:4], rooms[:4], max_tokens=15) is None  # 16 tokens: over the step's cap
    assert sched.best_span(confs[:4], [0] * 4) == 0
    assert trusting().best_span(confs, rooms) is None  # no graphs at all


def test_steps_no_graph_holds_are_priced_by_the_learnt_curve():
    """A step with prefill chunks (``num_seqs`` None) or more sequences than the largest graph is priced
    by tokens, as learnt from the steps run: the likeliest drafts only."""
    scheduler = trusting(step_time=linear_time(0.05, 0.001), profile=graph_profile({}))
    cands = [Candidate(i, [0.9, 0.3], 2) for i in range(100)]
    for num_seqs in (None, 100):
        plan = scheduler.plan(cands, 100, 100, num_seqs=num_seqs)
        assert set(plan.values()) == {1}, plan  # 0.95 of a token for an extra token, not 0.33


def test_drafts_whose_confidence_understates_them_are_tested_and_kept():
    """Drafts of confidence 0.02 accepted 70% of the time: a scheduler that trusted the confidence would
    never verify them, and never learn; untested bins estimate 1, so they are verified, calibrated and,
    as they pay at batch 1 (the 1 + k graph costs 1.3x), verified on."""
    scheduler = ConfidenceScheduler(profile=graph_profile({1: 1.3}))
    assert trusting(profile=graph_profile({1: 1.3})).plan([Candidate(0, [0.02] * 3, 3)], 1, 1, num_seqs=1) == {0: 0}
    rng = random.Random(0)
    plans = []
    for _ in range(200):
        plans.append(scheduler.plan([Candidate(0, [0.02] * 3, 3)], 1, 1, num_seqs=1)[0])
        accepted = 0
        while accepted < plans[-1] and rng.random() < 0.7:
            accepted += 1
        scheduler.observe_verification([0.02] * plans[-1], accepted)
    assert scheduler.calibrator.estimate(0.02) == pytest.approx(0.7, abs=0.06)
    assert set(plans) == {3}


def test_stats_count_positions():
    s = SpecDecodeStats()
    s.observe(3, 1)
    s.observe(2, 2)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (2, 5, 3)
    assert s.accepted_per_position == [2, 1, 0] and s.verified_per_position == [2, 2, 1]
    assert s.mean_acceptance_length == pytest.approx(2.5)


def heldout_greedy(make_llm, num_prompts: int, max_tokens: int):
    """Prompts of 50 held-out tokens, greedy params and the trained model's outputs without speculation."""
    plain = make_llm(None, dtype="float64", block_size=32)
    ids = plain.llm_engine.encode(open("data/heldout_slice.txt").read())
    prompts = [ids[i * 120: i * 120 + 50] for i in range(num_prompts)]
    params = engine_fixtures.greedy(max_tokens)
    ref = [o.outputs[0].token_ids for o in plain.generate(token_prompts(prompts), params, use_tqdm=False)]
    return prompts, params, ref


def test_confidence_scheduled_engine_is_greedy_equal_and_counts(make_llm):
    prompts, params, ref = heldout_greedy(make_llm, 6, 20)
    llm = make_llm(None, dtype="float64", block_size=32, **spec(3, "confidence"))
    outs = llm.generate(token_prompts(prompts), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    engine = llm.llm_engine.spec_decode_stats()
    assert engine["num_accepted_tokens"] > 0
    assert engine["num_draft_tokens"] <= engine["num_proposed_tokens"]
    total = SpecDecodeStats()
    for o in outs:
        r = o.spec_decode_stats
        total.num_drafts += r["num_drafts"]
        total.num_draft_tokens += r["num_draft_tokens"]
        total.num_accepted_tokens += r["num_accepted_tokens"]
        assert len(o.outputs[0].token_ids) == 20
    assert (total.num_drafts, total.num_draft_tokens, total.num_accepted_tokens) == (
        engine["num_drafts"], engine["num_draft_tokens"], engine["num_accepted_tokens"])
    cal = llm.llm_engine.drafts.confidence.calibrator
    assert sum(cal.tested) > 0  # calibrated online from the verifications


def test_graph_priced_steps_verify_one_span_and_stay_greedy_equal(make_llm):
    """With graphs priced so that a third draft never pays, every all-decode step verifies at most two drafts
    a sequence, and each step the same number for all (one span: the graph pads to the longest anyway)."""
    prompts, params, ref = heldout_greedy(make_llm, 6, 20)
    llm = make_llm(None, dtype="float64", block_size=32, **spec(3, "confidence"))
    spans = price_by_graphs(llm, (1.0, 1.1, 1.2, 100.0))
    outs = llm.generate(token_prompts(prompts), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert max(map(max, spans)) == 2 and sum(max(step) == 2 for step in spans) >= 2
    assert sum(len(set(step)) == 1 for step in spans) >= len(spans) - 2  # the last steps hit max_tokens


def test_requests_queued_behind_a_full_batch_leave_its_drafts_alone(make_llm):
    """Under load the batch is full and requests wait: they cannot join the step, so their prompts do not
    count against its token budget. Counted in (here two prompts of 50 tokens against 96), they left no
    room for a single draft."""
    prompts, params, ref = heldout_greedy(make_llm, 8, 12)
    llm = make_llm(None, dtype="float64", block_size=32, max_num_seqs=2, max_num_batched_tokens=96,
                   **spec(3, "confidence"))
    engine, queued = llm.llm_engine, []
    engine.drafts.gate.decide = lambda num_decoding, decode_only=True: True  # no plain steps
    execute = engine.runner.execute_model

    def record(so):
        decodes = all(s.sample and len(s.token_ids) == 1 + s.num_drafts for s in so.scheduled)
        if engine.scheduler.waiting and decodes:
            queued.append(sum(s.num_drafts for s in so.scheduled))
        return execute(so)

    engine.runner.execute_model = record
    outs = llm.generate(token_prompts(prompts), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert len(queued) > 10 and sum(map(bool, queued)) >= len(queued) - 1


def test_a_pipelined_step_is_timed_from_the_previous_output():
    """With async scheduling a step is launched while the one before runs: its time for the step-time
    curve is from the previous step's output (or its launch, if later), not from its own launch; the
    last step of a pipeline (launched while the one before ran, nothing launched after it) is not timed,
    and a step launched after the previous output is timed from its launch."""
    from deepinfer_core.spec_decode.config import SpeculativeConfig
    from deepinfer_core.spec_decode.drafts import DraftPlanner

    planner = DraftPlanner(SpeculativeConfig(num_speculative_tokens=2, schedule="confidence"))
    model = planner.confidence.step_time
    planner.observe_step(4, started=0.0, now=10.0, pipelined=True)  # the first: from its launch
    planner.observe_step(4, started=1.0, now=12.0, pipelined=True)  # waited 9 s for the one before
    planner.observe_step(4, started=11.0, now=16.0, pipelined=False)  # the pipeline's last: not timed
    assert model.points[4] == pytest.approx((4.0, 0.8 * 10.0 + 0.2 * 2.0))
    planner.observe_step(4, started=20.0, now=23.0, pipelined=False)  # a synchronous step: from its launch
    assert model.points[4] == pytest.approx((4.0, 0.8 * (0.8 * 10.0 + 0.2 * 2.0) + 0.2 * 3.0))

"""The speculation gate of confidence scheduling: it measures speculative and plain decode steps per
batch bucket and runs the faster, probing the other; an engine switching between the two keeps the
outputs of the run without speculation (float64, sync and async), plain steps draft nothing and run
the plain runner's pipeline."""

from __future__ import annotations

import itertools
import time
from types import SimpleNamespace

import engine_fixtures
import pytest
import test_spec_async
from engine_fixtures import greedy, make_prompt, run_tokens
from spec_fixtures import oracle_drafts, spec
from test_spec_async import expected, worker_oracle
from test_spec_decode import MAX_TOKENS, PROMPTS, mixed, reference

from deepinfer_core.spec_decode.config import SpeculativeConfig
from deepinfer_core.spec_decode.drafts import DraftPlanner
from deepinfer_core.spec_decode.gate import SpeculationGate, _StepTime, bucket
from deepinfer_core.worker.model_runner import ModelRunner

make_llm = engine_fixtures.make_llm
make_async = test_spec_async.make_async
one_torch_thread = engine_fixtures.one_torch_thread
tiny_path = engine_fixtures.tiny_path


def feed(gate: SpeculationGate, seqs: int, steps: int, spec_s: float, plain_s: float, tokens_spec: float) -> list:
    """Run ``steps`` decisions of ``seqs`` sequences, each step finishing after its mode's seconds with
    ``tokens_spec`` tokens per sequence when speculative (one when plain); returns the modes chosen."""
    modes, now = [], 0.0
    for _ in range(steps):
        mode = gate.decide(seqs)
        started, now = now, now + (spec_s if mode else plain_s)
        gate.observe(mode, seqs, round(seqs * (tokens_spec if mode else 1)), started, now)
        modes.append(mode)
    return modes


def test_bucket_is_the_next_power_of_two():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 63, 64, 65)] == [1, 2, 4, 4, 8, 64, 64, 128]


def test_gate_measures_both_modes_then_runs_the_faster_and_probes_the_other():
    gate = SpeculationGate(probe_every=32, probe_steps=4, settle_steps=1, probe_cost_share=0.1)
    # speculation: 2 tokens per sequence in 3 ms; plain: 1 token in 1 ms -> plain is faster
    modes = feed(gate, 64, 200, spec_s=3e-3, plain_s=1e-3, tokens_spec=2)
    first_plain = modes.index(False)
    assert all(modes[:first_plain]) and first_plain == 2  # spec until measured (one settle step)
    b = gate.buckets[64]
    assert b.rate(False) == pytest.approx(64 / 1e-3) and b.rate(True) == pytest.approx(128 / 3e-3)
    tail = modes[40:]
    assert tail.count(True) / len(tail) < 0.2  # mostly plain, with probes
    assert any(tail)  # the slower mode is probed again
    # the other way round: one user, 2.5 tokens per 1.2 ms against 1 per 1 ms -> speculation
    modes = feed(gate, 1, 200, spec_s=1.2e-3, plain_s=1e-3, tokens_spec=2.5)
    assert modes[40:].count(False) / len(modes[40:]) < 0.2
    assert gate.as_dict()["plain_steps"] > 0 and gate.as_dict()["speculative_steps"] > 0


def test_step_time_follows_the_sequences_where_their_number_spreads():
    """A graph's step takes as long for any batch of its bucket: samples at one size give that time. Where
    the host paces the steps, their time grows with the sequences (1 ms + 50 us a sequence): samples from
    64 down to 33 sequences give the time at 64, not their mean."""
    times = _StepTime(decay=0.9)
    for _ in range(10):
        times.add(64, 3e-3)
    assert times.seconds(40) == pytest.approx(3e-3)
    times = _StepTime(decay=0.9)
    for n in range(64, 32, -1):
        times.add(n, 1e-3 + 5e-5 * n)
    assert times.seconds(64) == pytest.approx(1e-3 + 5e-5 * 64, rel=0.01)
    assert times.seconds(48) == pytest.approx(1e-3 + 5e-5 * 48, rel=0.01)
    skewed = _StepTime(decay=0.9)  # a time falling with the sequences (noise) stays constant
    for n in range(64, 32, -1):
        skewed.add(n, 5e-3 - 5e-5 * n)
    assert skewed.seconds(64) == pytest.approx(skewed.level[2] / skewed.level[0])


def test_a_closed_batchs_speculative_tail_is_judged_at_the_buckets_size():
    """Host-paced steps (plain 1 ms + 30 us a sequence, k=3 2.7 ms + 80 us): plain decode measured at 64
    sequences, speculation while a closed batch drains from 64 to 33. At the bucket's size speculation
    yields 64 * 2.5 tokens per 7.7 ms against 64 per 2.9 ms; its tail's mean time (5.3 ms) scaled to 64
    sequences would have made it look 1.4x faster than plain decode."""
    gate = SpeculationGate(probe_steps=4, settle_steps=1, max_tokens_per_step=4)
    plain, spec_time = (lambda n: 1e-3 + 3e-5 * n), (lambda n: 2.7e-3 + 8e-5 * n)
    now = 0.0
    for _ in range(20):
        gate.observe(False, 64, 64, now, now + plain(64))
        now += plain(64)
    for n in range(64, 32, -1):
        gate.observe(True, n, round(2.5 * n), now, now + spec_time(n))
        now += spec_time(n)
    b = gate.buckets[64]
    assert b.rate(False) == pytest.approx(64 / plain(64))
    assert b.rate(True) == pytest.approx(64 * 2.5 / spec_time(64), rel=0.02)
    assert gate._best(b) is False


def probe_starts(modes: list[bool], slower: bool) -> list[int]:
    return [i for i in range(1, len(modes)) if modes[i] == slower and modes[i - 1] != slower]


def test_gate_probes_as_often_as_keeps_probing_below_its_cost_share():
    """Speculation: 2 tokens per 3 ms against plain's 1 per 1 ms. Each speculative step of a probe costs
    3 ms less the 2 ms plain decode takes for its tokens, so a probe of 4 steps costs 4 ms, and with a 2%
    share the next comes 200 plain steps (200 ms) later; the first interval after the exploration is
    probe_every (16) steps, a second look at the costs the exploration measured once."""
    gate = SpeculationGate(probe_every=16, probe_steps=4, settle_steps=1, max_probe_every=512,
                           probe_cost_share=0.02)
    modes = feed(gate, 64, 1200, spec_s=3e-3, plain_s=1e-3, tokens_spec=2)
    starts = probe_starts(modes, True)
    assert modes[:4] == [True, True, False, False] and starts[0] == 4 + 16
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert set(gaps) == {4 + 200}
    assert gate.as_dict()["probe_every"] == {64: 200}
    capped = SpeculationGate(probe_every=16, probe_steps=4, settle_steps=1, max_probe_every=64,
                             probe_cost_share=0.02)
    feed(capped, 64, 600, spec_s=3e-3, plain_s=1e-3, tokens_spec=2)
    assert capped.as_dict()["probe_every"] == {64: 64}
    # near break-even a probe costs little, so probes come every probe_every steps
    even = SpeculationGate(probe_every=16, probe_steps=4, settle_steps=1, probe_cost_share=0.02)
    feed(even, 64, 300, spec_s=2.02e-3, plain_s=1e-3, tokens_spec=2)
    assert even.as_dict()["probe_every"] == {64: 16}
    # now speculation is the faster one: the next probe finds out, and the interval starts again
    modes = feed(gate, 64, 400, spec_s=1e-3, plain_s=1e-3, tokens_spec=3)
    first_spec = modes.index(True)
    assert first_spec <= 200 and all(modes[first_spec:first_spec + 4 + 16])  # the probe, then 16 of the new best
    assert modes[first_spec + 4 + 16:first_spec + 4 + 16 + 4] == [False] * 4
    assert gate.buckets[64].best is True
    with pytest.raises(ValueError, match="max_probe_every"):
        SpeculationGate(probe_every=64, max_probe_every=32)


def feed_stale(gate: SpeculationGate, seqs: int, steps: int, spec_s: float, plain_s: float, fresh_tokens: float,
               stale_tokens: float, window: int, made: float = 0) -> list:
    """Like :func:`feed`, with drafts that accept less (``stale_tokens`` per sequence and step, against
    ``fresh_tokens``) until a speculative run has made ``window`` tokens per sequence since a plain step
    (``made`` at the start: the sequences decoded plainly before)."""
    modes, now = [], 0.0
    for _ in range(steps):
        mode = gate.decide(seqs)
        fresh = made >= window
        tokens = (fresh_tokens if fresh else stale_tokens) if mode else 1
        made = made + tokens if mode else 0
        started, now = now, now + (spec_s if mode else plain_s)
        gate.observe(mode, seqs, round(seqs * tokens), started, now, fresh=fresh)
        modes.append(mode)
    return modes


def test_gate_judges_speculation_by_the_steps_drafting_from_fresh_mtp_rows():
    """One user: 2.4 tokens per 1.2 ms when the MTP rows are fresh (2x plain decode), 1 per 1.2 ms in the 16
    tokens after plain steps, which the sequences start in. Counting stale steps, speculation looks
    slower than plain at first, and every probe of it after plain steps looks so again."""
    args = dict(seqs=1, steps=600, spec_s=1.2e-3, plain_s=1e-3, fresh_tokens=2.4, stale_tokens=1.0, window=16)
    gate = SpeculationGate(probe_every=32, probe_steps=4, settle_steps=1, max_tokens_per_step=4)
    assert feed_stale(gate, **args)[100:].count(True) / 500 > 0.9
    naive = SpeculationGate(probe_every=32, probe_steps=4, settle_steps=1, max_tokens_per_step=4)
    observe = naive.observe
    naive.observe = lambda *a, fresh=True: observe(*a)  # every step counted, as if always fresh
    assert feed_stale(naive, **args)[100:].count(True) / 500 < 0.2


def test_probes_of_speculation_keep_its_last_yield_and_wait_for_fresh_rows_only_now_and_then():
    """2 fresh tokens per 3 ms against plain's 1 per 1 ms: slower, though its best case (4 tokens) is not.
    A probe re-measures the step's cost in probe_steps; every fourth also waits out the stale window."""
    gate = SpeculationGate(probe_every=16, probe_steps=4, settle_steps=1, max_probe_every=16, max_tokens_per_step=4,
                           max_stale_steps=64, fresh_probe_every=4)
    modes = feed_stale(gate, 8, 2000, spec_s=3e-3, plain_s=1e-3, fresh_tokens=2.0, stale_tokens=1.0, window=20,
                       made=20)
    runs = [len(list(run)) for mode, run in itertools.groupby(modes) if mode][1:]
    assert len(runs) > 40 and max(runs) <= 4 + 64
    short = sum(r == 4 for r in runs)
    assert 0.6 < short / len(runs) < 0.85  # three probes in four
    assert all(r > 4 for r in runs[3::4])  # the fresh ones: the stale window (20 tokens) plus their samples


def test_a_bucket_whose_speculative_steps_are_all_stale_judges_by_their_yield():
    """V4-Flash widths at batch 64 with forced acceptance (H200): plain steps in the buckets before left
    every MTP row stale for a window (128 tokens), longer than the 64-token requests. 2.5 tokens per
    sequence in 3.4 plain steps' time lose (0.74x), and waiting for a fresh step that never comes
    speculated throughout; after probe_steps - settle_steps stale samples their yield decides. Where
    even the stale yield wins (3 tokens in 1.5 steps' time), speculation is kept."""
    losing = SpeculationGate(probe_steps=8, settle_steps=2, max_tokens_per_step=4)
    modes = feed_stale(losing, 64, 64, spec_s=3.4e-3, plain_s=1e-3, fresh_tokens=2.5, stale_tokens=2.5,
                       window=10**6)
    b = losing.buckets[64]
    assert b.spec_yield is None and b.stale_samples >= 6 and b.rate(True) == pytest.approx(b.seq_rate[True] * 2.5)
    assert modes.index(False) <= 8 + 1 and modes[16:].count(True) <= 8  # one probe at most
    winning = SpeculationGate(probe_steps=8, settle_steps=2, max_tokens_per_step=4)
    modes = feed_stale(winning, 64, 64, spec_s=1.5e-3, plain_s=1e-3, fresh_tokens=3.0, stale_tokens=3.0,
                       window=10**6)
    assert modes[16:].count(True) >= len(modes[16:]) - 8


def test_a_first_look_at_a_cold_speculative_step_is_looked_at_again_soon():
    """The H200's trained model at batch 64 with the kernel libraries: the gate's first look at
    speculation kept plain decode for 1024 steps, though a later probe measured speculation at 1.46x.
    Here the exploration's speculative steps are cold (6 ms, a first replay), warm ones give 2.68 tokens
    per 1.83 ms against plain decode's 1 per 1 ms. The cost of that look used to defer the next probe by
    the exploration's excess (600 steps); now the first interval is probe_every steps, and the probe
    after it re-measures the cost."""
    gate = SpeculationGate(max_tokens_per_step=4)
    modes, now, spec_steps = [], 0.0, 0
    for _ in range(600):
        mode = gate.decide(64)
        spec_steps += mode
        dt = (6e-3 if spec_steps <= 3 else 1.83e-3) if mode else 1e-3
        gate.observe(mode, 64, round(64 * (2.68 if mode else 1)), now, now + dt)
        now += dt
        modes.append(mode)
    assert modes[100:].count(True) / 500 > 0.9


def test_a_speculative_step_slower_than_its_best_case_ends_the_probe_at_once():
    """4 tokens per sequence at most, in 5x a plain step's time: speculation cannot win, fresh or not, and
    its probes end one sample past the settling steps."""
    gate = SpeculationGate(probe_every=16, probe_steps=4, settle_steps=1, max_tokens_per_step=4, max_stale_steps=64)
    modes = feed_stale(gate, 64, 400, spec_s=5e-3, plain_s=1e-3, fresh_tokens=3.0, stale_tokens=1.0, window=10**6)
    probes = [len(list(run)) for mode, run in itertools.groupby(modes[8:]) if mode]
    assert probes and max(probes) <= 1 + 1  # one sample past the settling step: no waiting for fresh rows
    assert gate._ceiling(gate.buckets[64]) == pytest.approx(64 * 4 / 5e-3)


def test_gate_costs_little_where_speculation_loses_as_at_batch_64_on_the_h200():
    """The H200's batch-64 figures for the trained model: plain decode 3.77 ms a step; k=3 steps of 18.1 ms
    yielding 2.68 tokens per sequence (0.56x). After a 256-step warm-up, 256-step runs keep 99% of plain
    decode's rate on average and no less than 97% (one short probe in about 600 steps); where speculation
    wins (1.11x at batch 1), the gate keeps nearly all of that."""
    def rate(gate, spec_s, tokens, steps=256):
        now = out = 0.0
        for _ in range(steps):
            mode = gate.decide(64)
            dt = spec_s if mode else 3.77e-3
            gate.observe(mode, 64, round(64 * (tokens if mode else 1)), now, now + dt)
            now, out = now + dt, out + (tokens if mode else 1)
        return out / now * 3.77e-3  # against plain decode
    for spec_s, tokens, mean, lowest in ((18.1e-3, 2.68, 0.99, 0.97), (3.77e-3 * 2.26 / 1.11, 2.26, 1.09, 1.09)):
        gate = SpeculationGate(max_tokens_per_step=4)
        rate(gate, spec_s, tokens)
        runs = [rate(gate, spec_s, tokens) for _ in range(8)]
        assert sum(runs) / len(runs) >= mean and min(runs) >= lowest, runs


def test_buckets_the_batch_only_passes_through_take_the_nearest_measured_buckets_mode():
    """Requests finishing one by one take the batch through smaller buckets for a step or two each, and
    a step with prefill chunks is never measured: neither explores, each takes the mode of the nearest
    bucket measured (speculation where none is, so that the prompts' MTP rows are written). A bucket the
    batch stays in is measured after probe_steps steps, speculation first."""
    gate = SpeculationGate(probe_steps=4, settle_steps=1, max_tokens_per_step=4)
    assert gate.decide(8, decode_only=False) is True and not gate.buckets[8].steps
    feed(gate, 64, 100, spec_s=18e-3, plain_s=4e-3, tokens_spec=2.7)  # plain decode faster at 64
    feed(gate, 1, 100, spec_s=1.5e-3, plain_s=1e-3, tokens_spec=2.5)  # speculation faster at 1
    assert gate.decide(32) is False and gate.decide(2) is True
    assert gate.decide(64, decode_only=False) is False and gate.decide(1, decode_only=False) is True
    assert [gate.decide(16) for _ in range(5)] == [False] * 4 + [True]


def test_a_step_counts_as_all_decode_unless_a_prompt_can_join_it():
    """The planner tells the gate whether the step can hold prefill chunks: a sequence still prefilling,
    or a waiting request with room in the batch; a full batch with requests waiting is all decode."""
    planner = DraftPlanner(SpeculativeConfig(num_speculative_tokens=2, schedule="confidence"))
    seen = []
    planner.gate.decide = lambda num, decode_only=True: seen.append((num, decode_only)) or True
    decoding, prefilling = SimpleNamespace(num_uncomputed=1), SimpleNamespace(num_uncomputed=40)
    for running, waiting in (([decoding] * 2, []), ([decoding, prefilling], []), ([decoding], ["queued"]),
                             ([decoding] * 2, ["queued"])):
        planner.decide(SimpleNamespace(running=running, waiting=waiting, config=SimpleNamespace(max_num_seqs=2)))
    assert seen == [(2, True), (2, False), (2, False), (2, True)]  # a step with prefill: the batch after it


def test_new_prompts_are_prefilled_in_the_mode_of_the_batch_they_will_decode_in():
    """64 prompts arriving at an idle engine: their prefill runs in the mode the gate measured faster at
    64 sequences, not at the one or none decoding meanwhile (a speculative prefill writes the prompts' MTP
    rows; a plain one leaves speculation's first window stale)."""
    planner = DraftPlanner(SpeculativeConfig(num_speculative_tokens=3, schedule="confidence"))
    gate = planner.gate
    feed(gate, 64, 100, spec_s=18e-3, plain_s=4e-3, tokens_spec=2.7)  # plain decode faster at 64
    feed(gate, 1, 100, spec_s=1.5e-3, plain_s=1e-3, tokens_spec=2.5)  # speculation faster at 1
    prompt = SimpleNamespace(num_uncomputed=40)
    for waiting, max_num_seqs, speculate in ((64, 64, False), (1, 64, True), (64, 1, True)):
        scheduler = SimpleNamespace(running=[], waiting=[prompt] * waiting,
                                    config=SimpleNamespace(max_num_seqs=max_num_seqs))
        assert planner.decide(scheduler) is speculate, (waiting, max_num_seqs)
    running = SimpleNamespace(running=[prompt] * 64, waiting=[], config=SimpleNamespace(max_num_seqs=64))
    assert planner.decide(running) is False  # chunks of 64 long prompts


def test_gate_leaves_out_the_settling_steps_and_interrupted_intervals():
    gate = SpeculationGate(settle_steps=2, probe_steps=4)
    gate.decide(4)
    for t in (1.0, 2.0):
        gate.observe(True, 4, 8, t - 1, t)
    assert gate.buckets[4].rate(True) is None
    gate.observe(True, 4, 8, 2.0, 3.0)
    assert gate.buckets[4].rate(True) == pytest.approx(8.0)
    gate.observe(True, 4, 8, 9.0, 10.0)  # launched after 6 idle seconds: timed from its launch
    assert gate.buckets[4].rate(True) == pytest.approx(8.0)
    gate.observe(True, 4, 16, 9.5, 11.0)  # launched before the one before finished: from that finish
    # 4 sequence-steps a second, and 2, 2, then 4 tokens a sequence: tokens over sequence-steps, older fading
    mixed = 4 * ((0.95 * 8 + 8) * 0.95 + 16) / ((0.95 * 4 + 4) * 0.95 + 4)
    assert gate.buckets[4].rate(True) == pytest.approx(mixed)
    gate.interrupt()  # a prefill step: the run starts again, its first steps settle
    gate.observe(True, 4, 16, 20.0, 21.0)
    assert gate.buckets[4].rate(True) == pytest.approx(mixed)
    with pytest.raises(ValueError, match="probe"):
        SpeculationGate(probe_steps=2, settle_steps=2)


def test_the_last_step_of_a_pipeline_is_not_timed():
    """An async engine's last step before a drain was launched while the step before ran: from its launch
    its time holds that step's too (2x the real one where the device paces the pipeline), and from the
    previous finish only the host's wait (a fraction of a step where the host paces it). A synchronous
    or idle engine's step, launched after the previous finish, is timed from its launch."""
    gate = SpeculationGate(settle_steps=0, probe_steps=4)
    gate.observe(False, 4, 4, 0.0, 1.0)
    gate.observe(False, 4, 4, 0.5, 2.0)  # launched before the previous finish: timed from that finish
    assert gate.buckets[4].rate(False) == pytest.approx(4.0)
    for end in (2.01, 3.5):
        gate.observe(False, 4, 4, 1.5, end, pipelined=False)
        assert gate.buckets[4].rate(False) == pytest.approx(4.0)
    gate.observe(False, 4, 4, 4.0, 6.0, pipelined=False)  # launched after the previous finish: 2 s
    # the bucket's size over the mean step time, the older steps fading
    assert gate.buckets[4].rate(False) == pytest.approx(4 * (0.7 * (0.7 + 1) + 1) / (0.7 * (0.7 + 1) + 2))


def test_async_engine_tells_the_gate_which_steps_had_a_later_one_launched(tiny_path, make_async):
    llm = make_async(tiny_path("tiny"), dtype="float64", max_num_seqs=4, **spec(2, "confidence"))
    gate, seen = llm.llm_engine.drafts.gate, []
    observe = gate.observe
    gate.observe = lambda *a, pipelined=True, **kw: seen.append(pipelined) or observe(*a, pipelined=pipelined, **kw)
    run_tokens(llm, [make_prompt(6, seed=i) for i in range(2)], greedy(12))
    assert seen[-1] is False  # the last step: nothing launched after it
    assert seen.count(True) >= len(seen) // 2


def test_a_step_read_after_an_eager_launch_is_not_timed(tiny_path, make_async, monkeypatch):
    """The engine reads a step's output after launching the next one. Where that one has prompt chunks it
    runs eagerly (on an H100 about 16 ms of launches for the trained model, against 2.6 ms for a graph's
    decode step), and its launch counted as the step before's time: with requests joining every few steps
    the gate's rates fell to a fifth of the steps' cost. Here such a launch takes 1 s more, far above what
    a tiny model's step takes even on a loaded machine."""
    llm = make_async(tiny_path("tiny"), dtype="float64", max_num_seqs=2, **spec(2, "confidence"))
    engine, times = llm.llm_engine, []
    run = engine._run

    def slow(scheduled, prev=None):
        launched = run(scheduled, prev)
        if not launched.decode_only:
            time.sleep(1.0)
        return launched

    monkeypatch.setattr(engine, "_run", slow)
    add = _StepTime.add
    monkeypatch.setattr(_StepTime, "add", lambda self, n, t: times.append(t) or add(self, n, t))
    prompts = [make_prompt(6, seed=i) for i in range(5)]
    run_tokens(llm, prompts, [greedy(24 + 9 * i) for i in range(len(prompts))])
    assert len(times) >= 10 and max(times) < 1.0


def test_yield_leaves_out_the_sequences_a_step_ends():
    """A drain: 2.5 tokens per sequence and step, but one sequence a step ends with a single token (its
    ``max_tokens`` reached) or none (it had ended before the step, launched before that was known).
    Counted in, they would halve the yield at 2 sequences and make plain decode look faster."""
    gate = SpeculationGate(probe_steps=4, settle_steps=1, max_tokens_per_step=4)
    for i in range(40):
        gate.observe(True, 2, 3 if i % 2 else 2, i * 1e-3, (i + 1) * 1e-3, num_yielding=1 if i % 2 else 0)
    assert gate.buckets[2].spec_yield == pytest.approx(3.0)
    gate.observe(True, 2, 5, 0.04, 0.041)  # num_yielding left out: all of them
    assert gate.buckets[2].spec_yield == pytest.approx((0.95 * 3.0 * 0.95 ** 38 + 5) / (0.95 * 0.95 ** 38 + 2),
                                                       rel=0.2)


def test_engine_gives_the_gate_the_tokens_of_the_sequences_that_go_on(tiny_path, make_llm, make_async):
    """All drafts right: every sequence a step does not end yields its verified drafts and one more; the
    sequences a step ends (staggered ``max_tokens``, some already ended when the step was launched) are
    left out of the yield."""
    path = tiny_path("tiny")
    prompts = PROMPTS[:6]
    ref = reference(make_llm, path, prompts, max_tokens=30)
    llm = make_async(path, dtype="float64", max_num_seqs=8, **spec(3, "confidence"))
    worker_oracle(llm, ref)
    alternate_modes(llm, [True])
    gate, seen = llm.llm_engine.drafts.gate, []
    observe = gate.observe
    gate.observe = lambda *a, **kw: seen.append((a[1], a[2], kw["num_yielding"])) or observe(*a, **kw)
    params = [greedy(5 + 4 * i) for i in range(len(prompts))]
    assert run_tokens(llm, prompts, params) == [ref[tuple(p)][:5 + 4 * i] for i, p in enumerate(prompts)]
    assert any(going_on < decoding for decoding, _, going_on in seen)
    for decoding, tokens, going_on in seen:
        assert going_on <= decoding and going_on <= tokens <= 4 * going_on


def alternate_modes(llm, pattern: list[bool]) -> list[bool]:
    """Make the engine's gate follow ``pattern`` (cycled); returns the modes it ran, in order."""
    gate, ran = llm.llm_engine.drafts.gate, []

    def decide(num_decoding, decode_only=True):
        mode = pattern[len(ran) % len(pattern)]
        ran.append(mode)
        return mode

    gate.decide = decide
    return ran


def test_speculative_steps_after_plain_ones_are_stale_for_a_window(tiny_path, make_llm):
    path = tiny_path("tiny")
    llm = make_llm(path, dtype="float64", max_num_seqs=16, **spec(3, "confidence"))
    alternate_modes(llm, [False] * 3 + [True] * 40)
    gate, seen = llm.llm_engine.drafts.gate, []
    window = llm.llm_engine.drafts.window
    observe = gate.observe
    gate.observe = lambda speculated, *a, fresh=True, **kw: seen.append((speculated, fresh)) or observe(
        speculated, *a, fresh=fresh, **kw)
    prompt = make_prompt(5, 0)
    run_tokens(llm, [prompt], greedy(3 + window + 12))
    spec_steps = [fresh for speculated, fresh in seen if speculated]
    assert window > 0 and spec_steps and not spec_steps[0]  # right after the plain ones
    assert spec_steps[-1]  # a window later
    assert spec_steps == sorted(spec_steps)  # stale, then fresh for good


@pytest.mark.parametrize("pattern", [[True, True, False, False, False], [False, True]])
def test_switching_between_plain_and_speculative_steps_keeps_greedy_equal(pattern, tiny_path, make_llm,
                                                                          monkeypatch):
    """A speculative step right after a plain one has no drafts to verify (a plain step leaves none
    behind); the one after it does."""
    path = tiny_path("tiny")
    ref = reference(make_llm, path, PROMPTS)
    llm = make_llm(path, dtype="float64", max_num_seqs=16, **spec(3, "confidence"))
    ran = alternate_modes(llm, pattern)
    drafted, plain = [], []
    proposer = llm.llm_engine.runner.proposer
    propose = proposer.propose
    monkeypatch.setattr(proposer, "propose", lambda spans, streams: drafted.append(1) or propose(spans, streams))
    execute = ModelRunner.execute_model
    monkeypatch.setattr(ModelRunner, "execute_model", lambda self, so: plain.append(so.speculate) or execute(self, so))
    oracle_drafts(llm, ref, mixed)
    assert run_tokens(llm, PROMPTS, greedy(MAX_TOKENS)) == [ref[tuple(p)][:MAX_TOKENS] for p in PROMPTS]
    assert set(ran) == {True, False}  # both modes ran
    assert len(drafted) == ran.count(True)  # plain steps never reach the drafter
    assert plain and not any(plain) and len(plain) == ran.count(False)  # they run the plain runner's step
    accepted = llm.llm_engine.spec_decode_stats()["num_accepted_tokens"]
    assert (accepted > 0) == (pattern[:2] == [True, True])


def test_async_engine_switches_modes_with_the_pipeline_drained(tiny_path, make_llm, make_async):
    path = tiny_path("tiny")
    ref = reference(make_llm, path, PROMPTS)
    llm = make_async(path, dtype="float64", max_num_seqs=16, **spec(3, "confidence"))
    ran = alternate_modes(llm, [True] * 3 + [False] * 4)
    worker_oracle(llm, ref, mixed)
    assert run_tokens(llm, PROMPTS, greedy(MAX_TOKENS)) == expected(ref, PROMPTS)
    assert set(ran) == {True, False}  # both modes ran
    assert llm.llm_engine.counts["overlapped"] > 0


def test_a_long_run_with_the_real_gate_keeps_greedy_equal(tiny_path, make_llm):
    """Measured, not forced: the gate tries both modes and probes, the outputs stay the reference's."""
    path = tiny_path("tiny_hc4")
    prompts = [make_prompt(n, seed=i) for i, n in enumerate([7, 20, 33])]
    ref = reference(make_llm, path, prompts, max_tokens=40)
    llm = make_llm(path, dtype="float64", max_num_seqs=4, **spec(2, "confidence"))
    llm.llm_engine.drafts.gate = SpeculationGate(probe_every=8, probe_steps=3, settle_steps=1)
    oracle_drafts(llm, ref, mixed)
    assert run_tokens(llm, prompts, greedy(36)) == [ref[tuple(p)][:36] for p in prompts]
    gate = llm.llm_engine.spec_decode_stats()["gate"]
    assert gate["speculative_steps"] > 0 and gate["plain_steps"] > 0

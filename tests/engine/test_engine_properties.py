"""Property tests of Scheduler + BlockManager (no model), and one end-to-end abort property.

The model-free tests drive ``Scheduler.schedule()`` the way ``LLMEngine.step`` does: computed tokens
advance by the scheduled amount, the window is trimmed, a sequence that reached its end gets a token,
and requests arrive, finish and are aborted at random, on tiny pools. After every step the books must
balance (``check_invariants``), each sequence must hold exactly the window blocks its next query or
chunk can see (bounded by the window plus the chunk, independent of the sequence length) and
exactly the compressed blocks its computed tokens fill, and in the end every request finished or
was reported unfittable, only when it truly cannot fit, and all memory is back in the pools.
"""

from __future__ import annotations

import engine_fixtures
import torch
from engine_fixtures import assert_drained, check_every_step, greedy, make_prompt
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer_core.config import SchedulerConfig
from deepinfer_core.engine.block_manager import BlockManager
from deepinfer_core.engine.scheduler import Scheduler
from deepinfer_core.engine.sequence import Sequence, SequenceStatus
from deepinfer_core.entrypoints.llm import LLM
from deepinfer_core.sampling.params import SamplingParams

# the shared fixtures, bound here so that pytest finds them in this module
one_torch_thread = engine_fixtures.one_torch_thread
tiny_path = engine_fixtures.tiny_path

PROPERTY = settings(deadline=None, max_examples=25, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def first_window_block(computed: int, window: int, bs: int) -> int:
    return max(0, computed - window + 1) // bs


def held_window_blocks(seq: Sequence) -> set[int]:
    return {i for i, b in enumerate(seq.window_block_table) if b >= 0}


@st.composite
def workloads(draw):
    bs = draw(st.sampled_from([2, 4, 8, 16]))
    window = draw(st.integers(1, 20))
    cfg = dict(
        block_size=bs,
        window=window,
        num_blocks=draw(st.integers(1, 16)),
        num_window_blocks=draw(st.integers(1, 10)),
        max_num_seqs=draw(st.integers(1, 5)),
        budget=draw(st.integers(1, 40)),
        chunked=draw(st.booleans()),
    )
    requests = draw(st.lists(
        st.fixed_dictionaries(dict(
            arrival=st.integers(0, 12),
            prompt_len=st.integers(1, 60),
            max_new=st.integers(1, 12),
            abort_at=st.one_of(st.none(), st.integers(0, 40)),
        )),
        min_size=1, max_size=10,
    ))
    return cfg, requests


def simulate(cfg: dict, requests: list[dict]) -> dict:
    bs, window = cfg["block_size"], cfg["window"]
    bm = BlockManager(cfg["num_blocks"], cfg["num_window_blocks"], cfg["max_num_seqs"], bs, window)
    sched = Scheduler(SchedulerConfig(cfg["max_num_seqs"], cfg["budget"], 10_000, cfg["chunked"]), bm)
    seqs: list[Sequence | None] = [None] * len(requests)
    outcome: dict[int, str] = {}
    # The oldest running sequence gains >= 1 token every step, so this many steps always suffice.
    step_limit = sum(r["prompt_len"] + r["max_new"] for r in requests) + len(requests) + 13 + 5
    step = 0
    while step <= 12 or any(s is not None and not s.is_finished for s in seqs):
        assert step < step_limit, "the scheduler stopped making progress (livelock or starvation)"
        for i, r in enumerate(requests):
            if r["arrival"] == step:
                seqs[i] = Sequence(f"r{i}", 0, [2] * r["prompt_len"], SamplingParams(), torch.Generator())
                sched.add(seqs[i])
            if seqs[i] is not None and r["abort_at"] == step and not seqs[i].is_finished:
                sched.finish(seqs[i])
                outcome[i] = "abort"
                bm.check_invariants()
        # what each sequence is entitled to (and holds) before the step
        for seq in sched.running:
            c = seq.num_computed_tokens
            assert held_window_blocks(seq) == set(range(first_window_block(c, window, bs), ceil_div(c, bs)))
            assert len(seq.block_table) == ceil_div(seq.num_computed_tokens, bs)
        for seq in sched.waiting:
            assert seq.num_computed_tokens == 0 and not seq.block_table and not seq.window_block_table
            assert seq.state_slot is None
        before = {id(s): (len(s), s.num_computed_tokens) for s in sched.running}

        so = sched.schedule()
        scheduled, unfittable = so.scheduled_seqs, so.unfittable
        bm.check_invariants()

        for seq in unfittable:
            assert seq.is_finished and not seq.block_table and seq.state_slot is None
            i = next(k for k, s in enumerate(seqs) if s is seq)
            outcome[i] = "unfittable"
            # only when the pools, all free, could not take the next step of it
            chunkable = cfg["chunked"] or len(seq) > cfg["budget"]
            if id(seq) in before or chunkable:  # the next step is one token (or a shrunken chunk)
                computed = before.get(id(seq), (0, 0))[1]
                one_token_window = ceil_div(computed + 1, bs) - first_window_block(computed, window, bs)
                assert (ceil_div(computed + 1, bs) > cfg["num_blocks"]
                        or one_token_window > cfg["num_window_blocks"]), "a fittable sequence was dropped"
            else:  # a whole (re)computation in one step
                need = len(seq)
                assert (ceil_div(need, bs) > cfg["num_blocks"]
                        or ceil_div(need, bs) > cfg["num_window_blocks"]), "a fittable sequence was dropped"
        assert sum(n for _, n in scheduled) <= cfg["budget"]
        assert len(sched.running) <= cfg["max_num_seqs"]
        assert len({id(s) for s, _ in scheduled}) == len(scheduled)
        for seq, n in scheduled:
            assert seq.status == SequenceStatus.RUNNING and seq in sched.running
            assert 1 <= n <= seq.num_uncomputed
            if not cfg["chunked"] and len(seq) <= cfg["budget"]:
                assert n == seq.num_uncomputed  # all at once, unless it could never be
            c = seq.num_computed_tokens
            # the window pool holds exactly what this chunk's queries see: window + chunk, not the whole KV
            held = held_window_blocks(seq)
            assert held == set(range(first_window_block(c, window, bs), ceil_div(c + n, bs)))
            assert len(held) <= ceil_div(window, bs) + ceil_div(n, bs) + 1
            assert len(seq.block_table) == ceil_div(c + n, bs)  # compressed: grows with the length
            assert seq.state_slot is not None

        # run the step: advance, trim, sample at the end of the sequence, finish at max_new
        for seq, n in scheduled:
            seq.num_computed_tokens += n
            bm.trim_window(seq)
            if seq.num_computed_tokens == len(seq):
                seq.output_token_ids.append(2 + step % 7)
                i = next(k for k, s in enumerate(seqs) if s is seq)
                if len(seq.output_token_ids) >= requests[i]["max_new"]:
                    sched.finish(seq)
                    outcome[i] = "done"
        bm.check_invariants()
        step += 1

    assert not sched.has_unfinished()
    assert set(outcome) == set(range(len(requests))), "a request neither finished nor was reported"
    for pool in (bm.blocks, bm.window_blocks, bm.slots):
        assert pool.num_free == pool.size, f"{pool.name} pool leaked"
    assert not bm.owners
    return dict(outcome=outcome, preemptions=sched.num_preemptions)


@PROPERTY
@given(workloads())
def test_scheduler_block_manager_properties(workload):
    cfg, requests = workload
    simulate(cfg, requests)


def test_generous_pools_never_report_unfittable():
    """With pools that hold everything at once, every request completes without preemption."""
    reqs = [dict(arrival=i % 3, prompt_len=5 + 7 * i, max_new=6, abort_at=None) for i in range(8)]
    cfg = dict(block_size=16, window=8, num_blocks=64, num_window_blocks=64, max_num_seqs=8, budget=64,
               chunked=True)
    result = simulate(cfg, reqs)
    assert set(result["outcome"].values()) == {"done"} and result["preemptions"] == 0


def test_tight_pools_preempt_and_still_finish():
    reqs = [dict(arrival=0, prompt_len=30, max_new=12, abort_at=None) for _ in range(6)]
    for chunked in (True, False):
        cfg = dict(block_size=8, window=5, num_blocks=10, num_window_blocks=6, max_num_seqs=4, budget=32,
                   chunked=chunked)
        result = simulate(cfg, reqs)
        assert set(result["outcome"].values()) == {"done"}
        assert result["preemptions"] > 0


def test_unfittable_only_when_it_cannot_fit():
    # 70 tokens in 16-token blocks need 5 compressed blocks: with 4 the sequence can never finish;
    # a 3-block window pool is enough for a chunked prefill (the chunks shrink to fit it)
    reqs = [dict(arrival=0, prompt_len=70, max_new=1, abort_at=None),
            dict(arrival=0, prompt_len=40, max_new=4, abort_at=None)]
    cfg = dict(block_size=16, window=8, num_blocks=4, num_window_blocks=3, max_num_seqs=2, budget=2048,
               chunked=True)
    assert simulate(cfg, reqs)["outcome"] == {0: "unfittable", 1: "done"}
    # without chunked prefill a sequence is computed whole, so its window blocks must all fit at once
    cfg.update(num_blocks=8, num_window_blocks=4, budget=2048, chunked=False)
    assert simulate(cfg, reqs)["outcome"] == {0: "unfittable", 1: "done"}


# --- end to end: aborts through LLMEngine.abort_request ------------------------------------------

_POOL = [make_prompt(n, seed=100 + i) for i, n in enumerate([3, 9, 17, 26, 33, 41])]
_E2E_LLMS: dict[tuple, LLM] = {}


def _engine(path, num_blocks: int) -> LLM:
    """One engine per pool size for all examples (each example must leave it drained)."""
    key = (str(path), num_blocks)
    if key not in _E2E_LLMS:
        llm = LLM(str(path), block_size=16, dtype="float64", num_blocks=num_blocks, num_window_blocks=8,
                  max_num_batched_tokens=24)
        _E2E_LLMS[key] = llm
    return _E2E_LLMS[key]


def _drive(llm: LLM, chosen: list[int], aborts: dict[int, int], max_tokens: int) -> dict[int, list[int]]:
    engine = check_every_step(llm.llm_engine)
    rids = {i: engine.add_request(None, {"prompt_token_ids": _POOL[i]}, greedy(max_tokens)) for i in chosen}
    finished: dict[int, list[int]] = {}
    step = 0
    while engine.has_unfinished_requests():
        for i, at in aborts.items():
            if at == step:
                engine.abort_request(rids[i])
                engine.block_manager.check_invariants()
        for out in engine.step():
            if out.finished:
                i = next(k for k, r in rids.items() if r == out.request_id)
                assert i not in aborts or aborts[i] > step, "an aborted request produced a final output"
                finished[i] = out.outputs[0].token_ids
        step += 1
        assert step < 500
    assert_drained(engine)
    return finished


@settings(deadline=None, max_examples=6, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    chosen=st.lists(st.integers(0, len(_POOL) - 1), min_size=2, max_size=5, unique=True),
    data=st.data(),
    tight=st.booleans(),
)
def test_aborts_leave_the_others_unchanged(tiny_path, chosen, data, tight):
    path = tiny_path("tiny")
    llm = _engine(path, num_blocks=6 if tight else 64)
    aborted = data.draw(st.lists(st.sampled_from(chosen), max_size=len(chosen) - 1, unique=True))
    aborts = {i: data.draw(st.integers(0, 8)) for i in aborted}
    with_aborts = _drive(llm, chosen, aborts, max_tokens=6)
    kept = [i for i in chosen if i not in aborts]
    without = _drive(llm, kept, {}, max_tokens=6)
    assert set(without) == set(kept)
    for i in kept:
        assert with_aborts[i] == without[i]

"""Prefix caching: outputs with caching on equal caching off (float64, cpu_ref), on every alignment of the
shared prefix against block size (16), sliding window (8) and compression rates (4, 8); the replay and
fall-back paths when window blocks were evicted; concurrent sharing; and the block books under random
sharing, eviction and reuse."""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer_core.engine.block_manager import BlockManager
from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.sampling.params import SamplingParams
from tests.engine_fixtures import BLOCK_SIZE, greedy, make_llm, make_prompt, one_torch_thread, tiny_path  # noqa: F401

SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=6, ignore_eos=True, seed=11, logprobs=2)


def _outputs(llm, prompts, params, one_by_one):
    if one_by_one:
        outs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in prompts]
    else:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert all(o.error is None for o in outs)
    return outs


def _assert_same(a, b):
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for lx, ly in zip(x.outputs[0].logprobs or [], y.outputs[0].logprobs or []):
            assert lx.keys() == ly.keys()
            assert all(abs(lx[t] - ly[t]) <= 1e-9 for t in lx)


def _family(base_len=90, seed=0):
    """Prompts sharing a prefix of every length from 1 to base_len (each with its own continuation)."""
    rng = random.Random(seed)
    base = make_prompt(base_len, seed)
    lengths = [1, 3, 4, 7, 8, 9, 15, 16, 17, 23, 24, 31, 32, 33, 40, 47, 48, 63, 64, 65, 80, 90]
    return [base[:n] + make_prompt(rng.randrange(0, 6), 100 + n) for n in lengths]


@pytest.mark.parametrize("name, one_by_one", [
    # tiny one by one (exact cached counts), v41 in batches (sharing inside a step); the rest slow
    ("tiny", True), ("v41", False),
    *(pytest.param(n, o, marks=pytest.mark.slow)
      for n, o in [("tiny", False), ("v41", True), ("tiny_hc1", True), ("tiny_hc1", False)]),
], ids=lambda v: {True: "sequential", False: "concurrent"}.get(v, v) if isinstance(v, bool) else v)
def test_caching_on_equals_off(tiny_path, make_llm, name, one_by_one):  # noqa: F811
    prompts = _family()
    params = [greedy(5, logprobs=2), SAMPLED]
    off = make_llm(tiny_path(name), dtype="float64", enable_prefix_caching=False, max_num_batched_tokens=40)
    on = make_llm(tiny_path(name), dtype="float64", enable_prefix_caching=True, max_num_batched_tokens=40)
    for p in params:
        ref = _outputs(off, prompts, p, one_by_one)
        got = _outputs(on, prompts, p, one_by_one)
        _assert_same(ref, got)
    stats = on.llm_engine.prefix_cache_stats()
    assert stats["hit_tokens"] > 0 and 0 < stats["hit_rate"] < 1
    if one_by_one:
        # the second pass (sampled) finds every full block of every prompt except the last token's block
        cached = [o.num_cached_tokens for o in _outputs(on, prompts, SAMPLED, True)]
        assert cached == [(len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in prompts]


def test_repeated_prompt_hits_and_reset(tiny_path, make_llm):  # noqa: F811
    llm = make_llm(tiny_path("tiny"), dtype="float64")
    prompt = make_prompt(70, 3)
    first = _outputs(llm, [prompt], greedy(4), True)[0]
    second = _outputs(llm, [prompt], greedy(4), True)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 64
    assert first.outputs[0].token_ids == second.outputs[0].token_ids
    llm.reset_prefix_cache()
    assert llm.llm_engine.prefix_cache_stats()["hit_tokens"] == 0
    third = _outputs(llm, [prompt], greedy(4), True)[0]
    assert third.num_cached_tokens == 0 and third.outputs[0].token_ids == first.outputs[0].token_ids


def _evict_window_block(llm, prompt, logical):
    """Drop the cached window block of ``prompt``'s block ``logical`` (what LRU eviction would do)."""
    bm = llm.llm_engine.block_manager
    seq = Sequence("probe", 0, prompt, greedy(1), None)
    h = bm.block_hashes(seq, logical + 1)[logical]
    block = bm.window_blocks.lookup(h)
    assert block is not None and bm.window_blocks.ref[block] == 0
    bm.window_blocks.lru.pop(block)
    bm.window_blocks._forget(block)
    bm.window_blocks.free.append(block)


@pytest.mark.parametrize("max_replay", [512, 0], ids=["replay", "fallback"])
def test_evicted_window_blocks_replay_or_fall_back(tiny_path, make_llm, max_replay):  # noqa: F811
    base = make_prompt(80, 4)
    prompt = base + make_prompt(5, 5)
    off = make_llm(tiny_path("tiny"), dtype="float64", enable_prefix_caching=False)
    on = make_llm(tiny_path("tiny"), dtype="float64", max_replay_tokens=max_replay)
    ref = _outputs(off, [prompt], SAMPLED, True)
    _outputs(on, [base + [7]], greedy(2), True)  # caches blocks 0..4 of ``base``
    _evict_window_block(on, prompt, 4)  # the window of boundary 80 is gone; boundary 64 still has it
    got = _outputs(on, [prompt], SAMPLED, True)
    _assert_same(ref, got)
    stats = on.llm_engine.prefix_cache_stats()
    assert got[0].num_cached_tokens == 64
    assert stats["replayed_tokens"] == (16 if max_replay else 0)


def test_concurrent_requests_share_blocks(tiny_path, make_llm):  # noqa: F811
    base = make_prompt(64, 6)
    llm = make_llm(tiny_path("tiny"), dtype="float64")
    _outputs(llm, [base + [5]], greedy(1), True)
    engine = llm.llm_engine
    for i in range(4):
        engine.add_request(f"r{i}", {"prompt_token_ids": base + make_prompt(3, 20 + i)}, greedy(3))
    engine.step()
    tables = [s.block_table[:4] for r in engine.requests.values() for s in r.seqs]
    assert len(tables) == 4 and all(t == tables[0] for t in tables)
    assert all(engine.block_manager.blocks.ref[b] == 4 for b in tables[0])
    while engine.has_unfinished_requests():
        engine.step()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_block_books_under_sharing_and_eviction(data):
    """Random admissions of prefix-sharing sequences, steps, trims, frees and resets on tiny pools:
    the books balance after every operation and shared blocks are never written (assert_private)."""
    bs, window = 4, 3
    bm = BlockManager(num_blocks=data.draw(st.integers(6, 14)), num_window_blocks=data.draw(st.integers(4, 9)),
                      num_state_slots=3, block_size=bs, sliding_window=window, enable_prefix_caching=True,
                      max_replay_tokens=data.draw(st.sampled_from([0, 4, 64])))
    stems = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 9, 9, 9, 9], [7] * 12]
    live: list[Sequence] = []
    for _ in range(data.draw(st.integers(5, 30))):
        action = data.draw(st.sampled_from(["add", "step", "free", "reset"]))
        if action == "add" and len(live) < 3:
            stem = data.draw(st.sampled_from(stems))
            tokens = stem[: data.draw(st.integers(1, len(stem)))] + data.draw(st.lists(st.integers(0, 20), max_size=5))
            seq = Sequence("s", 0, tokens, greedy(1), None)
            bm.admit(seq)
            live.append(seq)
        elif action == "step" and live:
            seq = data.draw(st.sampled_from(live))
            n = min(seq.num_uncomputed, data.draw(st.integers(1, 6)))
            if n and bm.can_allocate(seq, n):
                bm.allocate(seq, n)
                seq.num_computed_tokens += n
                bm.commit(seq)
                if seq.num_uncomputed == 0:
                    seq.output_token_ids.append(data.draw(st.integers(0, 20)))
        elif action == "free" and live:
            seq = data.draw(st.sampled_from(live))
            bm.free(seq)
            live.remove(seq)
        elif action == "reset":
            bm.reset_prefix_cache()
        bm.check_invariants()
    for seq in live:
        bm.free(seq)
    bm.check_invariants()
    assert bm.all_free()


def test_waiting_request_does_not_pin_reused_blocks(tiny_path, make_llm):  # noqa: F811
    """A waiting request whose prefix hit cannot be scheduled yet gives the reused blocks back, so a
    running request is never refused memory the pools have (regression: it was failed as unfittable)."""
    lengths, budgets = [40, 7, 25, 33, 12, 50], [60, 12, 6, 60, 3, 59]
    prompts = [make_prompt(n, 800 + i) for i, n in enumerate(lengths)]
    params = [SamplingParams(temperature=0.9, seed=i, max_tokens=m, ignore_eos=True) for i, m in enumerate(budgets)]
    outs = {}
    for cache in (True, False):
        llm = make_llm(tiny_path("tiny"), num_blocks=16, num_window_blocks=6, max_num_batched_tokens=16,
                       enable_prefix_caching=cache)
        outs[cache] = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert all(o.outputs[0].finish_reason == "length" for o in outs[cache])
    assert [o.outputs[0].token_ids for o in outs[True]] == [o.outputs[0].token_ids for o in outs[False]]

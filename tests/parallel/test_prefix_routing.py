"""Prefix-cache affinity in the data-parallel front-end: requests sharing full KV blocks of prompt go to
the rank that computed them (and hit its prefix cache there), unless it is overloaded; others go to the
least loaded rank."""

from __future__ import annotations

import engine_fixtures
from engine_fixtures import greedy, make_prompt

from deepinfer_core.entrypoints.llm import LLM
from deepinfer_core.parallel.prefix_router import PrefixAffinityRouter, block_hashes

one_torch_thread = engine_fixtures.one_torch_thread


def test_block_hashes_chain_full_blocks_only():
    a, b = [5, 6, 7, 8, 9], [5, 6, 7, 9, 9]
    assert len(block_hashes(a, 2)) == 2 and block_hashes(a, 2)[0] == block_hashes(b, 2)[0]
    assert block_hashes(a, 2)[1] != block_hashes(b, 2)[1]
    assert block_hashes([1, 2], 4) == []


def test_router_prefers_the_rank_with_the_prefix_unless_it_is_overloaded():
    router = PrefixAffinityRouter(num_ranks=2, block_size=4, max_imbalance_tokens=100)
    shared = list(range(10, 22))
    assert router.choose(shared + [1], [0, 0]) == 0
    assert router.choose(list(range(50, 60)), [13, 0]) == 1  # no shared block: least loaded
    assert router.choose(shared[:8] + [2, 3, 4, 5], [23, 10]) == 0  # two shared blocks: their rank
    assert router.num_affinity_hits == 1
    assert router.choose(shared[:4] + [7] * 8, [500, 10]) == 1  # rank 0 is too busy
    assert router.choose([3, 3, 3], [0, 5]) == 0  # shorter than a block


def test_data_parallel_front_end_routes_a_shared_prefix_to_one_rank():
    llm = LLM(dtype="float32", block_size=32, max_num_batched_tokens=256, data_parallel_size=2,
              distributed_timeout_s=120)
    engine = llm.llm_engine
    try:
        system = make_prompt(64, seed=7, vocab_size=4096)
        llm.generate([system + make_prompt(5, seed=8, vocab_size=4096)], greedy(3), use_tqdm=False)
        before = engine.prefix_cache_stats()["hit_tokens"]
        ids = [engine.add_request(f"follow{i}", system + make_prompt(6, seed=20 + i, vocab_size=4096), greedy(4))
               for i in range(3)]
        ids.append(engine.add_request("other", make_prompt(30, seed=9, vocab_size=4096), greedy(4)))
        # the follow-ups join the shared prefix on rank 0 although rank 1 is idle; the other one goes there
        assert [engine._owner[r] for r in ids] == [0, 0, 0, 1]
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.prefix_cache_stats()["hit_tokens"] - before >= 3 * 32
    finally:
        engine.shutdown()

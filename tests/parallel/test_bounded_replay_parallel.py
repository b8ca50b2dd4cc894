"""Bounded replay under expert parallel (gloo, two rank processes): the ranks stay in lock-step when one
rank's chunk has no tail token (compact skips its late layers, yet meets the other rank in every late MoE
collective) or nothing at all; greedy float32 tokens equal the single process's, for mask and compact."""

from __future__ import annotations

import engine_fixtures
import pytest
from engine_fixtures import greedy, make_prompt

from deepinfer_core.entrypoints.llm import LLM
from deepinfer_core.testing.tiny_v41 import build_tiny_v41

one_torch_thread = engine_fixtures.one_torch_thread
LENGTHS = [3, 9, 30, 41, 70]
MAX_TOKENS = [6, 4, 9, 5, 7]


# mask (slow) runs the late layers over every token: no rank skips them, compact is the lock-step case
@pytest.mark.parametrize("mode", ["compact", pytest.param("mask", marks=pytest.mark.slow)])
def test_expert_parallel_ranks_equal_one_process(tmp_path_factory, mode):
    path = build_tiny_v41(tmp_path_factory.mktemp("replay_ep") / "v41", seed=0, engram_layer_ids=[1, 3])
    kw = dict(model=str(path), dtype="float32", block_size=engine_fixtures.BLOCK_SIZE, max_num_batched_tokens=16,
              max_num_seqs=6, bounded_replay=mode)
    single = LLM(**kw)
    parallel = LLM(**kw, data_parallel_size=2, enable_expert_parallel=True, distributed_timeout_s=120)
    try:
        prompts = [{"prompt_token_ids": make_prompt(n, seed=i, vocab_size=3900)} for i, n in enumerate(LENGTHS)]
        params = [greedy(m) for m in MAX_TOKENS]
        expected = [o.outputs[0].token_ids for o in single.generate(prompts, params, use_tqdm=False)]
        assert [o.outputs[0].token_ids for o in parallel.generate(prompts, params, use_tqdm=False)] == expected
    finally:
        parallel.llm_engine.shutdown()

"""MoE expert parallel: routed experts sharded over ranks, tokens dispatched to their experts' ranks and
combined back (``DeepseekV4Model.moe`` through the worker's EP dispatcher).

In process: a one-rank dispatcher gives the very same logits as the local MoE (the combine sums a token's
terms in the order the MoE op does); ``shard_experts`` keeps exactly a rank's slice. Across processes
(gloo, two rank processes, attention data parallel + expert parallel): greedy float32 tokens on a tiny
test checkpoint equal the single-process engine's for concurrent requests of mixed lengths, with chunked
prefill and preemption, and one rank idle for many steps.
"""

from __future__ import annotations

import engine_fixtures
import pytest
import torch
from engine_fixtures import greedy, make_prompt
from model_fixtures import engine_logits, no_kernel_packs

from deepinfer_core.comm import TorchDistributedCommunicator
from deepinfer_core.entrypoints.llm import LLM
from deepinfer_core.models import load_model
from deepinfer_core.parallel.ep import AllToAllDispatcher, dummy_moe_step, shard_experts

one_torch_thread = engine_fixtures.one_torch_thread
tiny_path = engine_fixtures.tiny_path

BLOCK = engine_fixtures.BLOCK_SIZE


class _SliceOnly:
    """What shard_experts reads of a dispatcher: rank 1 of 2 over 6 experts."""

    num_experts = 6
    local_experts = range(3, 6)


def _model(path, dtype=torch.float32):
    with no_kernel_packs():
        return load_model(path, dtype=dtype)


def test_one_rank_dispatcher_gives_the_local_moe_bit_for_bit(tiny_path):
    path = tiny_path("tiny")
    local, dispatched = _model(path), _model(path)
    shard_experts(dispatched, AllToAllDispatcher(TorchDistributedCommunicator(None), 6, dispatched.cfg.hidden_size))
    assert dispatched.ep is not None and local.ep is None
    ids = make_prompt(37, seed=3)
    assert torch.equal(engine_logits(dispatched, ids, chunk=16), engine_logits(local, ids, chunk=16))


def test_shard_experts_keeps_the_rank_slice_and_a_placeholder_step_runs(tiny_path):
    path = tiny_path("tiny")
    full, model = _model(path), _model(path)
    shard_experts(model, _SliceOnly())
    for whole, part in zip(full.weights.layers, model.weights.layers):
        for name in ("w13", "w2"):
            w, p = getattr(whole.moe.experts, name).weight, getattr(part.moe.experts, name).weight
            assert p.shape[0] == 3 and torch.equal(p, w[3:6])
        assert torch.equal(part.moe.shared.w13.weight, whole.moe.shared.w13.weight)  # shared expert: local
    mtp = model.drafter.moe_layers()[0].experts.w13.weight
    assert mtp.shape[0] == 3
    with pytest.raises(ValueError, match="holds 3 experts"):
        shard_experts(model, _SliceOnly())
    one_rank = _model(path)
    shard_experts(one_rank, AllToAllDispatcher(TorchDistributedCommunicator(None), 6, one_rank.cfg.hidden_size))
    dummy_moe_step(one_rank)  # no tokens: every MoE layer's dispatch and combine, nothing computed


LENGTHS = [1, 3, 8, 9, 17, 30, 41, 70]
MAX_TOKENS = [6, 9, 1, 12, 5, 8, 10, 7]


@pytest.fixture(scope="module")
def engines(tiny_path):
    """The single-process engine and the two-rank expert-parallel one, on the same arguments: a small
    token budget (chunked prefill) and a small pool (preemption)."""
    kw = dict(model=str(tiny_path("tiny")), dtype="float32", block_size=BLOCK, max_num_batched_tokens=24,
              num_blocks=9, num_window_blocks=4, max_num_seqs=6)
    single = LLM(**kw)
    parallel = LLM(**kw, data_parallel_size=2, enable_expert_parallel=True, distributed_timeout_s=120)
    yield single, parallel
    parallel.llm_engine.shutdown()


def _tokens(llm, prompts, params):
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


def test_two_expert_parallel_ranks_equal_one_process(engines):
    single, parallel = engines
    engine = parallel.llm_engine
    assert [info["local_experts"] for info in engine.rank_info] == [(0, 3), (3, 6)]
    prompts = [make_prompt(n, seed=i) for i, n in enumerate(LENGTHS)]
    params = [greedy(m) for m in MAX_TOKENS]
    expected = _tokens(single, prompts, params)
    assert single.llm_engine.scheduler.num_preemptions > 0  # the small pool preempted some sequence
    assert _tokens(parallel, prompts, params) == expected
    assert [len(t) for t in expected] == MAX_TOKENS
    assert not engine.has_unfinished_requests() and engine.load == [0, 0]


def test_an_idle_rank_runs_placeholder_steps(engines):
    single, parallel = engines
    prompt = make_prompt(45, seed=9)
    expected = _tokens(single, [prompt], greedy(20))
    before = parallel.llm_engine.rank_counters()
    assert _tokens(parallel, [prompt], greedy(20)) == expected
    after = parallel.llm_engine.rank_counters()
    steps = [a["steps"] - b["steps"] for a, b in zip(after, before)]
    placeholders = [a["placeholder_steps"] - b["placeholder_steps"] for a, b in zip(after, before)]
    assert steps[0] == steps[1] >= 20 + 1  # lock-step: two prefill chunks, then a decode step per token
    assert placeholders == [0, steps[1]]  # rank 1 had nothing, and met rank 0 in every MoE collective


def test_two_expert_parallel_ranks_equal_one_process_v41(tiny_path):
    """DeepSeek-V4.1 (shared KV pools, Engram, packed FP4 experts) under two expert-parallel ranks: the
    single process's greedy tokens, through chunked prefill and preemption."""
    kw = dict(model=str(tiny_path("v41")), dtype="float32", block_size=BLOCK, max_num_batched_tokens=24,
              num_blocks=9, num_window_blocks=4, max_num_seqs=6)
    single = LLM(**kw)
    parallel = LLM(**kw, data_parallel_size=2, enable_expert_parallel=True, distributed_timeout_s=120)
    try:
        assert [info["local_experts"] for info in parallel.llm_engine.rank_info] == [(0, 4), (4, 8)]
        prompts = [make_prompt(n, seed=i) for i, n in enumerate(LENGTHS)]
        params = [greedy(m) for m in MAX_TOKENS]
        expected = _tokens(single, prompts, params)
        assert single.llm_engine.scheduler.num_preemptions > 0
        assert _tokens(parallel, prompts, params) == expected
    finally:
        parallel.llm_engine.shutdown()

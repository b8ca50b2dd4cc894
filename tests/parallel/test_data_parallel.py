"""Attention data parallel (two rank processes, gloo) on the embedded tiny model, float32.

``LLM(data_parallel_size=2, enable_expert_parallel=True)`` gives the single-process engine's greedy
tokens for concurrent requests of different lengths, also with MTP speculation on the ranks;
LLMEngine's API (add_request / step / abort_request / has_unfinished_requests) works across the ranks
with outputs in the caller's order and requests spread by outstanding tokens. A rank killed
mid-generation, or one that stops answering, is a clear error naming it within the timeout, and no rank
process is left.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import engine_fixtures
import pytest
import torch
from engine_fixtures import greedy, make_prompt

from deepinfer_core.default_model import v4_model_path
from deepinfer_core.engine.args import EngineArgs
from deepinfer_core.engine.factory import make_engine
from deepinfer_core.entrypoints.cli_generate import add_engine_arguments, engine_kwargs
from deepinfer_core.entrypoints.llm import LLM
from deepinfer_core.parallel.data_parallel import DataParallelEngine
from deepinfer_core.parallel.dp_engine_core import RankFailure
from deepinfer_core.parallel.eplb import ExpertLoad

one_torch_thread = engine_fixtures.one_torch_thread

KW = dict(model=str(v4_model_path()), dtype="float32", max_num_batched_tokens=64)  # the trained tiny V4
LENGTHS = [1, 6, 19, 40, 70, 11, 3]
MAX_TOKENS = [8, 3, 12, 5, 8, 1, 10]
VOCAB = 4096


def _prompts() -> list[list[int]]:
    return [make_prompt(n, seed=i, vocab_size=VOCAB) for i, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def single():
    return LLM(**KW)


@pytest.fixture(scope="module")
def parallel():
    llm = LLM(**KW, data_parallel_size=2, enable_expert_parallel=True, distributed_timeout_s=120)
    yield llm
    llm.llm_engine.shutdown()


def _generate(llm, prompts, params):
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason)
            for o in llm.generate(prompts, params, use_tqdm=False)]


def test_llm_builds_the_data_parallel_front_end(parallel):
    engine = parallel.llm_engine
    assert isinstance(engine, DataParallelEngine) and engine.num_ranks == 2
    assert engine.plan.device_of_rank == {0: 0, 1: 0}  # cpu_ref: both ranks on the one CPU "device"
    assert [info["local_experts"] for info in engine.rank_info] == [(0, 3), (3, 6)]
    assert len(set(engine.rank_pids)) == 2 and os.getpid() not in engine.rank_pids


def test_concurrent_requests_equal_one_process(single, parallel):
    params = [greedy(m) for m in MAX_TOKENS]
    expected = _generate(single, _prompts(), params)
    assert _generate(parallel, _prompts(), params) == expected
    text = ["The capital of France is", "Once upon a time"]
    assert _generate(parallel, text, greedy(12)) == _generate(single, text, greedy(12))


def test_step_api_orders_outputs_balances_and_aborts(single, parallel):
    engine = parallel.llm_engine
    prompts = _prompts()[:5]
    expected = _generate(single, prompts, [greedy(10)] * 5)
    ids = [engine.add_request(f"r{i}", p, greedy(10)) for i, p in enumerate(prompts)]
    # least outstanding tokens: 1+10 -> rank 0, 6+10 -> rank 1, 19+10 -> rank 0, 40+10 -> rank 1, ...
    assert [engine._owner[r] for r in ids] == [0, 1, 0, 1, 0]
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("r0", [5, 6], greedy(2))
    with pytest.raises(ValueError, match="max_model_len"):  # refused by its rank: nothing queued
        engine.add_request("too-long", [5] * 5000, greedy(2))
    finished, steps = {}, 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps += 1
        order = [int(o.request_id[1:]) for o in outs]
        assert order == sorted(order)  # the caller's order, whichever rank ran them
        finished.update({o.request_id: o for o in outs if o.finished})
        if steps == 2:
            engine.abort_request("r3")
    assert "r3" not in finished and sorted(finished) == ["r0", "r1", "r2", "r4"]
    for i in (0, 1, 2, 4):
        assert finished[f"r{i}"].outputs[0].token_ids == expected[i][0]
    assert engine.load == [0, 0] and not engine._owner
    stats = engine.prefix_cache_stats()
    assert stats["query_tokens"] > 0 and 0 <= stats["hit_rate"] <= 1


def test_expert_load_is_counted_on_the_ranks(single, parallel):
    engine = parallel.llm_engine
    engine.expert_load()  # start a fresh window
    model = single.llm_engine.model
    model.expert_load = ExpertLoad.for_model(model)
    try:
        prompts = [make_prompt(n, seed=50 + n, vocab_size=VOCAB) for n in (5, 23, 48)]
        _generate(single, prompts, greedy(6))
        _generate(parallel, prompts, greedy(6))
        counts, expected = engine.expert_load(), model.expert_load.take()
    finally:
        model.expert_load = None
    cfg = single.llm_engine.model_config
    tokens = sum(len(p) + 6 - 1 for p in prompts)  # every prompt token and every output but the last
    assert counts.shape == (cfg.num_hidden_layers, cfg.n_routed_experts)
    assert counts.sum(1).tolist() == [tokens * cfg.num_experts_per_tok] * cfg.num_hidden_layers
    assert torch.equal(counts, expected)  # the routing of one process
    assert engine.expert_load().sum() == 0  # taken: the next window starts empty


def test_cli_flags_reach_the_engine_arguments():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    kwargs = engine_kwargs(parser.parse_args(["-dp", "2", "--enable-expert-parallel"]))
    assert kwargs["data_parallel_size"] == 2 and kwargs["enable_expert_parallel"] is True
    args = EngineArgs(**kwargs)
    assert (args.data_parallel_size, args.enable_expert_parallel) == (2, True)
    assert "enable_expert_parallel" not in engine_kwargs(parser.parse_args([]))


def test_bad_parallel_arguments_are_refused_before_spawning():
    with pytest.raises(ValueError, match="data_parallel_size must be"):
        make_engine(EngineArgs(data_parallel_size=0))
    with pytest.raises(ValueError, match="cannot be split evenly over 4"):
        make_engine(EngineArgs(model=KW["model"], data_parallel_size=4, enable_expert_parallel=True))  # 6 experts


def test_arguments_every_rank_refuses_are_a_value_error():
    with pytest.raises(ValueError, match="max_model_len 9999 exceeds") as info:
        LLM(model=KW["model"], dtype="float32", data_parallel_size=2, max_model_len=9999)
    assert isinstance(info.value.__cause__, RankFailure)


def _assert_all_gone(engine: DataParallelEngine) -> None:
    assert not any(proc.is_alive() for proc in engine.ranks.procs)
    for pid in engine.rank_pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_killed_rank_is_a_clear_error_and_no_rank_survives():
    llm = LLM(**KW, data_parallel_size=2, enable_expert_parallel=True, distributed_timeout_s=60)
    engine = llm.llm_engine
    for i, p in enumerate(_prompts()[:4]):
        engine.add_request(str(i), p, greedy(30))
    engine.step()
    engine.step()
    os.kill(engine.rank_pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 1 died \(signal SIGKILL\)"):
        for _ in range(10):
            engine.step()
    assert time.monotonic() - start < 30  # seen at once, not after the collective timeout
    _assert_all_gone(engine)
    with pytest.raises(RankFailure, match="failed before"):
        engine.step()
    engine.abort_request("0")  # nothing left to abort
    with pytest.raises(RankFailure, match="rank 1 died"):  # LLM.generate does not wait forever either
        llm.generate([[5, 6, 7]], greedy(3), use_tqdm=False)


@pytest.mark.slow  # waits out the timeout
def test_a_hung_rank_is_named_after_the_timeout():
    """Rank 1 stops (SIGSTOP) in the middle of a run: rank 0's collective times out, rank 1 is the one
    reported silent; without expert parallel nobody would wait, so expert parallel is on."""
    llm = LLM(**KW, data_parallel_size=2, enable_expert_parallel=True, distributed_timeout_s=3)
    engine = llm.llm_engine
    for i, p in enumerate(_prompts()[:2]):
        engine.add_request(str(i), p, greedy(30))
    engine.step()
    os.kill(engine.rank_pids[1], signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1 gave no answer") as info:
        engine.step()
    assert "rank 0 failed" in str(info.value)  # its collective timed out waiting for rank 1
    assert time.monotonic() - start < 3 + 5 + 10
    _assert_all_gone(engine)


@pytest.mark.parametrize("expert_parallel,schedule", [
    (False, "fixed"), *(pytest.param(*p, marks=pytest.mark.slow) for p in [(True, "fixed"), (True, "confidence")]),
])
def test_speculative_decoding_on_the_ranks_equals_one_process(expert_parallel, schedule):
    """MTP speculation (k=2) on every rank of ``data_parallel_size=2``: with expert parallel every rank
    runs the MTP block k times a step whatever it drafts (an idle rank's placeholder step too), and every
    step speculates (confidence scheduling chooses no plain steps there), so the ranks' collectives line
    up. The greedy tokens are those of one process without speculation
    (float64, the trained model and held-out text, so drafts are accepted and rejected; a prompt
    prefilled in chunks), and the counters are the ranks' summed."""
    kw = dict(KW, dtype="float64")  # V4: its MTP drafter
    single = LLM(**kw)
    ids = single.llm_engine.encode(open("data/heldout_slice.txt").read())
    # the first prompt is prefilled in chunks: its rank's first steps draft nothing (the catch-up only)
    prompts = [ids[:150]] + [ids[i * 120: i * 120 + 10 + 13 * i] for i in range(1, 5)]
    params = [greedy(m) for m in (20, 4, 14, 9, 26)]
    expected = _generate(single, prompts, params)
    spec = {"method": "mtp", "num_speculative_tokens": 2, "schedule": schedule}
    llm = LLM(**kw, data_parallel_size=2, enable_expert_parallel=expert_parallel, speculative_config=spec,
              distributed_timeout_s=120)
    try:
        engine = llm.llm_engine
        assert _generate(llm, prompts, params) == expected
        stats = engine.spec_decode_stats()
        assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"], stats
        counters = engine.rank_counters()
        if expert_parallel:  # a rank with nothing left ran placeholder steps beside its peer's
            assert sum(c["placeholder_steps"] for c in counters) > 0, counters
    finally:
        llm.llm_engine.shutdown()

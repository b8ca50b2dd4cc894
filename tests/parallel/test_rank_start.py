"""How rank processes start: CPU ranks from the fork server by default, accelerator ranks and every rank
under ``DEEPINFER_WORKER_MULTIPROC_METHOD=spawn`` as fresh interpreters. Either way a rank sees the
front-end's environment as it is when the engine is built (not the fork server's from when it started)."""

from __future__ import annotations

import os

import engine_fixtures
import pytest
from engine_fixtures import greedy, make_prompt

from deepinfer_core.default_model import v4_model_path
from deepinfer_core.entrypoints.llm import LLM
from deepinfer_core.parallel.dp_engine_core import MULTIPROC_METHOD_ENV, rank_start_context

one_torch_thread = engine_fixtures.one_torch_thread

KW = dict(model=str(v4_model_path()), dtype="float32", max_num_batched_tokens=64)
MARK = "DEEPINFER_TEST_RANK_START_MARK"


def _environment_of_rank(engine, name: str) -> tuple[str | None, int]:
    return os.environ.get(name), os.getppid()


def test_the_method_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(MULTIPROC_METHOD_ENV, raising=False)
    assert rank_start_context().get_start_method() == "forkserver"
    assert rank_start_context("cuda").get_start_method() == "spawn"
    monkeypatch.setenv(MULTIPROC_METHOD_ENV, "spawn")
    assert rank_start_context().get_start_method() == "spawn"
    monkeypatch.setenv(MULTIPROC_METHOD_ENV, "fork")  # forks this process's OpenMP pool and CUDA state
    with pytest.raises(ValueError, match="DEEPINFER_WORKER_MULTIPROC_METHOD='fork'.*forkserver, spawn"):
        rank_start_context()


# spawn (slow: two fresh interpreters, 14 s in the default run): the accelerator ranks' start, the one
# every rank had before the fork server; forkserver pickles the same process object
@pytest.mark.parametrize("method", ["forkserver", pytest.param("spawn", marks=pytest.mark.slow)])
def test_ranks_see_the_environment_of_the_engines_build(method, monkeypatch):
    """Spawned ranks also give one process's tokens (forked ones do in every other test of this folder)."""
    monkeypatch.setenv(MULTIPROC_METHOD_ENV, method)
    rank_start_context()  # the fork server (if any) starts before the mark exists
    monkeypatch.setenv(MARK, method)
    if method == "spawn":
        prompts = [make_prompt(n, seed=i, vocab_size=4096) for i, n in enumerate([3, 17])]
        expected = [o.outputs[0].token_ids for o in LLM(**KW).generate(prompts, greedy(4), use_tqdm=False)]
    llm = LLM(**KW, data_parallel_size=2, enable_expert_parallel=True, distributed_timeout_s=120)
    try:
        seen = llm.llm_engine.collective_rpc(_environment_of_rank, (MARK,))
        assert [value for value, _ in seen] == [method, method]
        if method == "spawn":  # a fresh interpreter per rank, started by this process
            assert {parent for _, parent in seen} == {os.getpid()}
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(4), use_tqdm=False)]
            assert got == expected
        else:  # forked by the server, a child of this process
            assert os.getpid() not in {parent for _, parent in seen}
    finally:
        llm.llm_engine.shutdown()

"""The engine joins ranks started by torchrun (``distributed_executor_backend="external_launcher"``,
env:// rendezvous): two CPU processes under ``python -m torch.distributed.run``, expert parallel with
EPLB over gloo, each rank with its own requests, give the single-process float64 greedy tokens and
logprobs, and a rank that finished early meets its peer's steps until it is done."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import engine_fixtures
import pytest

from deepinfer_core.engine.args import EngineArgs
from deepinfer_core.engine.factory import make_engine
from deepinfer_core.entrypoints.llm import LLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torchrun_rank  # noqa: E402

one_torch_thread = engine_fixtures.one_torch_thread
tiny_path = engine_fixtures.tiny_path


def test_two_torchrun_ranks_equal_one_process(tiny_path, tmp_path):
    model = str(tiny_path("tiny"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(Path(torchrun_rank.__file__)), model, str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    single = LLM(model=model, dtype="float64", block_size=16, max_num_batched_tokens=32)
    outs = single.generate(torchrun_rank.prompts(), torchrun_rank.params(), use_tqdm=False)
    for rank in ranks:
        assert rank["local_experts"] == list(range(4 * rank["rank"], 4 * rank["rank"] + 4))  # 6 + 2 slots
        for i, tokens, logprobs in zip(rank["requests"], rank["tokens"], rank["logprobs"]):
            assert tokens == outs[i].outputs[0].token_ids
            expected = [lp[t] for lp, t in zip(outs[i].outputs[0].logprobs, tokens)]
            assert max(abs(a - b) for a, b in zip(logprobs, expected)) < 1e-10
    assert ranks[0]["eplb_steps"] == ranks[1]["eplb_steps"] > 5  # lock-step, rearranged on the way
    assert ranks[0]["counters"]["placeholder_steps"] + ranks[1]["counters"]["placeholder_steps"] > 0


def test_external_launcher_outside_torchrun_is_a_clear_error(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="runs under torchrun, but RANK"):
        make_engine(EngineArgs(data_parallel_size=2, enable_expert_parallel=True,
                               distributed_executor_backend="external_launcher"))
    with pytest.raises(ValueError, match="distributed_executor_backend must be"):
        make_engine(EngineArgs(data_parallel_size=2, distributed_executor_backend="ray"))

"""The engine's layers: LLMEngine -> Executor -> Worker -> ModelRunner over picklable step data; one
pure stop check; one output router shared by generate() and stream(); a failing step ends only its own
requests; and no CUDA call in the device-independent core."""

from __future__ import annotations

import pickle
import subprocess
from pathlib import Path
from types import SimpleNamespace

import engine_fixtures
import pytest
from engine_fixtures import greedy, make_prompt

from deepinfer_core.engine.scheduler_output import SchedulerOutput
from deepinfer_core.engine.stop import FinishStatus, check_stop
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.worker.outputs import ModelRunnerOutput

make_llm = engine_fixtures.make_llm
one_torch_thread = engine_fixtures.one_torch_thread
tiny_path = engine_fixtures.tiny_path
REPO = Path(__file__).resolve().parents[2]
EOS = 1


def _seq(prompt_len: int, outputs: list[int], grammar_done: bool = False, **params) -> SimpleNamespace:
    grammar = SimpleNamespace(is_terminated=True) if grammar_done else None
    return SimpleNamespace(prompt_token_ids=[7] * prompt_len, completed_output_ids=outputs,
                           params=SamplingParams(**params), eos_token_ids=[EOS], grammar=grammar)


STOP_TABLE = [
    # (prompt length, outputs, params, grammar done, max_model_len, expected)
    (3, [], {}, False, 64, None),
    (3, [5], {}, False, 64, None),
    (3, [5, EOS], {}, False, 64, (FinishStatus.STOPPED, None)),
    (3, [5, EOS], {"ignore_eos": True}, False, 64, None),
    (3, [EOS], {"min_tokens": 2}, False, 64, None),
    (3, [5, EOS], {"min_tokens": 2}, False, 64, (FinishStatus.STOPPED, None)),
    (3, [5, 9], {"stop_token_ids": [9]}, False, 64, (FinishStatus.STOPPED, 9)),
    (3, [9], {"stop_token_ids": [9], "min_tokens": 2}, False, 64, None),
    (3, [5, 9], {"stop_token_ids": [9], "max_tokens": 2}, False, 64, (FinishStatus.STOPPED, 9)),  # stop wins
    (3, [5, 6], {"max_tokens": 2}, False, 64, (FinishStatus.LENGTH_CAPPED, None)),
    (3, [5, 6], {"max_tokens": 3}, False, 64, None),
    (3, [5, 6], {}, False, 5, (FinishStatus.LENGTH_CAPPED, None)),  # max_model_len
    (3, [5, 6], {}, False, 6, None),
    (3, [5], {}, True, 64, (FinishStatus.STOPPED, None)),  # the grammar completed
    (3, [5, EOS], {"min_tokens": 3, "max_tokens": 3}, False, 64, None),
]


@pytest.mark.parametrize("prompt_len,outputs,params,grammar_done,max_len,expected", STOP_TABLE)
def test_check_stop_table(prompt_len, outputs, params, grammar_done, max_len, expected):
    assert check_stop(_seq(prompt_len, outputs, grammar_done, **params), max_len) == expected


def test_finish_status_values_are_the_openai_finish_reasons():
    assert [s.value for s in FinishStatus] == ["stop", "length", "abort", "error"]
    assert FinishStatus.STOPPED == "stop"


def test_step_data_crosses_a_process_boundary(make_llm, tiny_path):
    """What the engine sends a worker and gets back pickles: host data only, no device tensors."""
    llm = make_llm(tiny_path("tiny"), dtype="float32")
    engine = llm.llm_engine
    sent, got = [], []
    execute = engine.executor.execute_model

    class Recording:
        def __init__(self, out):
            self.out = out

        def get_output(self):
            result = self.out.get_output()
            got.append(pickle.loads(pickle.dumps(result)))
            return result

    def recording(so):
        sent.append(pickle.loads(pickle.dumps(so)))
        return Recording(execute(so))

    engine.executor.execute_model = recording
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=5, logprobs=2)
    out = llm.generate([{"prompt_token_ids": make_prompt(20, seed=1)}], params, use_tqdm=False)[0]
    assert all(isinstance(so, SchedulerOutput) for so in sent) and len(sent) >= 5
    assert sent[0].new_requests and not sent[1].new_requests
    assert all(isinstance(r, ModelRunnerOutput) for r in got)
    assert [r.sampled_token_ids[0] for r in got if r.seq_ids] == out.outputs[0].token_ids


def test_generate_and_stream_interleaved_each_get_their_own_outputs(make_llm, tiny_path):
    path = tiny_path("tiny")
    prompts = [make_prompt(n, seed=i) for i, n in enumerate([9, 17, 30])]
    alone = make_llm(path, dtype="float32")
    want_stream = [o.outputs[0].token_ids for o in alone.stream({"prompt_token_ids": prompts[0]}, greedy(6))]
    want_gen = [o.outputs[0].token_ids for o in alone.generate(
        [{"prompt_token_ids": p} for p in prompts[1:]], greedy(4), use_tqdm=False)]

    llm = make_llm(path, dtype="float32")
    stream = llm.stream({"prompt_token_ids": prompts[0]}, greedy(6))
    seen = [next(stream).outputs[0].token_ids]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], greedy(4), use_tqdm=False)
    seen += [o.outputs[0].token_ids for o in stream]  # the outputs of the steps generate() drove, in order
    assert [o.outputs[0].token_ids for o in outs] == want_gen
    assert seen[-1] == want_stream[-1] and seen == [want_stream[-1][:n] for n in range(1, 7)]
    assert not llm.llm_engine.has_unfinished_requests()


def test_two_streams_interleaved(make_llm, tiny_path):
    llm = make_llm(tiny_path("tiny"), dtype="float32")
    a = llm.stream({"prompt_token_ids": make_prompt(12, seed=5)}, greedy(3))
    b = llm.stream({"prompt_token_ids": make_prompt(13, seed=6)}, greedy(5))
    got_a, got_b = [next(a).request_id], [next(b).request_id]
    got_a += [o.request_id for o in a]
    got_b += [o.request_id for o in b]
    assert len(got_a) == 3 and len(set(got_a)) == 1 and len(got_b) == 5 and set(got_a) != set(got_b)


@pytest.mark.parametrize("where", ["launch", "finish"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_exception_in_a_step_fails_only_that_steps_requests(make_llm, tiny_path, where, async_scheduling):
    llm = make_llm(tiny_path("tiny"), dtype="float32", max_num_seqs=2, async_scheduling=async_scheduling)
    engine = llm.llm_engine
    healthy = make_llm(tiny_path("tiny"), dtype="float32").generate(
        [{"prompt_token_ids": make_prompt(10, seed=9)}], greedy(4), use_tqdm=False)[0].outputs[0].token_ids
    for i in range(2):
        engine.add_request(f"bad{i}", {"prompt_token_ids": make_prompt(10 + i, seed=i)}, greedy(8))
    engine.step()  # both prefilled
    execute, calls = engine.executor.execute_model, []

    def broken(so):
        calls.append(1)
        if len(calls) == 2:
            if where == "launch":
                raise RuntimeError("device lost")
            launched = execute(so)

            class Failing:
                def get_output(self):
                    launched.get_output()
                    raise RuntimeError("device lost")

            return Failing()
        return execute(so)

    engine.executor.execute_model = broken
    engine.add_request("later", {"prompt_token_ids": make_prompt(10, seed=9)}, greedy(4))  # waits for a slot
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
        engine.block_manager.check_invariants()
    for i in range(2):
        out = outs[f"bad{i}"]
        assert out.finished and out.outputs[0].finish_reason == "error" and "device lost" in out.error
    assert outs["later"].error is None and outs["later"].outputs[0].token_ids == healthy
    # (make_llm checks the block books after every step and that every pool is free at the end)


def test_the_core_makes_no_cuda_call():
    out = subprocess.run(
        ["git", "grep", "-n", r"torch.cuda\|type == .cuda", "deepinfer_core/engine", "deepinfer_core/model",
         "deepinfer_core/sampling", "deepinfer_core/worker"],
        cwd=REPO, capture_output=True, text=True)
    if out.returncode not in (0, 1):
        pytest.skip(f"not a git checkout: {out.stderr.strip()}")
    assert out.stdout == ""

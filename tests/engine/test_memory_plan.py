"""Per-rank memory: what ``deepinfer plan`` predicts for a parallel layout is what every rank allocates
(weight bytes, routed-expert bytes, KV pool bytes), for one process and for two expert-parallel ranks
with redundant EPLB slots (each rank then holds 4 of the 8 physical slots of the 6 experts), and for two
expert-parallel ranks of the trained V4.1 drafting with DSpark (each holds half its drafter's own experts)."""

from __future__ import annotations

import json

import engine_fixtures
import pytest

from deepinfer_core.default_model import default_model_path, v4_model_path
from deepinfer_core.engine.args import EngineArgs
from deepinfer_core.entrypoints.cli import main
from deepinfer_core.entrypoints.llm import LLM
from deepinfer_core.parallel.memory_plan import measured_memory, plan_memory
from deepinfer_core.sampling.params import SamplingParams

one_torch_thread = engine_fixtures.one_torch_thread

KW = dict(model=str(v4_model_path()), dtype="float32", max_num_batched_tokens=64, max_num_seqs=8,
          kv_cache_bytes=64 << 20)  # the trained tiny V4: 6 experts a layer
EP = dict(data_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
          eplb_config={"num_redundant_experts": 2})


def _predicted(ranks) -> list[dict[str, int]]:
    return [{k: r.as_dict()[k] for k in ("weight_bytes", "expert_bytes", "kv_bytes")} for r in ranks]


def test_one_process_allocates_what_the_plan_says():
    engine = LLM(**KW).llm_engine
    assert [measured_memory(engine.model, engine.cache)] == _predicted(plan_memory(EngineArgs(**KW)))


def test_expert_parallel_ranks_allocate_what_the_plan_says(capsys):
    plan = plan_memory(EngineArgs(**KW, **EP))
    whole = plan_memory(EngineArgs(**KW))[0]
    assert [r.expert_slots for r in plan] == [4, 4]
    assert plan[0].expert_bytes * 6 == whole.expert_bytes * 4  # 4 of 6 experts' worth per rank
    assert plan[0].weight_bytes - plan[0].expert_bytes == whole.weight_bytes - whole.expert_bytes
    llm = LLM(**KW, **EP, distributed_timeout_s=120)
    try:
        assert llm.llm_engine.rank_memory() == _predicted(plan)
    finally:
        llm.llm_engine.shutdown()
    assert main(["plan", "--model", KW["model"], "--dtype", "float32", "--max-num-batched-tokens", "64",
                 "--max-num-seqs", "8",
                 "--kv-cache-bytes", str(64 << 20), "-dp", "2", "--enable-expert-parallel", "--enable-eplb",
                 "--num-redundant-experts", "2", "--json"]) == 0
    assert [r for r in json.loads(capsys.readouterr().out)] == [r.as_dict() for r in plan]


def test_plan_refuses_what_it_cannot_predict():
    with pytest.raises(ValueError, match="float weights"):
        plan_memory(EngineArgs(**KW, quantization="fp8"))


def test_expert_parallel_ranks_with_dspark_hold_their_share_of_the_drafters_experts():
    """DSpark's stages have experts of their own (the trained default: 4 against the target's 8): with
    speculative decoding each expert-parallel rank keeps its share of those too, and the plan says so."""
    kw = dict(model=str(default_model_path()), dtype="float64", max_num_batched_tokens=64, max_num_seqs=4,
              kv_cache_bytes=32 << 20, speculative_config={"method": "dspark", "num_speculative_tokens": 2})
    ep = dict(data_parallel_size=2, enable_expert_parallel=True)
    plan = plan_memory(EngineArgs(**kw, **ep))
    alone = plan_memory(EngineArgs(**{**kw, "speculative_config": None}, **ep))
    assert plan[0].expert_bytes < alone[0].expert_bytes  # half the drafter's experts, not all of them
    prompts = [{"prompt_token_ids": list(range(40 + 7 * i, 70 + 7 * i))} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(**kw).generate(prompts, params, use_tqdm=False)]
    llm = LLM(**kw, **ep, distributed_timeout_s=120)
    try:
        assert llm.llm_engine.rank_memory() == _predicted(plan)
        # each rank read only its span of the drafter's experts and drafts as one process does
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    finally:
        llm.llm_engine.shutdown()

"""EPLB in the engine: redundant expert slots, the logical -> physical map the dispatcher applies, the
periodic gathering of the load, rearrangement by DeepSeek's policy and the weights moved between ranks.

In process (one rank): the slot map spreads a logical expert's pairs over its replicas; a model whose
stacks hold physical slots (with replicas) gives the logits of the plain model, before and after a
rearrangement. Across processes (gloo, float64): 2 ranks on the embedded-size tiny checkpoint and 4 ranks
on one with 8 experts give the single-process greedy tokens and logprobs, with rearrangements every few
steps in the middle of a run and a forced one on a skewed load that moves slots between ranks.
"""

from __future__ import annotations

import engine_fixtures
import pytest
import torch
from engine_fixtures import greedy, make_prompt
from model_fixtures import engine_logits, no_kernel_packs

from deepinfer_core.comm import TorchDistributedCommunicator
from deepinfer_core.config import EPLBConfig
from deepinfer_core.entrypoints.llm import LLM
from deepinfer_core.models import load_model
from deepinfer_core.parallel.ep import AllToAllDispatcher, attach_expert_map, place_experts
from deepinfer_core.parallel.eplb import EplbRecorder
from deepinfer_core.parallel.eplb_state import EplbState, eplb_config_of
from deepinfer_core.parallel.eplb_transfer import plan_transfer
from deepinfer_core.parallel.expert_map import ExpertMap, initial_phy2log
from deepinfer_core.testing.tiny_model import build_tiny_checkpoint

one_torch_thread = engine_fixtures.one_torch_thread
tiny_path = engine_fixtures.tiny_path
BLOCK = engine_fixtures.BLOCK_SIZE


def test_initial_layout_keeps_each_rank_on_its_checkpoint_slice():
    assert initial_phy2log(6, 8, 2).tolist() == [0, 1, 2, 0, 3, 4, 5, 3]
    assert initial_phy2log(8, 12, 4).tolist() == [0, 1, 0, 2, 3, 2, 4, 5, 4, 6, 7, 6]
    assert initial_phy2log(6, 6, 2).tolist() == list(range(6))
    with pytest.raises(ValueError, match="cannot be split evenly over 4"):
        initial_phy2log(6, 6, 4)


def test_pairs_of_a_logical_expert_spread_over_its_replicas():
    emap = ExpertMap.create(num_layers=2, num_logical=6, num_physical=8, world=2)
    ids = torch.tensor([[0, 3], [0, 1], [0, 3], [5, 0]])
    slots = emap.physical(0, ids).tolist()
    assert slots == [0, 4, 3, 1, 0, 7, 6, 3]  # the pairs of expert 0 alternate slots 0 and 3, of 3: 4 and 7
    assert emap.physical(0, ids).tolist() == slots  # deterministic
    assert torch.equal(emap.phy2log[0][torch.tensor(slots)], ids.reshape(-1))
    assert emap.local_logical(1) == [3, 4, 5, 3]


def test_transfer_plan_moves_only_what_no_local_slot_holds():
    old, new = [0, 1, 2, 0, 3, 4, 5, 3], [5, 1, 2, 5, 3, 4, 0, 0]
    plans = [plan_transfer(old, new, r, 2) for r in range(2)]
    (p0, crossing), (p1, _) = plans
    assert crossing == 4  # 5 twice onto rank 0, 0 twice onto rank 1
    assert p0.local_src == {1: 1, 2: 2} and p0.recv_from == [[], [0, 3]] and p0.send_to == [[], [0, 0]]
    assert p1.local_src == {0: 0, 1: 1} and p1.recv_from == [[2, 3], []] and p1.send_to == [[2, 2], []]


def test_eplb_arguments_are_checked():
    assert eplb_config_of({"num_redundant_experts": 2}, True, 2).num_redundant_experts == 2
    assert eplb_config_of(None, False, 1) == EPLBConfig()
    with pytest.raises(ValueError, match="unknown eplb_config keys"):
        eplb_config_of({"redundant": 2}, True, 2)
    with pytest.raises(ValueError, match="needs expert parallel"):
        eplb_config_of(None, True, 1)
    with pytest.raises(ValueError, match="needs enable_eplb"):
        eplb_config_of({"num_redundant_experts": 1}, False, 2)
    with pytest.raises(ValueError, match="step_interval must be"):
        eplb_config_of({"step_interval": 0}, True, 2)


def _model(path, dtype=torch.float64):
    with no_kernel_packs():
        return load_model(path, dtype=dtype)


def test_one_rank_with_replicas_gives_the_plain_logits_before_and_after_a_rearrangement(tiny_path):
    path = tiny_path("tiny")
    plain, model = _model(path), _model(path)
    cfg = model.cfg
    disp = AllToAllDispatcher(TorchDistributedCommunicator(None), cfg.n_routed_experts + 3, cfg.hidden_size)
    emap = attach_expert_map(disp, cfg.num_hidden_layers, cfg.n_routed_experts)
    assert emap.local_logical(0) == [0, 1, 2, 3, 4, 5, 0, 1, 2]
    place_experts(model, emap.local_logical(0), cfg.n_routed_experts)
    model.ep, model.expert_load = disp, EplbRecorder.for_model(model, disp)
    state = EplbState(model, disp, EPLBConfig(window_size=4, step_interval=100, num_redundant_experts=3))
    ids = make_prompt(29, seed=4)
    expected = engine_logits(plain, ids, chunk=8)
    torch.testing.assert_close(engine_logits(model, ids, chunk=8), expected, rtol=0, atol=1e-12)
    state.step()
    assert int(state.window.sum()) == 29 * cfg.num_experts_per_tok * cfg.num_hidden_layers
    skew = torch.ones((cfg.num_hidden_layers, cfg.n_routed_experts), dtype=torch.long)
    skew[:, 5] = 1000
    stats = state.rearrange(skew)
    assert (emap.logcnt[:, 5] == 4).all() and stats["moved_slots"] == 0  # one rank: all copies are local
    for layer, (mine, ref) in enumerate(zip(model.weights.layers, plain.weights.layers)):  # slots hold their experts
        w = ref.moe.experts.w13.weight
        assert torch.equal(mine.moe.experts.w13.weight, w[emap.phy2log[layer]])
    torch.testing.assert_close(engine_logits(model, ids, chunk=8), expected, rtol=0, atol=1e-12)


# --- across processes ----------------------------------------------------------------------------

LENGTHS = [1, 3, 8, 9, 17, 30, 41, 70]
MAX_TOKENS = [6, 9, 1, 12, 5, 8, 10, 7]


def _tokens_and_logprobs(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    return tokens, logprobs


def _compare(single, parallel, prompts, params):
    expected, expected_lp = _tokens_and_logprobs(single, prompts, params)
    got, got_lp = _tokens_and_logprobs(parallel, prompts, params)
    assert got == expected
    for a, b in zip(got_lp, expected_lp):
        for x, y in zip(a, b):
            assert abs(x - y) < 1e-10
    return expected


def _skewed(cfg, hot: int) -> torch.Tensor:
    load = torch.ones((cfg.num_hidden_layers, cfg.n_routed_experts), dtype=torch.long)
    load[:, hot] = 10_000
    return load


def _check_eplb(single, parallel, redundant: int):
    engine, cfg = parallel.llm_engine, parallel.llm_engine.model_config
    prompts = [make_prompt(n, seed=i) for i, n in enumerate(LENGTHS)]
    params = [greedy(m, logprobs=1) for m in MAX_TOKENS]
    _compare(single, parallel, prompts, params)
    stats = engine.eplb_stats()
    assert all(s["steps"] == stats[0]["steps"] > 3 for s in stats)  # lock-step: the same steps everywhere
    assert len(stats[0]["history"]) >= 1  # rearranged every few steps in the middle of the run
    assert all(s["phy2log"] == stats[0]["phy2log"] for s in stats)  # every rank holds the same map
    for hot in (cfg.n_routed_experts - 1, 0):
        forced = engine.rearrange_experts(_skewed(cfg, hot))
        assert forced["moved_slots"] > 0  # weights crossed between ranks
        assert forced["after"]["balancedness"] > forced["before"]["balancedness"]
        layout = torch.tensor(engine.eplb_stats()[0]["phy2log"])
        assert ((layout == hot).sum(1) == 1 + redundant).all()  # the hot expert got every spare slot
        _compare(single, parallel, prompts[3:], params[3:])


@pytest.fixture(scope="module")
def two_ranks(tiny_path):
    kw = dict(model=str(tiny_path("tiny")), dtype="float64", block_size=BLOCK, max_num_batched_tokens=24,
              num_blocks=9, num_window_blocks=4, max_num_seqs=6)
    single = LLM(**kw)
    parallel = LLM(**kw, data_parallel_size=2, enable_expert_parallel=True, distributed_timeout_s=120,
                   enable_eplb=True, eplb_config={"num_redundant_experts": 2, "step_interval": 4, "window_size": 8})
    yield single, parallel
    parallel.llm_engine.shutdown()


def test_two_ranks_with_eplb_equal_one_process_across_rearrangements(two_ranks):
    single, parallel = two_ranks
    assert [i["local_experts"] for i in parallel.llm_engine.rank_info] == [(0, 4), (4, 8)]
    _check_eplb(single, parallel, redundant=2)


@pytest.mark.slow
def test_four_ranks_with_eplb_equal_one_process(tmp_path):
    path = build_tiny_checkpoint(tmp_path / "tiny8", "tiny", n_routed_experts=8)
    kw = dict(model=str(path), dtype="float64", block_size=BLOCK, max_num_batched_tokens=24, num_blocks=9,
              num_window_blocks=4, max_num_seqs=6)
    single = LLM(**kw)
    parallel = LLM(**kw, data_parallel_size=4, enable_expert_parallel=True, distributed_timeout_s=120,
                   enable_eplb=True, eplb_config={"num_redundant_experts": 4, "step_interval": 5})
    try:
        assert [i["local_experts"] for i in parallel.llm_engine.rank_info] == [(0, 3), (3, 6), (6, 9), (9, 12)]
        _check_eplb(single, parallel, redundant=4)
    finally:
        parallel.llm_engine.shutdown()

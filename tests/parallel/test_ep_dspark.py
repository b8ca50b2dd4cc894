"""DSpark drafting under expert parallel: the drafter's stages have experts of their own (the tiny V4.1: 4
experts, top-2, beside the target's 8, top-2), sharded over the ranks by a dispatcher of their own, counted
and rearranged by EPLB with the target's, and every rank runs one draft pass over the stages each step.

In process: one-rank dispatchers for both expert groups (EPLB maps with replicas) give the plain drafter's
blocks bit for bit, before and after a rearrangement of the drafter's experts, and its load is counted.
Across processes (gloo, float64): two ranks with DSpark (oracle drafts, so that drafts are accepted and
rejected where the test wants) give one process's greedy tokens, propose the very drafts one process with
DSpark proposes, through chunked prefill, EPLB rearrangements of both groups (periodic and forced) and a
phase where one rank idles (its placeholder steps run the draft pass with no tokens); slow: k=3 with
preemption, and the trained tiny V4.1 drafting for itself on held-out text.
"""

from __future__ import annotations

import engine_fixtures
import pytest
import torch
from engine_fixtures import greedy, make_prompt
from model_fixtures import no_kernel_packs
from spec_fixtures import other_token

from deepinfer_core.comm import TorchDistributedCommunicator
from deepinfer_core.config import EPLBConfig
from deepinfer_core.default_model import default_model_path
from deepinfer_core.entrypoints.llm import LLM
from deepinfer_core.models import load_model
from deepinfer_core.parallel.ep import (
    AllToAllDispatcher,
    attach_expert_map,
    drafter_stacks,
    place_experts,
    place_stacks,
)
from deepinfer_core.parallel.eplb import EplbRecorder
from deepinfer_core.parallel.eplb_state import EplbState
from deepinfer_core.testing.model_runner import SimpleRunner

one_torch_thread = engine_fixtures.one_torch_thread
tiny_path = engine_fixtures.tiny_path
BLOCK = engine_fixtures.BLOCK_SIZE


# --- in process ----------------------------------------------------------------------------------

def _model(path):
    with no_kernel_packs():
        return load_model(path, dtype=torch.float64)


def _drafts(model, ids: list[int], prefill: int) -> list[tuple[torch.Tensor, ...]]:
    """After a prefill of ``ids[:prefill]``, a decode step per further token, each followed by a draft."""
    runner = SimpleRunner(model, 1, 64, block_size=8)
    _, batch, hidden = runner.forward({0: ids[:prefill]})
    model.dspark.seed(hidden, batch, runner.cache)
    out = []
    for i in range(prefill, len(ids)):
        logits, batch, hidden = runner.forward({0: [ids[i]]})
        model.dspark.seed(hidden, batch, runner.cache)
        token = logits[0][-1].argmax().view(1)
        rows = batch.window_rows()[batch.logits_indices]
        out.append(model.dspark.draft(token, torch.tensor([i]), rows, runner.cache))
    return out


def _assert_same_drafts(got, expected):
    for step, (a, b) in enumerate(zip(got, expected)):
        assert torch.equal(a[0], b[0]), step
        for x, y in zip(a[1:], b[1:]):  # replicas split an expert's rows over several GEMMs: to rounding
            torch.testing.assert_close(x, y, rtol=0, atol=1e-12)


def test_drafter_experts_as_their_own_group_give_the_plain_drafts(tiny_path):
    path = tiny_path("v41")
    plain, model = _model(path), _model(path)
    cfg, drafter = model.cfg, model.dspark
    comm = TorchDistributedCommunicator(None)
    disp = AllToAllDispatcher(comm, cfg.n_routed_experts + 2, cfg.hidden_size)
    place_experts(model, attach_expert_map(disp, cfg.num_hidden_layers, cfg.n_routed_experts).local_logical(0),
                  cfg.n_routed_experts)
    num, top_k = cfg.drafter_moe_config()
    assert (drafter.num_experts, drafter.top_k) == (num, top_k) and num != cfg.n_routed_experts
    d_disp = AllToAllDispatcher(comm, num + 3, cfg.hidden_size)
    d_map = attach_expert_map(d_disp, len(drafter.moe_layers()), num)
    assert d_map.local_logical(0) == [0, 1, 2, 3, 0, 1, 2]
    place_stacks(drafter_stacks(model), d_map.local_logical(0), num)
    model.ep, model.expert_load = disp, EplbRecorder.for_model(model, disp)
    drafter.ep, drafter.expert_load = d_disp, EplbRecorder.for_drafter(model, d_disp)
    state = EplbState(model, disp, EPLBConfig(window_size=4, step_interval=100, num_redundant_experts=2))
    assert [g.name for g in state.groups] == ["target", "drafter"]
    ids = make_prompt(30, seed=5)
    expected = _drafts(plain, ids, 20)
    _assert_same_drafts(_drafts(model, ids, 20), expected)
    state.step()
    drafted = 10 * cfg.dspark_block_size  # 10 drafts of a block each, through every stage
    assert int(state.groups[1].window.sum()) == drafted * top_k * len(drafter.moe_layers())
    skew = torch.ones((len(drafter.moe_layers()), num), dtype=torch.long)
    skew[:, 3] = 1000
    stats = state.rearrange({"drafter": skew})
    assert stats["drafter"]["moved_slots"] == 0 and (d_map.logcnt[:, 3] == 4).all()  # one rank: all local
    for layer, (mine, ref) in enumerate(zip(drafter_stacks(model), drafter_stacks(plain))):
        assert torch.equal(mine.w13.weight, ref.w13.weight[d_map.phy2log[layer]])  # slots hold their experts
    _assert_same_drafts(_drafts(model, ids, 20), expected)


# --- across processes ----------------------------------------------------------------------------

def _wrong(m: int, j: int) -> bool:
    """Which oracle drafts are wrong: every offset of a rejection, and whole blocks accepted."""
    return (m + j) % 4 == 3 or (m % 5 == 1 and j == 0)


def install_oracle(engine, reference: dict, proposed: dict) -> None:
    """Make ``engine``'s drafts the reference continuation (``reference``: prompt -> greedy tokens), those
    ``_wrong`` picks changed; the drafter's own proposals are kept in ``proposed[(prompt, m)]``. Runs on
    a rank's engine core (``collective_rpc``) or on a single-process engine."""
    planner, vocab = engine.drafts, engine.model_config.vocab_size
    offer, k = planner.offer, planner.config.num_speculative_tokens

    def patched(seq, drafts, confidences):
        prompt, m = tuple(seq.prompt_token_ids), len(seq.output_token_ids)
        ref = reference[prompt]
        proposed[prompt, m] = list(drafts)
        new = [ref[m + j] if m + j < len(ref) else 2 for j in range(k)]
        offer(seq, [other_token(t, vocab) if _wrong(m, j) else t for j, t in enumerate(new)], [0.9] * k)

    planner.offer = patched
    engine.oracle_proposed = proposed


def oracle_proposals(engine) -> dict:
    return engine.oracle_proposed


LENGTHS = [5, 30, 12, 40, 3, 22]
MAX_TOKENS = [8, 6, 12, 5, 9, 7]


def _run(path, k: int, lengths, max_tokens, idle_tokens: int, **extra):
    kw = dict(model=str(path), dtype="float64", block_size=BLOCK, max_num_batched_tokens=24, max_num_seqs=4)
    prompts = [make_prompt(n, seed=i) for i, n in enumerate(lengths)] + [make_prompt(20, seed=99)]
    params = [greedy(m) for m in max_tokens] + [greedy(idle_tokens)]
    single = LLM(**kw)
    expected = [o.outputs[0].token_ids for o in single.generate(prompts, params, use_tqdm=False)]
    longer = [o.outputs[0].token_ids for o in single.generate(prompts, greedy(max(max_tokens + [idle_tokens]) + k),
                                                             use_tqdm=False)]
    reference = {tuple(p): r for p, r in zip(prompts, longer)}
    spec = {"speculative_config": {"method": "dspark", "num_speculative_tokens": k}}
    one = LLM(**kw, **spec)
    one_proposed: dict = {}
    install_oracle(one.llm_engine, reference, one_proposed)
    assert [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)] == expected
    llm = LLM(**kw, **spec, **extra, data_parallel_size=2, enable_expert_parallel=True, distributed_timeout_s=120,
              enable_eplb=True, eplb_config={"num_redundant_experts": 2, "step_interval": 6, "window_size": 4})
    engine = llm.llm_engine
    try:
        engine.collective_rpc(install_oracle, (reference, {}))
        got = [o.outputs[0].token_ids for o in llm.generate(prompts[:-1], params[:-1], use_tqdm=False)]
        cfg = engine.model_config
        num = cfg.drafter_moe_config()[0]
        skew = torch.ones((cfg.num_nextn_predict_layers, num), dtype=torch.long)
        skew[:, 0] = 1000
        forced = engine.rearrange_experts({"drafter": skew})
        assert forced["drafter"]["moved_slots"] > 0  # the drafter's weights crossed between ranks
        layouts = [s["drafter_phy2log"] for s in engine.eplb_stats()]
        assert layouts[0] == layouts[1] and ((torch.tensor(layouts[0]) == 0).sum(1) == 3).all()  # 2 spare slots
        before = engine.rank_counters()
        got += [o.outputs[0].token_ids for o in llm.generate(prompts[-1:], params[-1:], use_tqdm=False)]
        after = engine.rank_counters()
        stats, eplb = engine.spec_decode_stats(), engine.eplb_stats()
        proposed = {}
        for part in engine.collective_rpc(oracle_proposals):
            proposed.update(part)
    finally:
        engine.shutdown()
    assert got == expected
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"], stats
    placeholders = sorted(a["placeholder_steps"] - b["placeholder_steps"] for a, b in zip(after, before))
    assert placeholders[0] == 0 and placeholders[1] >= idle_tokens // (k + 1), (before, after)
    assert all(s["steps"] == eplb[0]["steps"] for s in eplb)  # lock-step
    assert len(eplb[0]["history"]) >= 3 and all("drafter" in h for h in eplb[0]["history"])
    assert all(s["drafter_phy2log"] == eplb[0]["drafter_phy2log"] for s in eplb)
    # the drafter on two ranks proposes what it proposes in one process, at every point both reached
    common = sorted(set(proposed) & set(one_proposed))
    assert len(common) >= len(one_proposed) // 2  # a preempted sequence drafts at other points after its recompute
    assert [proposed[key] for key in common] == [one_proposed[key] for key in common]
    return after


def test_dspark_on_two_expert_parallel_ranks_equals_one_process(tiny_path):
    _run(tiny_path("v41"), 2, LENGTHS, MAX_TOKENS, 12)


@pytest.mark.slow
def test_dspark_k3_with_preemption_on_two_ranks_equals_one_process(tiny_path):
    counters = _run(tiny_path("v41"), 3, LENGTHS + [17, 9, 41], MAX_TOKENS + [10, 4, 11], 16, num_blocks=9,
                    num_window_blocks=4)
    assert sum(c["preemptions"] for c in counters) > 0, counters


@pytest.mark.slow
def test_trained_dspark_on_two_ranks_equals_one_process():
    """The trained tiny V4.1 and its own drafts on held-out text (accepted and rejected as they come,
    k=3): two expert-parallel ranks with EPLB give one process's greedy tokens and the same acceptance as
    one process with DSpark, a rank idle at the end."""
    kw = dict(model=str(default_model_path()), dtype="float64", max_num_batched_tokens=64)
    single = LLM(**kw)
    ids = single.llm_engine.encode(open("data/heldout_slice.txt").read())
    prompts = [ids[:150]] + [ids[i * 120: i * 120 + 10 + 13 * i] for i in range(1, 5)]
    params = [greedy(m) for m in (20, 4, 14, 9, 26)]
    expected = [o.outputs[0].token_ids for o in single.generate(prompts, params, use_tqdm=False)]
    spec = {"speculative_config": {"method": "dspark", "num_speculative_tokens": 3}}
    one = LLM(**kw, **spec)
    assert [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)] == expected
    one_stats = one.llm_engine.spec_decode_stats()
    llm = LLM(**kw, **spec, data_parallel_size=2, enable_expert_parallel=True, distributed_timeout_s=120,
              enable_eplb=True, eplb_config={"num_redundant_experts": 2, "step_interval": 5, "window_size": 4})
    engine = llm.llm_engine
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats, counters, eplb = engine.spec_decode_stats(), engine.rank_counters(), engine.eplb_stats()
    finally:
        engine.shutdown()
    assert got == expected
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"], stats
    assert stats["num_accepted_tokens"] == one_stats["num_accepted_tokens"], (stats, one_stats)
    assert sum(c["placeholder_steps"] for c in counters) > 0, counters
    assert len(eplb[0]["history"]) >= 1 and all("drafter" in h for h in eplb[0]["history"])

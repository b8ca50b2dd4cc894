"""Expert parallel + attention data parallel (spawned ranks, gloo, float64) under a mixed workload driven
through the step API, against the single-process engine on the golden tiny configs.

Two runs per rank count (2 ranks on "tiny" and "tiny_hc4", 4 on "tiny" and "tiny_hc1"), EPLB on with 2
redundant slots on the golden checkpoints' 6 logical experts (8 slots: 4 per rank on 2 ranks; 2 on 4, where
6 experts do not split evenly and the initial layout cycles them), a token budget of 16 (chunked prefill)
and pools of 9 compressed / 4 window blocks per rank (preemption). Three phases, one engine per run:

1. a shared 48-token prefix: a request added once the first one finished is sent to its rank and served
   from its prefix cache; a request aborted while still waiting.
2. a load too large for a rank's pools: sequences are preempted and recomputed; aborts in prefill, in
   decode and right before a forced rearrangement on a skewed load, made between two steps with requests
   in flight (slots move between ranks); a second wave joins after it.
3. one request per rank but the last, which stays idle for every step of the phase (placeholder steps),
   with a second forced rearrangement in the middle of it.

Every finished request's greedy tokens (and their logprobs) equal the single-process engine's on the same
requests; an aborted request's tokens so far are a prefix of them, and nothing comes back for it.
"""

from __future__ import annotations

import engine_fixtures
import pytest
import torch
from engine_fixtures import greedy, make_prompt

from deepinfer_core.entrypoints.llm import LLM
from deepinfer_core.outputs import RequestOutput

one_torch_thread = engine_fixtures.one_torch_thread
tiny_path = engine_fixtures.tiny_path

BLOCK = engine_fixtures.BLOCK_SIZE
BUDGET = 16  # max_num_batched_tokens: a prompt of more than 16 tokens is prefilled in chunks
REDUNDANT = 2
KW = dict(dtype="float64", block_size=BLOCK, max_num_batched_tokens=BUDGET, num_blocks=9, num_window_blocks=4,
          max_num_seqs=6)
PREFIX = make_prompt(48, seed=500)  # three full blocks
WAVE_LENGTHS = [40, 55, 33, 62, 47, 38, 70, 29]
IDLE_PROMPT, IDLE_TOKENS = 45, 20


class Run:
    """The step API driven by hand (``add_request`` / ``step`` / ``abort_request``), every output kept."""

    def __init__(self, engine):
        self.engine = engine
        self.requests: dict[str, tuple[list[int], int]] = {}  # request -> (prompt, max_tokens)
        self.latest: dict[str, RequestOutput] = {}
        self.aborted: dict[str, list[int]] = {}  # request -> the tokens it had when aborted
        self.steps = 0

    def add(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        self.requests[rid] = (prompt, max_tokens)
        self.engine.add_request(rid, prompt, greedy(max_tokens, logprobs=1))

    def tokens(self, rid: str) -> list[int]:
        out = self.latest.get(rid)
        return [] if out is None else list(out.outputs[0].token_ids)

    def finished(self, rid: str) -> bool:
        return rid in self.latest and self.latest[rid].finished

    def abort(self, rid: str) -> None:
        assert rid in self.requests and not self.finished(rid), f"{rid} is not in flight"
        self.aborted[rid] = self.tokens(rid)
        self.engine.abort_request(rid)

    def step(self) -> None:
        for out in self.engine.step():
            assert out.request_id not in self.aborted, f"aborted request {out.request_id} came back"
            assert out.error is None, out.error
            self.latest[out.request_id] = out
        self.steps += 1

    def until(self, done, most: int = 400) -> None:
        for _ in range(most):
            if done():
                return
            assert self.engine.has_unfinished_requests(), "the run ended before the condition held"
            self.step()
        raise AssertionError(f"condition not reached within {most} steps")

    def drain(self) -> None:
        self.until(lambda: not self.engine.has_unfinished_requests())


def _skewed(cfg, hot: int) -> torch.Tensor:
    load = torch.ones((cfg.num_hidden_layers, cfg.n_routed_experts), dtype=torch.long)
    load[:, hot] = 10_000
    return load


def _force_rearrangement(run: Run, hot: int) -> dict:
    """A rearrangement on a load where ``hot`` takes nearly every token, between two steps of the run."""
    engine = run.engine
    assert engine.has_unfinished_requests()  # in the middle of the run
    forced = engine.rearrange_experts(_skewed(engine.model_config, hot))
    assert forced["moved_slots"] > 0  # weights crossed between ranks
    assert forced["after"]["balancedness"] > forced["before"]["balancedness"]
    stats = engine.eplb_stats()
    assert all(s["phy2log"] == stats[0]["phy2log"] for s in stats)  # every rank holds the same map
    layout = torch.tensor(stats[0]["phy2log"])
    assert ((layout == hot).sum(1) == 1 + REDUNDANT).all()  # the hot expert got every spare slot
    assert all(s["history"][-1]["step"] == run.steps for s in stats)
    return forced


def _mixed_workload(engine, ranks: int) -> Run:
    run = Run(engine)
    cfg = engine.model_config

    # 1. prefix cache: p1 shares p0's three full blocks and is added once p0 is done
    run.add("p0", PREFIX + make_prompt(3, seed=501), 4)
    for i, n in enumerate((5, 30, 12)):
        run.add(f"a{i}", make_prompt(n, seed=10 + i), 6)
    run.add("q", make_prompt(20, seed=19), 8)
    run.abort("q")  # still waiting: never scheduled
    run.until(lambda: run.finished("p0"))
    assert run.latest["p0"].num_cached_tokens == 0
    run.add("p1", PREFIX + make_prompt(7, seed=502), 5)
    run.drain()
    hit = run.latest["p1"].num_cached_tokens
    assert hit > 0 and hit % BLOCK == 0  # p1 went to p0's rank and reused its prefix blocks
    assert engine.prefix_cache_stats()["hit_tokens"] >= hit

    # 2. preemption, aborts, a forced rearrangement with requests in flight. The prompts are unique and
    # the cache is emptied first: a request served tokens from the cache found blocks it computed itself
    # before it lost them, which only a preemption does.
    engine.reset_prefix_cache()
    preemptions_before = sum(c["preemptions"] for c in engine.rank_counters())
    wave = [f"b{i}" for i in range(4 * ranks)]
    for i, rid in enumerate(wave):
        run.add(rid, make_prompt(WAVE_LENGTHS[i % 8], seed=100 + i), 12 + i % 8)
    run.step()
    assert not run.tokens("b2")
    run.abort("b2")  # in prefill
    run.until(lambda: len(run.tokens("b5")) >= 3)
    run.abort("b5")  # decoding
    run.abort("b7")  # right before the rearrangement
    _force_rearrangement(run, hot=cfg.n_routed_experts - 1)
    second = [f"c{i}" for i in range(2 * ranks)]
    for i, rid in enumerate(second):
        run.add(rid, make_prompt(WAVE_LENGTHS[(i + 3) % 8], seed=200 + i), 10 + i % 5)
    run.drain()
    preempted = [r for r in wave + second if r not in run.aborted and run.latest[r].num_cached_tokens > 0]
    assert preempted, "no sequence was preempted on any rank"
    assert sum(c["preemptions"] for c in engine.rank_counters()) > preemptions_before
    assert engine.load == [0] * ranks

    # 3. the last rank idle for a whole phase: one request on every other rank, all alike, a rearrangement
    # half-way
    before, start = engine.rank_counters(), run.steps
    for r in range(ranks - 1):
        run.add(f"d{r}", make_prompt(IDLE_PROMPT, seed=300 + r), IDLE_TOKENS)
    run.until(lambda: run.steps - start >= 10)
    _force_rearrangement(run, hot=0)
    run.drain()
    after = engine.rank_counters()
    steps = [a["steps"] - b["steps"] for a, b in zip(after, before)]
    placeholders = [a["placeholder_steps"] - b["placeholder_steps"] for a, b in zip(after, before)]
    chunks = -(-IDLE_PROMPT // BUDGET)
    assert steps == [chunks + IDLE_TOKENS - 1] * ranks  # lock-step: the prefill chunks, then one step a token
    assert placeholders == [0] * (ranks - 1) + [steps[-1]]  # the idle rank met the others in every step

    assert not engine.has_unfinished_requests() and engine.load == [0] * ranks
    stats = engine.eplb_stats()
    assert [s["steps"] for s in stats] == [run.steps] * ranks
    assert [len(s["history"]) for s in stats] == [2] * ranks  # only the forced rearrangements
    return run


def _check_against_one_process(single: LLM, run: Run) -> None:
    rids = list(run.requests)
    outs = single.generate([run.requests[r][0] for r in rids], [greedy(run.requests[r][1], logprobs=1) for r in rids],
                           use_tqdm=False)
    partial = 0
    for rid, out in zip(rids, outs):
        expected = out.outputs[0].token_ids
        assert len(expected) == run.requests[rid][1]
        if rid in run.aborted:
            got = run.aborted[rid]
            assert got == expected[:len(got)] and len(got) < len(expected), rid
            partial += bool(got)
            continue
        mine = run.latest[rid]
        assert mine.finished and mine.outputs[0].finish_reason == "length", rid
        assert mine.outputs[0].token_ids == expected, rid
        got_lp = [lp[t] for lp, t in zip(mine.outputs[0].logprobs, expected)]
        want_lp = [lp[t] for lp, t in zip(out.outputs[0].logprobs, expected)]
        assert max(abs(a - b) for a, b in zip(got_lp, want_lp)) < 1e-10, rid
    assert partial >= 1  # an abort that cut a request in the middle of its output


@pytest.mark.parametrize("config, ranks", [("tiny", 2), *(pytest.param(c, r, marks=pytest.mark.slow)
                                                          for c, r in [("tiny_hc4", 2), ("tiny", 4), ("tiny_hc1", 4)])])
def test_mixed_workload_with_eplb_equals_one_process(config, ranks, tiny_path):
    kw = dict(model=str(tiny_path(config)), **KW)
    single = LLM(**kw)
    parallel = LLM(**kw, data_parallel_size=ranks, enable_expert_parallel=True, distributed_timeout_s=120,
                   enable_eplb=True, eplb_config={"num_redundant_experts": REDUNDANT, "step_interval": 1 << 30})
    try:
        slots = 8 // ranks
        assert [i["local_experts"] for i in parallel.llm_engine.rank_info] == [
            (r * slots, (r + 1) * slots) for r in range(ranks)]
        run = _mixed_workload(parallel.llm_engine, ranks)
    finally:
        parallel.llm_engine.shutdown()
    _check_against_one_process(single, run)

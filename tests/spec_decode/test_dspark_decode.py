"""Speculative decoding with DeepSeek-V4.1's DSpark drafter (``speculative_config={"method": "dspark"}``):
greedy output equals output without speculation, token for token (float64, cpu_ref), on the tiny V4.1
(block of 3; every V4.1 feature on: KV sources read by later layers, ratio-2 rings, the candidate filter,
Engram). The random stages' drafts are nearly always rejected; the oracle drafter of ``spec_fixtures`` places
acceptances and rejections at every offset, so that rollback of every cache a rejected token wrote (windows,
shared sources, index keys, the ratio-2 rings) is exercised, through chunked prefill, preemption and prefix
hits."""

from __future__ import annotations

import engine_fixtures
import pytest
import torch
from engine_fixtures import greedy, make_prompt, run_tokens
from spec_fixtures import oracle_drafts
from test_spec_async import make_async, worker_oracle  # noqa: F401

from deepinfer_core.entrypoints.llm import LLM
from deepinfer_core.spec_decode.dspark_proposer import DSparkProposer

make_llm = engine_fixtures.make_llm
one_torch_thread = engine_fixtures.one_torch_thread
tiny_path = engine_fixtures.tiny_path

LENGTHS = [1, 2, 3, 7, 8, 9, 16, 17, 25]
PROMPTS = [make_prompt(n, seed=40 + i, vocab_size=4000) for i, n in enumerate(LENGTHS)]
MAX_TOKENS = 10
_REF: dict = {}


def dspark(k: int, schedule: str = "fixed") -> dict:
    return {"speculative_config": {"method": "dspark", "num_speculative_tokens": k, "schedule": schedule}}


def reference(make_llm, path) -> dict:
    if str(path) not in _REF:
        llm = make_llm(path, dtype="float64")
        _REF[str(path)] = dict(zip(map(tuple, PROMPTS), run_tokens(llm, PROMPTS, greedy(MAX_TOKENS + 4))))
    return _REF[str(path)]


def mixed(seq, m, j):
    """A deterministic mix of rejection points: every accepted length 0..k occurs."""
    return (seq.seq_id * 7 + m * 3 + j * 5) % 4 == 0


def expected(ref: dict) -> list[list[int]]:
    return [ref[tuple(p)][:MAX_TOKENS] for p in PROMPTS]


@pytest.mark.parametrize("k", [1, 3])
def test_dspark_drafts_greedy_equal(k, tiny_path, make_llm):
    path = tiny_path("v41")
    ref = reference(make_llm, path)
    llm = make_llm(path, dtype="float64", **dspark(k))
    assert isinstance(llm.llm_engine.runner.proposer, DSparkProposer)
    assert run_tokens(llm, PROMPTS, greedy(MAX_TOKENS)) == expected(ref)
    stats = llm.llm_engine.spec_decode_stats()
    assert stats["num_draft_tokens"] > 0 and len(stats["verified_per_position"]) == k


VARIANTS = {
    "default": {},
    "chunk5-3seqs": dict(max_num_batched_tokens=5, max_num_seqs=3),
    "preempt": dict(block_size=8, num_blocks=6, num_window_blocks=12),
    "prefix-cache": dict(enable_prefix_caching=True),
}


# default (slow): the plain oracle, which each other variant runs under its chunking, preemption or prefix hits
@pytest.mark.parametrize("variant", [pytest.param(v, marks=pytest.mark.slow) if v == "default" else v
                                     for v in VARIANTS])
def test_oracle_drafts_greedy_equal(variant, tiny_path, make_llm):
    """Accepted and rejected drafts at every offset of the block: the caches the rejected tokens wrote are
    put back, so the next step computes as if only the accepted ones had run."""
    path = tiny_path("v41")
    ref = reference(make_llm, path)
    llm = make_llm(path, dtype="float64", **dspark(3), **VARIANTS[variant])
    oracle_drafts(llm, ref, mixed)
    repeats = 3 if variant == "prefix-cache" else 0  # the repeated prompts hit the cache
    outs = run_tokens(llm, PROMPTS + PROMPTS[len(PROMPTS) - repeats:], greedy(MAX_TOKENS))
    assert outs == expected(ref) + expected(ref)[len(PROMPTS) - repeats:]
    engine = llm.llm_engine
    stats = engine.spec_decode_stats()
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    assert stats["accepted_per_position"][2] > 0
    if variant == "preempt":
        assert engine.scheduler.num_preemptions > 0


def test_confidence_scheduling_stays_greedy_equal(tiny_path, make_llm):
    """The confidence head's estimates (a sigmoid of its logits, in (0, 1)) drive the scheduler."""
    path = tiny_path("v41")
    ref = reference(make_llm, path)
    llm = make_llm(path, dtype="float64", **dspark(3, "confidence"))
    seen = []
    offer = llm.llm_engine.drafts.offer

    def record(seq, drafts, confidences):
        seen.extend(confidences)
        offer(seq, drafts, confidences)

    llm.llm_engine.drafts.offer = record
    assert run_tokens(llm, PROMPTS, greedy(MAX_TOKENS)) == expected(ref)
    assert seen and all(0.0 < c < 1.0 for c in seen)


def test_drafts_are_the_drafters_block(tiny_path, make_llm):
    """The proposal is the first k drafted tokens of ``model.dspark.draft`` and the sigmoid of its confidence
    logits, for the sequence's last kept position."""
    path = tiny_path("v41")
    llm = make_llm(path, dtype="float64", **dspark(2))
    captured = []
    draft = llm.llm_engine.model.dspark.draft

    def spy(*args):
        out = draft(*args)
        captured.append(out)
        return out

    llm.llm_engine.model.dspark.draft = spy
    offers = []
    offer = llm.llm_engine.drafts.offer
    llm.llm_engine.drafts.offer = lambda seq, d, c: (offers.append((list(d), list(c))), offer(seq, d, c))
    run_tokens(llm, PROMPTS[3:4], greedy(4))
    assert offers and len(captured) == len(offers) + 1  # the last step's drafts are never offered: it ends
    for (ids, _, confidence), (d, c) in zip(captured, offers):
        assert d == ids[0, 1:3].tolist()
        assert c == pytest.approx(torch.sigmoid(confidence[0, :2]).tolist(), abs=1e-12)


def test_invalid_dspark_configs(tiny_path):
    v41, v4 = tiny_path("v41"), tiny_path("tiny")
    with pytest.raises(ValueError, match=r"'dspark' is not available for DeepseekV4ForCausalLM.*mtp"):
        LLM(str(v4), backend="cpu_ref", **dspark(1))
    with pytest.raises(ValueError, match=r"'mtp' is not available for DeepseekV41ForCausalLM.*dspark"):
        LLM(str(v41), backend="cpu_ref", speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    with pytest.raises(ValueError, match=r"num_speculative_tokens 4 is more than the DSpark block .* \(3\)"):
        LLM(str(v41), backend="cpu_ref", **dspark(4))



def test_async_scheduling_stays_greedy_equal(tiny_path, make_llm, make_async):  # noqa: F811
    """With async scheduling a step is scheduled while the one before runs: its spans carry placeholders
    that the runner moves on by the accepted drafts, and the Engram history it hands the target is the
    accepted tokens'."""
    path = tiny_path("v41")
    ref = reference(make_llm, path)
    llm = make_async(path, dtype="float64", **dspark(3))
    worker_oracle(llm, ref, mixed)
    assert run_tokens(llm, PROMPTS, greedy(MAX_TOKENS)) == expected(ref)
    engine = llm.llm_engine
    assert 0 < engine.spec_decode_stats()["num_accepted_tokens"] < engine.spec_decode_stats()["num_draft_tokens"]
    assert engine.counts["overlapped"] > 0

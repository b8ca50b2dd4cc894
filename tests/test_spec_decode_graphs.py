"""Speculative steps through the decode graphs' padded layout, checked on the CPU: a verification step
whose sequences all hold k drafts runs the (size, context, 1 + k) graph layout, with the streams the
MTP drafter reads returned by the runner; greedy outputs equal those without speculation (float64)
while drafts are accepted and rejected at every offset and sequences cross window, compression and
block boundaries. ``GraphRunner(capture=False)`` runs the padded static batch eagerly, exactly what a
replay computes.
"""

from __future__ import annotations

import engine_fixtures
import pytest
from engine_fixtures import greedy, make_prompt, run_tokens
from spec_fixtures import oracle_drafts, spec
from test_spec_decode import MAX_TOKENS, PROMPTS, mixed, reference

from deepinfer_core.worker.graph_runner import GraphRunner

make_llm = engine_fixtures.make_llm
one_torch_thread = engine_fixtures.one_torch_thread
tiny_path = engine_fixtures.tiny_path


def with_spec_graphs(llm, k: int, sizes: list[int]) -> list[tuple[int, int]]:
    """Give the engine's speculative runner padded graphs for 1 and 1 + k new tokens; returns the list
    that records (batch size, query length) of every step run through them."""
    engine = llm.llm_engine
    runner = GraphRunner(engine.model, engine.cache, sizes, engine.scheduler_config.max_model_len,
                         engine.args.block_size, capture=False, query_lens=(1, 1 + k), keep_streams=True,
                         min_context=16)
    engine.runner.graph_runner = runner
    steps = []
    original = runner.replay_with_streams

    def record(batch):
        steps.append((batch.padded_to, batch.num_tokens // batch.padded_to))
        return original(batch)

    runner.replay_with_streams = record
    return steps


@pytest.mark.parametrize("config", ["tiny", "tiny_hc4"])
@pytest.mark.parametrize("k", [1, 3])
def test_verification_graphs_keep_greedy_equal(config, k, tiny_path, make_llm):
    path = tiny_path(config)
    ref = reference(make_llm, path, PROMPTS)
    llm = make_llm(path, dtype="float64", max_num_seqs=16, **spec(k))
    steps = with_spec_graphs(llm, k, [1, 2, 4, 8, 16])
    oracle_drafts(llm, ref, mixed)
    lengths = [MAX_TOKENS + 4 - 6 * (i % 2) for i in range(len(PROMPTS))]  # half the batch ends early
    outs = run_tokens(llm, PROMPTS, [greedy(n) for n in lengths])
    assert outs == [ref[tuple(p)][:n] for p, n in zip(PROMPTS, lengths)]
    verified = [n for n, q in steps if q == 1 + k]
    assert len(verified) >= 2 and 16 in verified, steps
    stats = llm.llm_engine.spec_decode_stats()
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]


def test_unequal_drafts_run_eagerly(tiny_path, make_llm):
    """Confidence scheduling gives sequences different draft counts: such steps are not padded, and the
    output is still the reference's."""
    path = tiny_path("tiny")
    prompts = [make_prompt(n, seed=i) for i, n in enumerate([5, 17, 30, 33])]
    ref = reference(make_llm, path, prompts)
    llm = make_llm(path, dtype="float64", max_num_seqs=4, **spec(3, "confidence"))
    steps = with_spec_graphs(llm, 3, [1, 2, 4])
    outs = run_tokens(llm, prompts, greedy(MAX_TOKENS))
    assert outs == [ref[tuple(p)][:MAX_TOKENS] for p in prompts]
    assert all(q in (1, 4) for _, q in steps)

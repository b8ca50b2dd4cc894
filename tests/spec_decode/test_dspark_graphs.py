"""DSpark speculative steps through the graphs, checked on the CPU: verification replays the padded
(size, context, 1 + k) layouts, and seeding plus the draft pass over the stages replays
``DSparkGraphs`` (``capture=False``: the padded static inputs run eagerly, exactly what a replay
computes). Steps of decodes only draft on the device right after verification, and with async scheduling a
step of verifications launches before the step before ends, its layout, Engram n-gram history and drafting
layout derived on the device (chained). Greedy output equals eager DSpark's and output without speculation
(float64), on the trained default V4.1 (real acceptance, drafts and confidences compared with the eager
proposer's) and on the random tiny V4.1 (an oracle drafter places rejections at every offset), with
requests finishing mid-batch, preemption and confidence scheduling.
"""

from __future__ import annotations

import engine_fixtures
import pytest
import test_spec_async
from engine_fixtures import greedy, run_tokens, token_prompts
from spec_fixtures import price_by_graphs
from test_dspark_decode import MAX_TOKENS, PROMPTS, dspark, expected, mixed, reference
from test_spec_async import worker_oracle
from test_spec_decode_graphs import (
    assert_same_proposals,
    count_chained,
    heldout_prompts,
    record_chained_lengths,
    recorded_drafts,
    with_spec_graphs,
)

from deepinfer_core.default_model import EMBEDDED_MODEL
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.spec_decode.dspark_graph import DSparkGraphs
from deepinfer_core.spec_decode.dspark_proposer import DSparkProposer

make_llm = engine_fixtures.make_llm
make_async = test_spec_async.make_async
one_torch_thread = engine_fixtures.one_torch_thread
tiny_path = engine_fixtures.tiny_path
SIZES = [1, 2, 4, 8]


def with_dspark_graphs(llm, k: int, sizes: list[int], query_lens: tuple[int, ...] | None = None
                       ) -> tuple[list[tuple[int, int]], list[int]]:
    """Padded verification graphs and DSpark drafting graphs for the engine; returns the (batch size,
    query length) of every verification step through them and the batch size of every drafting replay."""
    steps = with_spec_graphs(llm, k, sizes, query_lens=query_lens)
    engine = llm.llm_engine
    proposer = engine.runner.proposer
    assert isinstance(proposer, DSparkProposer)
    graphs = proposer.graphs = DSparkGraphs(engine.model, engine.cache, sizes, k, capture=False)
    sizes_run = []
    run = graphs._run
    graphs._run = lambda size: sizes_run.append(size) or run(size)
    return steps, sizes_run


def trained(make, **kw):
    """The embedded trained V4.1 (float64, blocks of 32)."""
    return make(EMBEDDED_MODEL, dtype="float64", block_size=32, **kw)


# k=1 (slow): a single draft a step, the shortest verification layout; k=3 crosses every offset that k=1 does
K_VALUES = [pytest.param(1, marks=pytest.mark.slow), 3]


def trained_reference(make_llm, lengths: list[int]) -> tuple[list[list[int]], list, list[list[int]]]:
    """Held-out prompts (one per length), greedy params of those lengths and the outputs without speculation."""
    plain = trained(make_llm)
    prompts = heldout_prompts(plain, len(lengths))
    params = [greedy(n) for n in lengths]
    return prompts, params, [o.outputs[0].token_ids for o in plain.generate(token_prompts(prompts), params,
                                                                             use_tqdm=False)]


@pytest.mark.parametrize("k", K_VALUES)
def test_graph_drafting_equals_eager_drafting(k, make_llm):
    """The trained V4.1's DSpark stages (real acceptance: 1 to k + 1 kept positions a step): verification
    and drafting through the graphs propose the eager proposer's drafts with its confidences, requests
    finish at staggered steps (the batch shrinks under the graphs) and the outputs are those without
    speculation."""
    prompts, params, ref = trained_reference(make_llm, [14 + 5 * i for i in range(5)])
    runs = {}
    for padded in (False, True):
        llm = trained(make_llm, **dspark(k))
        steps, sizes_run = with_dspark_graphs(llm, k, SIZES) if padded else (None, None)
        seen = recorded_drafts(llm)
        outs = llm.generate(token_prompts(prompts), params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref, padded
        runs[padded] = (seen, llm.llm_engine.spec_decode_stats())
    assert len(sizes_run) >= 5 and {8, 4} <= set(sizes_run), sizes_run
    assert [q for _, q in steps].count(1 + k) >= 5, steps
    assert runs[True][1]["num_accepted_tokens"] > 0
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert runs[True][1][key] == runs[False][1][key], key
    assert_same_proposals(runs[False][0], runs[True][0])


@pytest.mark.parametrize("k", K_VALUES)
def test_chained_steps_equal_unchained_ones(k, make_llm, make_async):
    """Async scheduling through the graphs: steps of greedy verifications launch while the step before is
    in flight, their spans, Engram histories and drafting layouts moved on by its accepted drafts on the
    device. The trained V4.1 (a stop token inside accepted drafts, requests ending mid-batch): the outputs
    are those without speculation, and every sequence gets the drafts and confidences that the same engine
    proposes when each step waits for the one before."""
    prompts, params, ref = trained_reference(make_llm, [20 + 3 * i for i in range(5)])
    params[2] = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[ref[2][13]])
    ref[2] = ref[2][: ref[2].index(ref[2][13]) + 1]
    runs = {}
    for chain in (False, True):
        llm = trained(make_async, **dspark(k))
        sizes_run = with_dspark_graphs(llm, k, SIZES)[1]
        if not chain:
            llm.llm_engine.runner._chains = lambda so: False
        chained, seen = count_chained(llm), recorded_drafts(llm)
        outs = llm.generate(token_prompts(prompts), params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref, chain
        runs[chain] = (seen, chained[0], llm.llm_engine.spec_decode_stats(), len(sizes_run))
    assert runs[False][1] == 0 and runs[True][1] >= 5, runs[True][1]
    assert runs[True][3] >= runs[True][1]  # every chained step drafted through the graphs
    assert runs[True][2]["num_accepted_tokens"] > 0
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert runs[True][2][key] == runs[False][2][key], key
    assert_same_proposals(runs[False][0], runs[True][0])


VARIANTS = {
    "default": {},
    "preempt": dict(block_size=8, num_blocks=6, num_window_blocks=12),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("k", K_VALUES)
def test_random_tiny_v41_through_graphs_greedy_equal(k, variant, tiny_path, make_llm, make_async):
    """The random tiny V4.1 with async scheduling through the graphs, the worker's proposals replaced by the
    reference continuation with rejections at every offset (chained steps verify the stages' own drafts,
    which it nearly always rejects): the output is the one without speculation, with preemption too."""
    path = tiny_path("v41")
    ref = reference(make_llm, path)
    llm = make_async(path, dtype="float64", max_num_seqs=8, **dspark(k), **VARIANTS[variant])
    steps, sizes_run = with_dspark_graphs(llm, k, SIZES)
    chained = count_chained(llm)
    worker_oracle(llm, ref, mixed)
    assert run_tokens(llm, PROMPTS, greedy(MAX_TOKENS)) == expected(ref)
    engine = llm.llm_engine
    assert [q for _, q in steps].count(1 + k) >= 2 and len(sizes_run) >= 2, (steps, sizes_run)
    assert engine.counts["overlapped"] > 0 and chained[0] > 0
    assert engine.spec_decode_stats()["num_accepted_tokens"] > 0
    if variant == "preempt":
        assert engine.scheduler.num_preemptions > 0


def test_confidence_scheduling_replays_the_graphs(make_llm, make_async):
    """Confidence scheduling (the confidence head's estimates, steps priced by graphs where a third draft
    never pays) with graphs of every 1 + j tokens: chained steps replay the shorter verification graphs and
    the DSpark drafting graphs, and the outputs are those without speculation."""
    prompts, params, ref = trained_reference(make_llm, [20] * 5)
    llm = trained(make_async, **dspark(3, "confidence"))
    steps, sizes_run = with_dspark_graphs(llm, 3, SIZES, query_lens=(1, 2, 3, 4))
    spans = price_by_graphs(llm, (1.0, 1.1, 1.2, 100.0))
    lengths, chained = record_chained_lengths(llm), count_chained(llm)
    outs = llm.generate(token_prompts(prompts), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert max(map(max, spans)) == 2
    assert chained[0] >= 3 and set(lengths) <= {2, 3} and 3 in lengths, lengths
    assert len(sizes_run) >= chained[0], sizes_run
    assert llm.llm_engine.counts["overlapped"] > llm.llm_engine.counts["drained"]

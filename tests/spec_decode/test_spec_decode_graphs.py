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
import test_spec_async
import torch
from engine_fixtures import greedy, make_prompt, run_tokens, token_prompts
from spec_fixtures import oracle_drafts, spec
from test_spec_async import expected, worker_oracle
from test_spec_decode import MAX_TOKENS, PROMPTS, mixed, reference, run_with_aborts

from deepinfer_core.platform import Platform
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.spec_decode.mtp_graph import MtpGraphs
from deepinfer_core.spec_decode.rollback import CacheUndo, GraphUndo
from deepinfer_core.testing.uncaptured_graphs import use_uncaptured_graphs
from deepinfer_core.worker.graph_runner import GraphRunner

make_llm = engine_fixtures.make_llm
make_async = test_spec_async.make_async
one_torch_thread = engine_fixtures.one_torch_thread
tiny_path = engine_fixtures.tiny_path


def heldout_prompts(llm, n: int) -> list[list[int]]:
    """``n`` prompts of 40, 49, ... tokens from the held-out text, 150 tokens apart."""
    ids = llm.llm_engine.encode(open("data/heldout_slice.txt").read())
    return [ids[i * 150: i * 150 + 40 + 9 * i] for i in range(n)]


def with_spec_graphs(llm, k: int, sizes: list[int], undo_in_graph: bool = True,
                     query_lens: tuple[int, ...] | None = None) -> list[tuple[int, int]]:
    """Give the engine's speculative runner padded graphs for ``query_lens`` (1 and 1 + k) new tokens
    (saving the undo log inside them, as the engine's own do, unless ``undo_in_graph`` is False); returns
    the list that records (batch size, query length) of every step run through them."""
    runner = use_uncaptured_graphs(llm.llm_engine, sizes, query_lens or (1, 1 + k), undo_in_graph)
    steps = []
    original = runner.replay_step

    def record(batch):
        steps.append((batch.padded_to, batch.num_tokens // batch.padded_to))
        return original(batch)

    runner.replay_step = record
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


def test_undo_log_of_padded_steps_is_saved_inside_the_graph(tiny_path, make_llm, monkeypatch):
    """Padded verification steps save every token's rows in the graph's prologue: the host builds no undo
    log for them (only for the eager steps, those with prefill chunks), and the output is the reference's."""
    path = tiny_path("tiny_hc4")
    ref = reference(make_llm, path, PROMPTS)
    llm = make_llm(path, dtype="float64", max_num_seqs=16, **spec(2))
    steps = with_spec_graphs(llm, 2, [1, 2, 4, 8, 16])
    host_logs, graph_logs = [], []
    init = CacheUndo.__init__

    def counted_init(self, cache, host, *args, **kwargs):
        (host_logs if host is not None else graph_logs).append(1)
        init(self, cache, host, *args, **kwargs)

    monkeypatch.setattr(CacheUndo, "__init__", counted_init)
    oracle_drafts(llm, ref, mixed)
    outs = run_tokens(llm, PROMPTS, greedy(MAX_TOKENS))
    assert outs == [ref[tuple(p)][:MAX_TOKENS] for p in PROMPTS]
    verified = [q for _, q in steps if q == 3]
    assert len(graph_logs) == len(verified) >= 2
    assert len(host_logs) < len(graph_logs)


class _Replayed:
    """A "captured graph" on the CPU: replay reruns the captured function and writes what it computed into
    the tensors the capture returned (an undo log's rows, owners and saved values too), as a replay of
    a real graph rewrites its own memory; ``replays`` counts them per kind of graph."""

    def __init__(self, forward, key, replays: dict):
        self.forward, self.key, self.replays = forward, key, replays
        self.output = forward(key)

    def replay(self):
        kind = "forward" if isinstance(self.output, tuple) else "restore"
        self.replays[kind] = self.replays.get(kind, 0) + 1
        with torch.inference_mode():  # as the capture ran
            new = self.forward(self.key)
            if kind == "forward":
                for old, fresh in zip(self.output, new):
                    if isinstance(old, torch.Tensor):
                        old.copy_(fresh)
                    elif isinstance(old, CacheUndo):
                        for a, b in zip(old.saved, fresh.saved, strict=True):
                            a.rows.copy_(b.rows), a.owner.copy_(b.owner), a.values.copy_(b.values)


class _ReplayPlatform(Platform):
    supports_graphs = True

    def __init__(self, device):
        super().__init__(device)
        self.replays: dict[str, int] = {}

    def capture_graphs(self, keys, forward):
        return {key: _Replayed(forward, key, self.replays) for key in sorted(keys, reverse=True)}


def test_rejected_rows_are_put_back_by_restore_graphs(tiny_path, make_llm):
    """Captured verification graphs come with one restore graph each: the rejected mask copied into the
    graph's own and the restore replayed, no eager restore on those steps; greedy output is the reference's."""
    path = tiny_path("tiny_hc4")
    ref = reference(make_llm, path, PROMPTS)
    llm = make_llm(path, dtype="float64", max_num_seqs=8, **spec(2))
    engine = llm.llm_engine
    platform = _ReplayPlatform(engine.device)
    runner = GraphRunner(engine.model, engine.cache, [1, 2, 4, 8], engine.scheduler_config.max_model_len,
                         engine.args.block_size, platform=platform, query_lens=(1, 3), keep_streams=True,
                         min_context=16, prologue=GraphUndo(engine.cache, engine.model.cfg.num_hidden_layers))
    engine.runner.graph_runner = runner
    undos = [g.output[2] for key, g in runner.graphs.items() if key[2] == 3]
    assert undos and all(u.restore_graph is not None for u in undos)
    assert all(g.output[2] is None for key, g in runner.graphs.items() if key[2] == 1)
    eager = []
    restore_rows = CacheUndo.restore_rows

    def counted(self, rejected):
        eager.append(self.restore_graph is None)
        restore_rows(self, rejected)

    CacheUndo.restore_rows = counted
    try:
        oracle_drafts(llm, ref, mixed)
        outs = run_tokens(llm, PROMPTS[:8], greedy(MAX_TOKENS))
    finally:
        CacheUndo.restore_rows = restore_rows
    assert outs == [ref[tuple(p)][:MAX_TOKENS] for p in PROMPTS[:8]]
    assert platform.replays.get("restore", 0) >= 2 and platform.replays["restore"] <= platform.replays["forward"]
    stats = engine.spec_decode_stats()
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    # a restore graph puts back what an eager restore of the same mask does (noise in the pools first)
    undo = max(undos, key=lambda u: u.num_tokens)
    pools = {id(saved.pool): saved.pool for saved in undo.saved}
    rejected = torch.rand(undo.num_tokens, generator=torch.Generator().manual_seed(0)) < 0.5
    noise = {key: torch.randn(pool.shape, dtype=pool.dtype) if pool.is_floating_point() else pool.clone()
             for key, pool in pools.items()}
    results = []
    for restore in (undo.restore, undo.restore_rows):
        with torch.inference_mode():
            for key, pool in pools.items():
                pool.copy_(noise[key])
        restore(rejected)
        results.append({key: pool[:-1].clone() for key, pool in pools.items()})  # the last row: the trash
    assert all(torch.equal(results[0][key], results[1][key]) for key in pools)
    assert any(not torch.equal(results[1][key], noise[key][:-1]) for key in pools)


def count_filled_steps(llm) -> list[int]:
    """Record the query length of every step the runner pads with filler tokens."""
    runner, filled = llm.llm_engine.runner, []
    original = runner._graph_query_len

    def record(scheduled):
        q = original(scheduled)
        if q:
            filled.append(q)
        return q

    runner._graph_query_len = record
    return filled


def test_unequal_drafts_are_padded_with_fillers(tiny_path, make_llm):
    """Confidence scheduling gives sequences different draft counts: each span is padded to 1 + k tokens
    with filler tokens, always rejected and their cache writes put back, and the output is still the
    reference's."""
    path = tiny_path("tiny")
    prompts = [make_prompt(n, seed=i) for i, n in enumerate([5, 17, 30, 33])]
    ref = reference(make_llm, path, prompts)
    llm = make_llm(path, dtype="float64", max_num_seqs=4, **spec(3, "confidence"))
    steps = with_spec_graphs(llm, 3, [1, 2, 4])
    filled = count_filled_steps(llm)
    oracle_drafts(llm, ref, mixed)
    outs = run_tokens(llm, prompts, greedy(MAX_TOKENS))
    assert outs == [ref[tuple(p)][:MAX_TOKENS] for p in prompts]
    assert filled and set(filled) == {4} and all(q in (1, 4) for _, q in steps)


def test_equal_spans_of_an_uncaptured_length_are_padded(tiny_path, make_llm):
    """A step whose spans all verify fewer than k drafts (a confidence-scheduled single user) has no
    graph of its own length: it is padded to 1 + k, and one of a captured length is not."""
    from deepinfer_core.engine.scheduler_output import ScheduledSeq

    llm = make_llm(tiny_path("tiny"), dtype="float64", max_num_seqs=4, **spec(3, "confidence"))
    with_spec_graphs(llm, 3, [1, 2, 4])

    def step(*drafts):
        return [ScheduledSeq(i, 40, [5] * (1 + d), [0], [0], i, 0, None, True, num_drafts=d)
                for i, d in enumerate(drafts)]

    query_len = llm.llm_engine.runner._graph_query_len
    assert [query_len(step(2)), query_len(step(1, 1)), query_len(step(2, 1))] == [4, 4, 4]
    assert [query_len(step(3)), query_len(step(0, 0)), query_len(step(3, 3))] == [None, None, None]


def test_plain_requests_ride_in_padded_verification_steps(tiny_path, make_llm):
    """Requests that draft nothing (before their ``min_tokens``) decode one token per step beside verifying
    ones, plain and with penalties and logprobs: the step is padded to 1 + k tokens per sequence and every
    output, and its logprobs, equals the run without speculation."""
    path = tiny_path("tiny_hc4")
    prompts = [make_prompt(n, seed=i) for i, n in enumerate([3, 15, 16, 29, 31, 47])]
    params = [greedy(12, min_tokens=12, logprobs=1) if i % 3 == 0
              else greedy(12, repetition_penalty=1.3, logprobs=2) if i % 3 == 1
              else greedy(12) for i in range(len(prompts))]
    plain = make_llm(path, dtype="float64", max_num_seqs=8)
    ref = plain.generate(token_prompts(prompts), params, use_tqdm=False)
    llm = make_llm(path, dtype="float64", max_num_seqs=8, **spec(2))
    with_spec_graphs(llm, 2, [1, 2, 4, 8])
    filled = count_filled_steps(llm)
    outs = llm.generate(token_prompts(prompts), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    for a, b in zip(outs, ref):
        if b.outputs[0].logprobs is not None:
            for got, want in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                assert got.keys() == want.keys()
                assert list(got.values()) == pytest.approx(list(want.values()), abs=1e-9)
    assert len(filled) >= 3 and set(filled) == {3}


def recorded_drafts(llm) -> list[tuple[int, list[int], list[float]]]:
    """Every proposal the engine receives: (sequence, drafts, confidences)."""
    planner, seen = llm.llm_engine.drafts, []
    offer = planner.offer

    def record(seq, drafts, confidences):
        seen.append((seq.seq_id, list(drafts), list(confidences)))
        offer(seq, drafts, confidences)

    planner.offer = record
    return seen


def heldout_reference(make_llm, lengths: list[int]) -> tuple[list[list[int]], list, list[list[int]]]:
    """``heldout_prompts`` (one per length), greedy params of those lengths and the trained model's
    outputs without speculation (float64)."""
    plain = make_llm(None, dtype="float64", block_size=32)
    prompts = heldout_prompts(plain, len(lengths))
    params = [greedy(n) for n in lengths]
    ref = [o.outputs[0].token_ids for o in plain.generate(token_prompts(prompts), params, use_tqdm=False)]
    return prompts, params, ref


def assert_same_proposals(eager: list, padded: list) -> None:
    """Two runs' ``recorded_drafts``: the same drafts for the same sequences (their ids count on per
    process), confidences equal to float64 rounding."""
    first = [min(s for s, _, _ in seen) for seen in (eager, padded)]
    assert [(s - first[1], d) for s, d, _ in padded] == [(s - first[0], d) for s, d, _ in eager]
    for (_, _, a), (_, _, b) in zip(eager, padded):
        assert a == pytest.approx(b, rel=1e-12, abs=1e-12)


def with_drafting_graphs(llm, k: int, sizes: list[int], query_lens: tuple[int, ...] | None = None
                         ) -> tuple[list[tuple[int, int]], list[int]]:
    """Padded MTP drafting for the engine (and padded verification graphs); returns the records of
    ``with_spec_graphs`` and the list of the batch sizes drafted through the padded path."""
    steps = with_spec_graphs(llm, k, sizes, query_lens=query_lens)
    graphs = llm.llm_engine.runner.proposer.graphs = MtpGraphs(llm.llm_engine.model, llm.llm_engine.cache, sizes, k,
                                                               capture=False)
    sizes_run = []
    original = graphs._run
    graphs._run = lambda size: sizes_run.append(size) or original(size)
    return steps, sizes_run


def count_device_drafting(llm) -> list[int]:
    """[steps drafted on the device from the verification's result, those of them with plain samples]."""
    runner, counts = llm.llm_engine.runner, [0, 0]
    original = runner._draft_on_device

    def draft(scheduled, streams, starts, plain, *rest):
        counts[0] += 1
        counts[1] += bool(plain)
        return original(scheduled, streams, starts, plain, *rest)

    runner._draft_on_device = draft
    return counts


@pytest.mark.parametrize("k", [1, 2, 3])
def test_padded_drafting_equals_eager_drafting(k, make_llm):
    """The trained default model's MTP layer (real acceptance, so 1 to k + 1 kept positions per step):
    the padded catch-up and draft steps propose the eager proposer's drafts with its confidences, and
    the outputs are the ones without speculation."""
    prompts, params, ref = heldout_reference(make_llm, [20 + 3 * i for i in range(5)])
    runs = {}
    for padded in (False, True):
        llm = make_llm(None, dtype="float64", block_size=32, **spec(k))
        sizes_run = with_drafting_graphs(llm, k, [1, 2, 4, 8])[1] if padded else None
        on_device = count_device_drafting(llm) if padded else None
        seen = recorded_drafts(llm)
        outs = llm.generate(token_prompts(prompts), params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref
        runs[padded] = seen
    assert len(sizes_run) >= 5 and {8, 4} <= set(sizes_run), sizes_run
    assert on_device[0] >= 5 and on_device[1] >= 1, on_device  # from verifications, some with plain samples
    assert_same_proposals(runs[False], runs[True])


def test_steps_with_prompt_chunks_draft_through_the_graphs(make_llm):
    """Prompts joining decoding sequences in chunks: each such step catches the MTP block up eagerly once
    without drafting (chunks that end no prompt, and every drafting span but its last k + 1 positions),
    then drafts through the graphs (one eager forward instead of k); the drafts and outputs are the eager
    proposer's."""
    k = 3
    prompts, params, ref = heldout_reference(make_llm, [12 + 2 * i for i in range(5)])
    runs = {}
    for padded in (False, True):
        llm = make_llm(None, dtype="float64", block_size=32, max_num_seqs=3, max_num_batched_tokens=48, **spec(k))
        events = []
        if padded:
            graphs = with_drafting_graphs(llm, k, [1, 2, 4])[1]
            proposer = llm.llm_engine.runner.proposer
            eager = proposer._propose
            proposer._propose = lambda spans, streams, eager=eager, graphs=graphs, events=events: (
                events.append(("eager", [s.draft for s in spans], len(graphs))) or eager(spans, streams))
        seen = recorded_drafts(llm)
        outs = llm.generate(token_prompts(prompts), params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref
        runs[padded] = seen
    assert all(not any(drafts) for _, drafts, _ in events)  # the eager forwards only catch up
    assert len(events) >= 6, events  # every step with a prompt chunk: 5 prompts of 40-76 tokens, 48 a step
    assert all(n < len(graphs) for _, _, n in events)  # each followed by a graph's drafting
    assert_same_proposals(runs[False], runs[True])


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "padded"])
def test_uniform_greedy_verification_equals_the_general_one(graphs, make_llm):
    """Steps of greedy verifications of one length take ``Verifier.verify_uniform`` (no host layout of the
    rows); turned off, the general verification gives the same drafts, accepted counts and tokens. The
    trained model (real rejections) with prompts whose spans cross window and block boundaries."""
    plain = make_llm(None, dtype="float64", block_size=32)
    ids = plain.llm_engine.encode(open("data/heldout_slice.txt").read())
    prompts = [ids[i * 170: i * 170 + 30 + 11 * i] for i in range(6)]
    params = [greedy(24 + 5 * i) for i in range(len(prompts))]
    runs = {}
    for uniform in (True, False):
        llm = make_llm(None, dtype="float64", block_size=32, **spec(3))
        if graphs:
            with_drafting_graphs(llm, 3, [1, 2, 4, 8])
        verifier, calls = llm.llm_engine.runner.verifier, [0]
        fast = verifier.verify_uniform

        def counted(*args, fast=fast, calls=calls):
            calls[0] += 1
            return fast(*args)

        verifier.verify_uniform = counted
        if not uniform:
            general = verifier.verify
            verifier.verify = lambda *args, general=general: general(*args[:7])  # no span: the general path
        seen = recorded_drafts(llm)
        outs = llm.generate(token_prompts(prompts), params, use_tqdm=False)
        cache = llm.llm_engine.cache
        rows = [t.clone() for pools in (cache.window_kv, cache.comp_kv, cache.index_keys, cache.comp_state,
                                        cache.index_state, cache.comp_boundary, cache.index_boundary)
                for pool in (pools.values() if isinstance(pools, dict) else pools)
                for t in (pool if isinstance(pool, tuple) else (pool,))]
        runs[uniform] = ([o.outputs[0].token_ids for o in outs], seen, llm.llm_engine.spec_decode_stats(), calls[0],
                         rows)
    assert runs[True][3] >= 10 and runs[False][3] == 0, (runs[True][3], runs[False][3])
    # every row the rejected drafts wrote was put back: the caches end bit for bit the same
    assert len(runs[True][4]) == len(runs[False][4])
    assert all(torch.equal(a, b) for a, b in zip(runs[True][4], runs[False][4]))
    assert runs[True][2]["num_accepted_tokens"] > 0
    assert runs[True][0] == runs[False][0]
    assert [d for _, d, _ in runs[True][1]] == [d for _, d, _ in runs[False][1]]
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert runs[True][2][key] == runs[False][2][key], key


@pytest.mark.parametrize("schedule", ["fixed", "confidence"])
def test_async_speculation_through_graphs(schedule, tiny_path, make_llm, make_async):
    """Async scheduling (step N+1's spans are placeholders shifted by step N's accepted drafts) with
    verification and drafting through the padded graph layouts: the reference's tokens, with steps
    overlapped."""
    path = tiny_path("tiny")
    ref = reference(make_llm, path, PROMPTS)
    llm = make_async(path, dtype="float64", max_num_seqs=16, **spec(3, schedule))
    steps, sizes_run = with_drafting_graphs(llm, 3, [1, 2, 4, 8, 16])
    worker_oracle(llm, ref, mixed)
    assert run_tokens(llm, PROMPTS, greedy(MAX_TOKENS)) == expected(ref, PROMPTS)
    assert [q for _, q in steps].count(4) >= 2 and len(sizes_run) >= 2, (steps, sizes_run)
    assert llm.llm_engine.counts["overlapped"] > 0


def count_chained(llm) -> list[int]:
    """[steps launched before the step before ended, laid out on the device from its result, those of
    them where ``max_tokens`` may cut a sequence's drafts (by how many the step before accepts)]."""
    runner, counts = llm.llm_engine.runner, [0, 0]
    original = runner._execute_chained

    def chained(so):
        counts[0] += 1
        counts[1] += any(runner._room(runner.requests[s.seq_id]) < s.num_drafts + runner.k for s in so.scheduled)
        return original(so)

    runner._execute_chained = chained
    return counts


@pytest.mark.parametrize("k", [1, 3])
def test_chained_steps_equal_unchained_ones(k, make_llm, make_async):
    """Async scheduling through the graphs: a step of greedy verifications launches while the step before
    is in flight, its spans moved on by that step's accepted drafts and its tokens, drafts, layout and
    drafting layout derived on the device. The trained model (real acceptance; spans crossing window and
    block boundaries, max_tokens cutting drafts near the end, a stop token inside accepted drafts): the
    outputs are those without speculation, and every sequence gets the drafts, with their confidences,
    that the same engine proposes when each step waits for the one before (the worker shifting the spans
    on the host)."""
    prompts, params, ref = heldout_reference(make_llm, [20 + 3 * i for i in range(5)])
    params[2] = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[ref[2][13]])
    ref[2] = ref[2][: ref[2].index(ref[2][13]) + 1]
    runs = {}
    for chain in (False, True):
        llm = make_async(None, dtype="float64", block_size=32, **spec(k))
        with_drafting_graphs(llm, k, [1, 2, 4, 8])
        if not chain:
            llm.llm_engine.runner._chains = lambda so: False
        chained, seen = count_chained(llm), recorded_drafts(llm)
        outs = llm.generate(token_prompts(prompts), params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref, chain
        first = min(s for s, _, _ in seen)
        proposals = {}
        for seq, drafts, confidences in seen:
            proposals.setdefault(seq - first, []).append((drafts, confidences))
        runs[chain] = (proposals, chained[0], llm.llm_engine.spec_decode_stats(), chained[1])
    assert runs[False][1] == 0 and runs[True][1] >= 5, runs[True][1]
    assert runs[True][3] >= 3, runs[True][3]  # near max_tokens too, the drafts cut on the device
    assert runs[True][2]["num_accepted_tokens"] > 0
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert runs[True][2][key] == runs[False][2][key], key
    unchained, chained = runs[False][0], runs[True][0]
    assert unchained.keys() == chained.keys()
    for seq in unchained:
        assert [d for d, _ in chained[seq]] == [d for d, _ in unchained[seq]], seq
        for (_, a), (_, b) in zip(chained[seq], unchained[seq]):
            assert a == pytest.approx(b, rel=1e-12, abs=1e-12)


def record_chains_past_leaving(llm) -> list[bool]:
    """For every chained step, whether a sequence of the step in flight left (finished or aborted)."""
    runner, across = llm.llm_engine.runner, []
    execute = runner._execute_chained

    def chained(so):
        across.append(bool(set(so.finished_seq_ids) & set(runner._chain.rows)))
        return execute(so)

    runner._execute_chained = chained
    return across


def test_chained_steps_go_on_past_finishing_sequences(make_llm, make_async):
    """A chained step launches in the step after a sequence finished (max_tokens, a stop token): the step
    before, still in flight, holds the finished sequence, which the runner forgets once that step's output
    is in. The trained model, requests finishing at staggered steps: the outputs are those without
    speculation, and the runner keeps nothing of the finished requests once the next batch runs."""
    plain = make_llm(None, dtype="float64", block_size=32)
    prompts = heldout_prompts(plain, 6)
    params = [greedy(12 + 5 * i) for i in range(len(prompts))]
    ref = [o.outputs[0].token_ids for o in plain.generate(token_prompts(prompts), params, use_tqdm=False)]
    params[3] = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[ref[3][16]])
    ref[3] = ref[3][: ref[3].index(ref[3][16]) + 1]
    llm = make_async(None, dtype="float64", block_size=32, **spec(3))
    with_drafting_graphs(llm, 3, [1, 2, 4, 8])
    runner = llm.llm_engine.runner
    across = record_chains_past_leaving(llm)
    outs = llm.generate(token_prompts(prompts), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert sum(across) >= 2 and len(across) >= 12, across
    first = {s for s in runner.requests}
    llm.generate(token_prompts(prompts[:1]), greedy(4), use_tqdm=False)
    assert not first & (runner.requests.keys() | runner._accepted.keys() | runner._drafts.keys())


def test_chained_steps_go_on_past_aborted_requests(make_llm, make_async):
    """Requests aborted while chained steps are in flight: the next step still chains, the aborted ones
    give no output and the others' tokens are those without speculation (the trained model)."""
    plain = make_llm(None, dtype="float64", block_size=32)
    prompts = heldout_prompts(plain, 6)
    ref = [o.outputs[0].token_ids for o in plain.generate(token_prompts(prompts), greedy(30), use_tqdm=False)]
    llm = make_async(None, dtype="float64", block_size=32, **spec(3))
    with_drafting_graphs(llm, 3, [1, 2, 4, 8])
    engine = llm.llm_engine
    across = record_chains_past_leaving(llm)
    rids = [engine.add_request(None, {"prompt_token_ids": p}, greedy(30)) for p in prompts]
    done = run_with_aborts(engine, {rids[1]: 4, rids[4]: 6})
    assert {rid: done[rid] for rid in rids if rid not in (rids[1], rids[4])} == {
        rid: want for rid, want in zip(rids, ref) if rid not in (rids[1], rids[4])}
    assert rids[1] not in done and rids[4] not in done
    assert sum(across) >= 1, across


def capped_budgets(llm, caps: list[int]) -> None:
    """Cap every sequence's draft budget, the same for all, at ``caps`` in turn, one a planning."""
    planner, turn = llm.llm_engine.drafts, [0]
    plan = planner.plan

    def capped(scheduler, config):
        plan(scheduler, config)
        cap, turn[0] = caps[turn[0] % len(caps)], turn[0] + 1
        for seq in scheduler.running:
            seq.draft_budget = min(seq.draft_budget, cap)

    planner.plan = capped


def record_chained_lengths(llm) -> list[int]:
    """The verification graph length of every chained step."""
    runner, lengths = llm.llm_engine.runner, []
    execute = runner._execute_chained

    def record(so):
        lengths.append(runner._chained_query_len(so.scheduled))
        return execute(so)

    runner._execute_chained = record
    return lengths


def test_chained_steps_replay_the_shortest_graph_that_holds_their_drafts(make_llm, make_async):
    """Graphs for every 1 + j tokens (as confidence scheduling captures them): a chained step whose
    sequences verify at most j drafts replays the 1 + j graph, its catch-up reading the last of its
    rows past them. Budgets capped at 0 to 3 in turn, the trained model: greedy outputs are those without
    speculation, a sampled one that of unchained steps, and chained steps propose the drafts, with their
    confidences, of unchained ones."""
    plain = make_llm(None, dtype="float64", block_size=32)
    prompts = heldout_prompts(plain, 4)
    params = [greedy(24 + 3 * i) for i in range(len(prompts))]
    ref = [o.outputs[0].token_ids for o in plain.generate(token_prompts(prompts), params, use_tqdm=False)]
    params[1] = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=27)  # equal chained or not
    runs = {}
    for chain in (False, True):
        llm = make_async(None, dtype="float64", block_size=32, **spec(3))
        with_drafting_graphs(llm, 3, [1, 2, 4], query_lens=(1, 2, 3, 4))
        capped_budgets(llm, [3, 1, 1, 2, 0, 2, 3, 1])
        if not chain:
            llm.llm_engine.runner._chains = lambda so: False
        chained, seen = count_chained(llm), recorded_drafts(llm)
        lengths = record_chained_lengths(llm)
        outs = [o.outputs[0].token_ids for o in llm.generate(token_prompts(prompts), params, use_tqdm=False)]
        assert [t for i, t in enumerate(outs) if i != 1] == [t for i, t in enumerate(ref) if i != 1], chain
        runs[chain] = (seen, chained[0], llm.llm_engine.spec_decode_stats(), set(lengths), outs[1])
    assert runs[False][1] == 0 and runs[True][1] >= 5, runs[True][1]
    assert 4 in runs[True][3] and runs[True][3] - {4}, runs[True][3]  # chained steps of shorter graphs too
    assert runs[True][4] == runs[False][4] and len(runs[True][4]) == 27
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert runs[True][2][key] == runs[False][2][key], key
    assert [d for _, d, _ in runs[True][0]] == [d for _, d, _ in runs[False][0]]
    for (_, _, a), (_, _, b) in zip(runs[True][0], runs[False][0]):
        assert a == pytest.approx(b, rel=1e-12, abs=1e-12)


def test_chained_sampled_steps_equal_unchained_ones(make_llm, make_async):
    """Sampled requests chain too (temperature with top-k, top-p and min-p, seeded and not, two penalised,
    beside a greedy one; two with logprobs): a chained step's target distributions, acceptance uniforms
    and residual noise are those of the positions the device moved its spans to, so its tokens (and
    logprobs) are those of the same engine when every step waits for the one before, drafts rejected at
    random offsets."""
    plain = make_llm(None, dtype="float64", block_size=32)
    prompts = heldout_prompts(plain, 5)
    params = [SamplingParams(temperature=0.8, seed=11, max_tokens=30, presence_penalty=0.7),
              SamplingParams(temperature=1.0, top_p=0.9, seed=12, max_tokens=26, logprobs=2),
              SamplingParams(temperature=0.7, top_k=20, min_p=0.05, max_tokens=33, repetition_penalty=1.2,
                             frequency_penalty=0.4),
              greedy(24, logprobs=0),
              SamplingParams(temperature=1.3, top_k=50, top_p=0.95, seed=13, max_tokens=28)]
    runs = {}
    for chain in (False, True):
        llm = make_async(None, dtype="float64", block_size=32, **spec(3))
        with_drafting_graphs(llm, 3, [1, 2, 4, 8])
        if not chain:
            llm.llm_engine.runner._chains = lambda so: False
        chained = count_chained(llm)
        outs = llm.generate(token_prompts(prompts), params, use_tqdm=False)
        runs[chain] = ([o.outputs[0].token_ids for o in outs], chained[0], llm.llm_engine.spec_decode_stats(),
                       [o.outputs[0].logprobs for o in outs])
    assert runs[True][0] == runs[False][0]
    for i in (1, 3):
        got, want = runs[True][3][i], runs[False][3][i]
        assert len(got) == len(want) == params[i].max_tokens
        for a, b in zip(got, want):
            assert a.keys() == b.keys() and list(a.values()) == pytest.approx(list(b.values()), abs=1e-12)
    assert [len(t) for t in runs[True][0]] == [p.max_tokens for p in params]
    assert runs[False][1] == 0 and runs[True][1] >= 5, runs[True][1]
    stats = runs[True][2]
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"], stats
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert runs[True][2][key] == runs[False][2][key], key


@pytest.mark.parametrize("graphs", [False, True])
def test_penalised_verification_keeps_greedy_equal(graphs, make_llm, make_async):
    """Penalised greedy requests speculate: each verification row is penalised by the outputs and the
    drafts before it; requests with logprobs get those of every kept token. The trained model (which
    repeats itself, so the penalties change its argmax), k=3, penalised and unpenalised requests in one
    batch, eagerly and through the padded graphs with async scheduling (steps chained, each penalised by
    the step before's tokens counted on the device): the tokens and logprobs are those without
    speculation, with drafts accepted and rejected."""
    plain = make_llm(None, dtype="float64", block_size=32)
    prompts = heldout_prompts(plain, 4)
    penalties = [dict(repetition_penalty=1.3), dict(presence_penalty=0.8, frequency_penalty=0.5), {},
                 dict(frequency_penalty=1.2)]
    params = [greedy(24, **p, logprobs=2 if i % 2 else None) for i, p in enumerate(penalties)]
    ref_outs = plain.generate(token_prompts(prompts), params, use_tqdm=False)
    ref = [o.outputs[0].token_ids for o in ref_outs]
    unpenalised = [o.outputs[0].token_ids for o in plain.generate(token_prompts(prompts), greedy(24), use_tqdm=False)]
    assert all(a != b for a, b, p in zip(ref, unpenalised, penalties) if p)  # the penalties matter
    llm = (make_async if graphs else make_llm)(None, dtype="float64", block_size=32, **spec(3))
    chained = [0]
    if graphs:
        with_drafting_graphs(llm, 3, [1, 2, 4, 8])
        chained = count_chained(llm)
    outs = llm.generate(token_prompts(prompts), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert chained[0] >= 5 if graphs else chained[0] == 0, chained  # counted on the device, they chain
    for out, want in zip(outs[1::2], ref_outs[1::2]):  # and the logprobs, to float64 rounding
        assert len(out.outputs[0].logprobs) == len(want.outputs[0].logprobs)
        for got, lp in zip(out.outputs[0].logprobs, want.outputs[0].logprobs):
            assert got.keys() == lp.keys() and list(got.values()) == pytest.approx(list(lp.values()), abs=1e-9)
    for out, p in zip(outs, penalties):
        stats = out.spec_decode_stats
        assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"], (p, stats)

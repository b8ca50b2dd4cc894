"""Decode graphs under expert parallel, on the CPU: the ranks' runners replay the padded graph layouts
uncaptured (``testing/uncaptured_graphs.py``: exactly what a replay computes), the MoE dispatch and combine
inside them at a fixed per-rank capacity (``parallel/ep_padded.py``), each step's batch size agreed by the
ranks before it runs (``parallel/batch_sync.py``).

In process: the agreement's rule; the fixed-shape dispatch of one rank (with EPLB replicas) gives the
eager logits bit for bit; EPLB rewrites the slot tables in place. Across processes (gloo, float64): the
fixed-shape exchange of two ranks equals the MoE on one process for skewed routing; two ranks with graphs,
async scheduling and EPLB give one process's greedy tokens and logprobs through chunked prefill,
preemption, a forced rearrangement between two replays (weights and tables where they were) and a phase
where one rank idles (its placeholder steps replay the other's graph size, their padding tokens left out
of the expert load); MTP speculation (slow: the
trained tiny V4, so drafts are both accepted and rejected) and four ranks (slow) likewise.
"""

from __future__ import annotations

import os
import socket

import engine_fixtures
import pytest
import torch
import torch.distributed as dist
from engine_fixtures import greedy, make_prompt
from model_fixtures import engine_logits, no_kernel_packs

from deepinfer_core.comm import TorchDistributedCommunicator
from deepinfer_core.default_model import v4_model_path
from deepinfer_core.entrypoints.llm import LLM
from deepinfer_core.models import load_model
from deepinfer_core.parallel.batch_sync import AgreedShape, BatchCoordinator, StepShape, combine_shapes
from deepinfer_core.parallel.dp_engine_core import rank_start_context
from deepinfer_core.parallel.ep import AllToAllDispatcher, attach_expert_map, place_experts
from deepinfer_core.parallel.expert_map import ExpertMap
from deepinfer_core.testing.tiny_model import build_tiny_checkpoint
from deepinfer_core.testing.uncaptured_graphs import expert_storage, graph_counts, install_uncaptured_graphs

one_torch_thread = engine_fixtures.one_torch_thread
tiny_path = engine_fixtures.tiny_path
BLOCK = engine_fixtures.BLOCK_SIZE
SIZES = [1, 2, 4]


# --- in process ----------------------------------------------------------------------------------

def test_ranks_agree_on_the_largest_bucket_or_run_eagerly():
    shapes = [StepShape(3), StepShape(0), StepShape(1)]
    assert combine_shapes(shapes) == AgreedShape(3, 1)  # a placeholder fits any graph
    assert combine_shapes([StepShape(2, 3), StepShape(4, 3)]) == AgreedShape(4, 3)
    assert combine_shapes([StepShape(2, 3), StepShape(4, 1)]) is None  # unequal query lengths
    assert combine_shapes([StepShape(2), StepShape(5, 1, graphable=False)]) is None  # a prefill somewhere
    assert combine_shapes([StepShape(0), StepShape(0)]) is None  # nothing anywhere: no graph
    for shape in (StepShape(3), StepShape(2, 3), StepShape(0), StepShape(5, 1, graphable=False)):
        assert BatchCoordinator(None, 1).agree(shape) == combine_shapes([shape])


def _model(path):
    with no_kernel_packs():
        return load_model(path, dtype=torch.float64)


def test_fixed_shape_dispatch_gives_the_eager_logits_bit_for_bit(tiny_path):
    """One rank whose stacks hold 9 slots (3 replicas): every MoE layer dispatched at a fixed capacity
    (unused rows carry slot -1) gives the eager dispatch's logits exactly."""
    path = tiny_path("tiny")
    plain, model = _model(path), _model(path)
    cfg = model.cfg
    disp = AllToAllDispatcher(TorchDistributedCommunicator(None), cfg.n_routed_experts + 3, cfg.hidden_size)
    emap = attach_expert_map(disp, cfg.num_hidden_layers, cfg.n_routed_experts)
    place_experts(model, emap.local_logical(0), cfg.n_routed_experts)
    model.ep = disp
    ids = make_prompt(21, seed=7)
    eager = engine_logits(model, ids, chunk=8)
    with disp.graph_shapes():
        assert disp.fixed_shapes
        got = engine_logits(model, ids, chunk=8)
    assert not disp.fixed_shapes
    assert torch.equal(got, eager)
    # replicas split an expert's rows over several GEMMs: the plain model's to rounding
    torch.testing.assert_close(got, engine_logits(plain, ids, chunk=8), rtol=0, atol=1e-12)


def test_expert_map_tables_are_rewritten_in_place():
    emap = ExpertMap.create(num_layers=2, num_logical=6, num_physical=8, world=2)
    ids = torch.tensor([[0, 3], [0, 1], [0, 3], [5, 0]])
    emap.physical(0, ids)  # the layer's device tables exist from now on
    tables = emap._device_tables[0, ids.device]
    ptrs = [t.data_ptr() for t in tables]
    layout = torch.tensor([[5, 1, 2, 5, 3, 4, 0, 5], [0, 1, 2, 0, 3, 4, 5, 3]])
    emap.set(layout)
    assert [t.data_ptr() for t in emap._device_tables[0, ids.device]] == ptrs  # what a graph holds
    slots = emap.physical(0, ids)
    assert torch.equal(layout[0][slots], ids.reshape(-1))
    assert sorted(set(emap.physical(0, torch.tensor([[5], [5], [5]])).tolist())) == [0, 3, 7]  # three replicas


# --- two processes: the fixed-shape exchange -------------------------------------------------------

E, H, K = 8, 16, 3


def _expert(e: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x * (e.unsqueeze(1).to(x.dtype) + 1)) + e.unsqueeze(1).to(x.dtype)


def _exchange_worker(rank: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        disp = AllToAllDispatcher(TorchDistributedCommunicator(None), E, H)
        gen = torch.Generator().manual_seed(rank)
        tokens = 6  # the same on both ranks: they replay graphs of one size
        x = torch.randn(tokens, H, generator=gen, dtype=torch.float64)
        top = E // 2 if rank == 1 else E  # rank 1 routes only to rank 0's experts: a full capacity there
        ids = torch.stack([torch.randperm(top, generator=gen)[:K] for _ in range(tokens)])
        w = torch.rand(tokens, K, generator=gen, dtype=torch.float64)
        with disp.graph_shapes():
            recv_x, local, recv_w, handle = disp.dispatch(x, ids, w)
            used = local >= 0
            y = torch.zeros_like(recv_x)
            y[used] = recv_w[used].unsqueeze(1) * _expert(local[used] + disp.local_experts.start, recv_x[used])
            out = disp.combine(y, handle)
        expected = torch.zeros_like(x)
        for k in range(K):
            expected += w[:, k: k + 1] * _expert(ids[:, k], x)
        queue.put((rank, torch.allclose(out, expected, rtol=0, atol=1e-12), recv_x.shape[0], int(used.sum())))
    finally:
        dist.destroy_process_group()


def test_two_ranks_exchange_at_a_fixed_capacity():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = rank_start_context()
    queue = ctx.Queue()
    procs = [ctx.Process(target=_exchange_worker, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert [ok for _, ok, _, _ in results] == [True, True]
    capacity = 6 * min(K, E // 2)
    assert [rows for _, _, rows, _ in results] == [2 * capacity] * 2  # the shapes never follow the routing
    assert results[0][3] > results[1][3]  # rank 0 computed more pairs: rank 1 sent it all of its own


# --- ranks running graphs against one process -----------------------------------------------------

def _outputs(outs):
    return [(o.outputs[0].token_ids, [lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


def _assert_equal(got, expected):
    for (tokens, lps), (want, want_lps) in zip(got, expected):
        assert tokens == want
        assert max((abs(a - b) for a, b in zip(lps, want_lps)), default=0.0) < 1e-10


def _skewed(cfg, hot: int) -> torch.Tensor:
    load = torch.ones((cfg.num_hidden_layers, cfg.n_routed_experts), dtype=torch.long)
    load[:, hot] = 10_000
    return load


def _run_with_graphs(path, ranks: int, redundant: int, prompts, max_tokens, idle_prompt):
    """A run of the step API on ``ranks`` ranks with uncaptured graphs, async scheduling and EPLB: a wave
    too large for the pools, a forced rearrangement in the middle of it, then one request while every
    other rank idles. Checked against one process; returns the ranks' graph counts."""
    kw = dict(model=str(path), dtype="float64", block_size=BLOCK, max_num_batched_tokens=16, num_blocks=9,
              num_window_blocks=4, max_num_seqs=4)
    single = LLM(**kw)
    params = [greedy(m, logprobs=1) for m in max_tokens]
    expected = _outputs(single.generate(prompts + [idle_prompt], params + [greedy(12, logprobs=1)],
                                        use_tqdm=False))
    llm = LLM(**kw, data_parallel_size=ranks, enable_expert_parallel=True, distributed_timeout_s=120,
              async_scheduling=True, enable_eplb=True,
              eplb_config={"num_redundant_experts": redundant, "step_interval": 1 << 30})
    engine = llm.llm_engine
    try:
        engine.collective_rpc(install_uncaptured_graphs, (SIZES,))
        latest = {}
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            engine.add_request(str(i), prompt, p)
        for _ in range(60):  # until every rank replayed a decode graph: the prefills come first
            latest.update({o.request_id: o for o in engine.step()})
            replays = [c.get("replays", 0) for c in engine.collective_rpc(graph_counts)]
            if min(replays) > 0:
                break
        assert engine.has_unfinished_requests() and min(replays) > 0
        storage = engine.collective_rpc(expert_storage)
        forced = engine.rearrange_experts(_skewed(engine.model_config, engine.model_config.n_routed_experts - 1))
        assert forced["moved_slots"] > 0  # weights crossed between ranks
        assert engine.collective_rpc(expert_storage) == storage  # in place: captured graphs would stay valid
        while engine.has_unfinished_requests():
            latest.update({o.request_id: o for o in engine.step()})
        after = [c["replays"] for c in engine.collective_rpc(graph_counts)]
        assert all(a > b for a, b in zip(after, replays))  # graphs replayed after the rearrangement
        counters = engine.rank_counters()
        assert sum(c["preemptions"] for c in counters) > 0
        # one request: every other rank idles through its steps
        before = engine.collective_rpc(graph_counts)
        engine.expert_load()  # the load counted so far, taken
        engine.add_request("idle", idle_prompt, greedy(12, logprobs=1))
        while engine.has_unfinished_requests():
            latest.update({o.request_id: o for o in engine.step()})
        counts = engine.collective_rpc(graph_counts)
        cfg = engine.model_config
        computed = len(idle_prompt) + 12 - 1  # the padding rows of the graphs are not counted
        assert int(engine.expert_load().sum()) == computed * cfg.num_experts_per_tok * cfg.num_hidden_layers
    finally:
        engine.shutdown()
    _assert_equal(_outputs([latest[str(i)] for i in range(len(prompts))] + [latest["idle"]]), expected)
    idle = [c.get("placeholder replays", 0) - b.get("placeholder replays", 0) for c, b in zip(counts, before)]
    assert sorted(idle)[0] == 0 and sorted(idle)[-1] >= 10  # the idle rank(s) replayed the busy one's graphs
    assert all(c["size 4"] > 0 and c["size 1"] > 0 for c in counts)
    return counts


LENGTHS = [5, 30, 12, 40, 3, 22, 17, 9]
MAX_TOKENS = [8, 6, 12, 5, 9, 7, 10, 4]


def test_two_ranks_with_graphs_equal_one_process(tiny_path):
    prompts = [make_prompt(n, seed=i) for i, n in enumerate(LENGTHS)]
    _run_with_graphs(tiny_path("tiny"), 2, 2, prompts, MAX_TOKENS, make_prompt(20, seed=99))


@pytest.mark.slow
def test_four_ranks_with_graphs_equal_one_process(tmp_path):
    path = build_tiny_checkpoint(tmp_path / "tiny8", "tiny", n_routed_experts=8)
    prompts = [make_prompt(n, seed=i) for i, n in enumerate(LENGTHS * 2)]
    _run_with_graphs(path, 4, 4, prompts, MAX_TOKENS * 2, make_prompt(20, seed=99))


@pytest.mark.slow
def test_mtp_speculation_on_ranks_with_graphs_equals_one_process():
    """MTP (k=2) on two expert-parallel ranks with verification graphs and async scheduling: the greedy
    tokens of one process without speculation (the trained tiny V4 and held-out text: drafts are
    accepted and rejected), a prompt prefilled in chunks, a rank idle at the end (placeholder steps
    replay the verification graph, then run the drafter's k steps)."""
    kw = dict(model=str(v4_model_path()), dtype="float64", max_num_batched_tokens=64)
    single = LLM(**kw)
    ids = single.llm_engine.encode(open("data/heldout_slice.txt").read())
    prompts = [ids[:150]] + [ids[i * 120: i * 120 + 10 + 13 * i] for i in range(1, 5)]
    params = [greedy(m) for m in (20, 4, 14, 9, 26)]
    expected = [o.outputs[0].token_ids for o in single.generate(prompts, params, use_tqdm=False)]
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    llm = LLM(**kw, data_parallel_size=2, enable_expert_parallel=True, speculative_config=spec,
              distributed_timeout_s=120, async_scheduling=True)
    engine = llm.llm_engine
    try:
        engine.collective_rpc(install_uncaptured_graphs, (SIZES, (1, 3)))
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        counts = engine.collective_rpc(graph_counts)
        stats = engine.spec_decode_stats()
    finally:
        engine.shutdown()
    assert got == expected
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"], stats
    assert all(c["replays"] > 0 for c in counts)
    assert sum(c.get("placeholder replays", 0) for c in counts) > 0, counts


class _BoundedDispatcher:
    """A dispatcher whose fixed buffers hold ``max_graph_tokens`` tokens a rank (DeepEP's low-latency mode)."""

    graph_safe = True
    max_graph_tokens = 12


@pytest.mark.parametrize("spec", [None, {"method": "mtp", "num_speculative_tokens": 2}], ids=["plain", "mtp2"])
def test_decode_graphs_are_captured_within_the_dispatchers_capacity(spec, monkeypatch):
    """No graph is asked for more tokens a rank than the dispatcher's buffers hold: batch sizes stop at
    max_graph_tokens / the longest query (12 tokens: 12 sequences plain, 4 verifying 1 + 2)."""
    from types import SimpleNamespace

    from deepinfer_core.platform import Platform
    from deepinfer_core.worker.worker import make_model_runner

    llm = LLM(str(v4_model_path()), backend="cpu_ref", dtype="float32", max_num_seqs=64, max_model_len=128,
              **({"speculative_config": spec} if spec else {}))
    worker = llm.llm_engine._worker
    worker.model.ep = _BoundedDispatcher()
    monkeypatch.setattr(worker.model.ops, "syncs_host", lambda ops: [])  # as a device backend's ops
    asked: dict = {}
    backend = SimpleNamespace(hook=SimpleNamespace(deepinfer_graph_runner=lambda **kw: asked.update(kw)))
    platform = Platform(torch.device("cpu"))
    platform.supports_graphs = True
    make_model_runner(worker.model, worker.cache, llm.llm_engine.sampler, worker.args, worker.scheduler_config,
                      backend, platform)
    assert max(asked["capture_sizes"]) == (12 if spec is None else 4)
    assert max(asked["capture_sizes"]) * max(asked["query_lens"]) <= _BoundedDispatcher.max_graph_tokens

"""DeepSeek-V4.1's Engram tables under two expert-parallel ranks (gloo, attention data parallel): every
placement, and rows sharded over the ranks with the lookup collective, give the same tokens and bit-identical
logprobs (the top 5 of every position) as the tables on the device; each rank's tables are where the
placement says: ``file`` the checkpoint file's mapping on both ranks (one copy per node: the page cache),
``host`` one ``/dev/shm`` mapping both ranks share (unlinked once both mapped), ``device`` private memory.
The requests end at different steps, so a rank left without work runs placeholder steps, in which the
sharded lookup's collective runs too (else the other rank would wait in it)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import engine_fixtures
import pytest
import torch
import torch.distributed as dist
from engine_fixtures import greedy, make_prompt
from host_reads import HostReads

from deepinfer_core.entrypoints.llm import LLM
from deepinfer_core.models.deepseek_v41.engram_placement import ShardedEngramLookup
from deepinfer_core.ops import native
from deepinfer_core.plugins import build_op_table
from deepinfer_core.testing.uncaptured_graphs import graph_counts, install_uncaptured_graphs

tiny_path = engine_fixtures.tiny_path

LENGTHS = [1, 9, 17, 30]
MAX_TOKENS = [6, 9, 4, 7]


def _run(llm: LLM) -> list[tuple[list[int], list]]:
    prompts = [make_prompt(n, seed=i) for i, n in enumerate(LENGTHS)]
    params = [greedy(m, logprobs=5) for m in MAX_TOKENS]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [dict(pos) for pos in o.outputs[0].logprobs])
            for o in outs]


@pytest.mark.slow
def test_placements_are_bit_identical_under_two_expert_parallel_ranks(tiny_path):
    kw = dict(model=str(tiny_path("v41")), dtype="float32", block_size=engine_fixtures.BLOCK_SIZE,
              max_num_batched_tokens=24, max_num_seqs=4, data_parallel_size=2, enable_expert_parallel=True,
              distributed_timeout_s=120)
    runs, tables = {}, {}
    for name, extra in {"device": {"engram_placement": "device"}, "host": {"engram_placement": "host"},
                        "file": {"engram_placement": "file"},
                        "device_sharded": {"engram_placement": "device", "engram_shard": True}}.items():
        llm = LLM(**kw, **extra)
        try:
            runs[name] = _run(llm)
            tables[name] = [info["engram_tables"] for info in llm.llm_engine.rank_info]
        finally:
            llm.llm_engine.shutdown()
    for name in ("host", "file", "device_sharded"):
        assert runs[name] == runs["device"], name
    checkpoint = str((tiny_path("v41") / "model.safetensors").resolve())
    assert all(set(rank.values()) == {checkpoint} for rank in tables["file"])
    # each table's weight and scale one shared mapping, unlinked once both ranks mapped it
    host = [set(rank.values()) for rank in tables["host"]]
    assert all(len(where) == len(tables["host"][0]) == 4 for where in host), host
    assert all(w.startswith("/dev/shm/deepinfer-engram-") and w.endswith("(deleted)") for w in host[0]), host
    assert host[0] == host[1]  # the same mappings on both ranks: one copy per node
    assert all(set(rank.values()) == {"anonymous"} for rank in tables["device"] + tables["device_sharded"])


# slow: the fixed-shape lookup's host reads and values are checked below in one process, and two ranks
# replaying graphs in lock-step in test_ep_graphs
@pytest.mark.slow
def test_sharded_tables_under_two_ranks_with_graphs_equal_one_process(tiny_path):
    """Rows sharded over two ranks, decode through the padded graph layouts (uncaptured: each replay runs
    the static batch eagerly), the ranks at different counts of work and one idle at the end: the greedy
    tokens and their logprobs of one process with the tables whole; the ranks replayed graphs of several
    sizes, placeholder replays included (the lookup collective runs in them at the agreed size)."""
    kw = dict(model=str(tiny_path("v41")), dtype="float64", block_size=engine_fixtures.BLOCK_SIZE,
              max_num_batched_tokens=24, max_num_seqs=4)
    prompts = [make_prompt(n, seed=i) for i, n in enumerate(LENGTHS)]
    params = [greedy(m, logprobs=1) for m in MAX_TOKENS]

    def run(llm):
        return [(o.outputs[0].token_ids, [lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                for o in llm.generate(prompts, params, use_tqdm=False)]

    expected = run(LLM(**kw))
    llm = LLM(**kw, data_parallel_size=2, enable_expert_parallel=True, engram_shard=True,
              distributed_timeout_s=120)
    engine = llm.llm_engine
    try:
        engine.collective_rpc(install_uncaptured_graphs, ([1, 2, 4],))
        got = run(llm)
        counts = engine.collective_rpc(graph_counts)
    finally:
        engine.shutdown()
    for (tokens, lps), (want, want_lps) in zip(got, expected):
        assert tokens == want
        assert max(abs(a - b) for a, b in zip(lps, want_lps)) < 1e-10
    assert all(c["replays"] > 0 for c in counts), counts
    assert sum(c.get("placeholder replays", 0) for c in counts) > 0, counts


def _lookup_in_one_rank(store, fixed: bool):
    """One gloo rank's sharded lookup of a table's 20 rows for 5 tokens: (its values, arrays lifted from host
    data and device values read on the host while it ran)."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        gen = torch.Generator().manual_seed(0)
        weight = torch.randint(0, 0x7F, (20, 64), dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn)
        scale = torch.full((20, 2), 1.0)
        engram = SimpleNamespace(table=SimpleNamespace(weight=weight, scale=scale))
        lookup = ShardedEngramLookup(build_op_table("cpu_ref"), None, {id(weight): 0})
        rows = torch.randint(0, 20, (5, 3), generator=gen)
        with lookup.graph_shapes() if fixed else contextlib.nullcontext(), HostReads() as mode:
            out = lookup(engram, rows)
        return out, mode.lifted, native.engram_lookup(rows, weight, scale, 0)
    finally:
        dist.destroy_process_group()


def test_the_sharded_lookup_reads_nothing_back_inside_graph_shapes(tmp_path):
    """Eagerly the lookup gathers the ranks' token counts and reads them on the host (a capture would fail);
    inside ``graph_shapes`` (every rank at the same padded count) it reads nothing back and looks up the
    same values as the op over the whole table."""
    eager, eager_reads, whole = _lookup_in_one_rank(tmp_path / "eager_store", fixed=False)
    fixed, fixed_reads, _ = _lookup_in_one_rank(tmp_path / "fixed_store", fixed=True)
    assert eager_reads > 0 and fixed_reads == 0
    assert torch.equal(eager, whole) and torch.equal(fixed, whole)

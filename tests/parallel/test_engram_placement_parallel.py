"""DeepSeek-V4.1's Engram tables under two expert-parallel ranks (gloo, attention data parallel): every
placement, and rows sharded over the ranks with the lookup collective, give the same tokens and bit-identical
logprobs (the top 5 of every position) as the tables on the device; each rank's tables are where the
placement says: ``file`` the checkpoint file's mapping on both ranks (one copy per node: the page cache),
``host`` one ``/dev/shm`` mapping both ranks share (unlinked once both mapped), ``device`` private memory.
The requests end at different steps, so a rank left without work runs placeholder steps, in which the
sharded lookup's collective runs too (else the other rank would wait in it)."""

from __future__ import annotations

import engine_fixtures
import pytest
from engine_fixtures import greedy, make_prompt

from deepinfer_core.entrypoints.llm import LLM

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

"""The decode path of CUDA graphs, checked on the CPU: steps padded to a bucket size through the static
input buffers (``CUDAGraphRunner(capture=False)`` runs the padded batch eagerly, exactly what a replay
computes) give the tokens of transformers' argmax, while sequences cross window, compression-rate and
block boundaries during decode and padding rows write only to the trash."""

from __future__ import annotations

import engine_fixtures
import pytest
import torch
from engine_fixtures import greedy, hf_argmax, make_prompt, run_tokens

from deepinfer_core.model.metadata import GraphPadding, SeqSpan, build_forward_batch
from deepinfer_core.worker.graph_runner import GraphRunner, capture_sizes

make_llm = engine_fixtures.make_llm
one_torch_thread = engine_fixtures.one_torch_thread
tiny_path = engine_fixtures.tiny_path

LENGTHS = [1, 3, 7, 8, 15, 16, 17, 30, 33, 47]


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(100) == [1, 2, 4, 8, 16, 32, 64, 96, 100]
    assert capture_sizes(256)[-3:] == [192, 224, 256]
    assert capture_sizes(0) == []


def with_padded_graphs(llm, sizes: list[int]):
    engine = llm.llm_engine
    engine.runner.graph_runner = GraphRunner(
        engine.model, engine.cache, sizes, engine.scheduler_config.max_model_len, engine.args.block_size,
        capture=False,
    )
    return engine.runner.graph_runner


@pytest.mark.parametrize("config", ["tiny", "tiny_hc4", "tiny_hc1"])
def test_padded_decode_matches_transformers(make_llm, tiny_path, config):
    path = tiny_path(config)
    prompts = [make_prompt(n, seed=i) for i, n in enumerate(LENGTHS)]
    llm = make_llm(path, dtype="float64", max_num_seqs=16)
    runner = with_padded_graphs(llm, [1, 2, 4, 8, 16])
    replays = []
    original = runner.replay
    runner.replay = lambda batch: replays.append(batch.padded_to) or original(batch)
    outputs = run_tokens(llm, prompts, [greedy(max_tokens=4 + 2 * i) for i in range(len(prompts))])
    assert set(replays) >= {16, 8, 4}, replays  # batches shrink as requests finish
    for prompt, tokens in zip(prompts, outputs):
        assert tokens == hf_argmax(path, prompt, tokens)


# per query length: prompt lengths whose step of q tokens ends a block (16), closes one or two rate-4
# windows (one at a block start), starts right after a window or block end, or closes nothing
PADDED_PROMPTS = {1: [15, 14, 27], 2: [15, 14, 31, 16], 3: [14, 13, 25, 29], 4: [13, 16, 24, 30],
                  5: [12, 16, 23, 32], 8: [9, 16, 21]}


def with_blocks_for(spans: list[SeqSpan], q: int, block_size: int, num_blocks: int, num_window_blocks: int):
    """The spans with ``q`` new tokens each and unused physical blocks appended to their tables, so that
    every position of the step has its blocks (the engine allocates them before it schedules a step)."""
    used = {b for s in spans for b in s.block_table}
    used_window = {b for s in spans for b in s.window_block_table}
    free = iter(b for b in range(num_blocks) if b not in used)
    free_window = iter(b for b in range(num_window_blocks) if b not in used_window)
    out = []
    for s in spans:
        need = (s.context_len + q - 1) // block_size + 1
        table = list(s.block_table) + [next(free) for _ in range(need - len(s.block_table))]
        window = list(s.window_block_table) + [next(free_window) for _ in range(need - len(s.window_block_table))]
        out.append(SeqSpan(s.context_len, q, table, window, s.state_slot, s.write_from))
    return out


@pytest.mark.parametrize("q", sorted(PADDED_PROMPTS))
def test_padded_equals_unpadded_logits(make_llm, tiny_path, q):
    """One step of ``q`` new tokens per sequence (a decode, or a verification of q - 1 drafts) laid out
    for a graph of 8 gives the unpadded step's logits, streams and cache writes; the padding rows write
    only to the trash (steps close compression windows and cross block ends)."""
    llm = make_llm(tiny_path("tiny"), dtype="float64", max_num_seqs=8, enable_prefix_caching=False)
    engine = llm.llm_engine
    prompts = PADDED_PROMPTS[q]
    for i, n in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": make_prompt(n, seed=i)}, greedy(max_tokens=4))
    engine.step()  # the prompts in one chunk
    seqs = list(engine.scheduler.running)
    model, cache = engine.model, engine.cache
    spans = with_blocks_for([SeqSpan(s.num_computed_tokens, 1, s.block_table, s.window_block_table, s.state_slot,
                                     s.write_from) for s in seqs],
                            q, engine.args.block_size, cache.num_blocks, cache.num_window_blocks)
    ids = [t for s in seqs for t in [s.token_ids[s.num_computed_tokens]] + make_prompt(q - 1, seed=s.seq_id)]
    specs, bs, window = model.compressor_specs(), engine.args.block_size, model.cfg.sliding_window
    tensors = [(t, bs) for t in cache.window_kv]
    for layer, spec in enumerate(cache.specs):
        for branch, pool, state, bound in ((spec.compressor, cache.comp_kv, cache.comp_state, cache.comp_boundary),
                                           (spec.indexer, cache.index_keys, cache.index_state, cache.index_boundary)):
            if branch is not None:
                tensors += [(pool[layer], bs // branch.rate)] + [(r, branch.rows) for r in state[layer]]
                tensors += [(r, branch.rate) for r in bound.get(layer, ())]
    before = [t.clone() for t, _ in tensors]
    rows = list(range(len(ids)))
    plain, plain_streams = model.forward(build_forward_batch(ids, spans, specs, bs, window, rows), cache)
    after_plain = [t.clone() for t, _ in tensors]
    for (t, _), b in zip(tensors, before):
        t.copy_(b)
    pad = GraphPadding(8, {rate: 64 for rate in {s.rate for s in specs}}, query_len=q)
    padded, streams = model.forward(build_forward_batch(ids, spans, specs, bs, window, pad=pad), cache)
    torch.testing.assert_close(padded[: len(ids)], plain, rtol=0, atol=1e-12)
    torch.testing.assert_close(streams[: len(ids)], plain_streams, rtol=0, atol=1e-12)
    changed = 0
    for (t, trash), a, b in zip(tensors, after_plain, before):
        torch.testing.assert_close(t[:-trash], a[:-trash], rtol=0, atol=1e-12)
        changed += int(not torch.equal(a, b))
    assert changed > len(cache.window_kv)  # the step wrote compressed entries, not just window rows
    for i in range(len(prompts)):
        engine.abort_request(str(i))


def test_padded_batch_packs_from_one_buffer():
    """A padded batch's tensors are views of one buffer laid out as ``packed`` lays them out: packing is
    that buffer, equal to concatenating the tensors; a copy with other tensors, or one that derives its
    window rows later, packs its own tensors again."""
    from deepinfer_core.model.cache import CompressorSpec

    specs = {CompressorSpec(4, 8, True), CompressorSpec(16, 8, False)}
    spans = [SeqSpan(37, 2, [3, 5, 9], [1, 4, 6], 0, 0), SeqSpan(14, 2, [2], [0], 1, 0)]
    pad = GraphPadding(4, {4: 16, 16: 4}, 64, query_len=2)
    host = build_forward_batch([7, 8, 9, 10], spans, specs, 16, 8, pad=pad)
    flat = torch.cat([t.reshape(-1) for t in host.tensors().values()])
    assert host.storage is not None and torch.equal(host.packed(), flat)
    for t in host.tensors().values():
        assert t.untyped_storage().data_ptr() == host.storage.untyped_storage().data_ptr()
    out = torch.empty_like(flat)
    assert host.packed(out=out) is out and torch.equal(out, flat)
    moved = host.replace_tensors({"input_ids": torch.tensor([1, 2, 3, 4, 0, 0, 0, 0])})
    assert moved.storage is None and moved.packed()[:4].tolist() == [1, 2, 3, 4]
    again = host.with_storage(flat.clone())
    assert torch.equal(again.packed(), flat) and again.storage is not None
    eager = build_forward_batch([7, 8, 9, 10], spans, specs, 16, 8)
    eager = eager.with_storage(eager.packed())
    width = eager.packed().numel()
    eager.window_rows()
    assert eager.storage is None and eager.packed().numel() > width

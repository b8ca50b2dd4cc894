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


def test_padded_equals_unpadded_logits(make_llm, tiny_path):
    """One decode step laid out for a graph of 8 gives the unpadded step's logits and cache writes; the
    padding rows write only to the trash (steps close compression windows and cross a block end)."""
    llm = make_llm(tiny_path("tiny"), dtype="float64", max_num_seqs=4, enable_prefix_caching=False)
    engine = llm.llm_engine
    for i, n in enumerate([15, 14, 27]):  # decode positions 15 (block end), 14, 27 (closes a rate-4 window)
        engine.add_request(str(i), {"prompt_token_ids": make_prompt(n, seed=i)}, greedy(max_tokens=4))
    engine.step()  # the prompts in one chunk; the decode token's blocks are already there
    seqs = list(engine.scheduler.running)
    spans = [SeqSpan(s.num_computed_tokens, 1, s.block_table, s.window_block_table, s.state_slot, s.write_from)
             for s in seqs]
    ids = [s.token_ids[s.num_computed_tokens] for s in seqs]
    model, cache = engine.model, engine.cache
    specs, bs, window = model.compressor_specs(), engine.args.block_size, model.cfg.sliding_window
    tensors = [(t, bs) for t in cache.window_kv]
    for layer, spec in enumerate(cache.specs):
        for branch, pool, state, bound in ((spec.compressor, cache.comp_kv, cache.comp_state, cache.comp_boundary),
                                           (spec.indexer, cache.index_keys, cache.index_state, cache.index_boundary)):
            if branch is not None:
                tensors += [(pool[layer], bs // branch.rate)] + [(r, branch.rows) for r in state[layer]]
                tensors += [(r, branch.rate) for r in bound.get(layer, ())]
    before = [t.clone() for t, _ in tensors]
    plain, _ = model.forward(build_forward_batch(ids, spans, specs, bs, window), cache)
    after_plain = [t.clone() for t, _ in tensors]
    for (t, _), b in zip(tensors, before):
        t.copy_(b)
    pad = GraphPadding(8, {rate: 64 for rate in {s.rate for s in specs}})
    padded, _ = model.forward(build_forward_batch(ids, spans, specs, bs, window, pad=pad), cache)
    torch.testing.assert_close(padded[: len(seqs)], plain, rtol=0, atol=1e-12)
    changed = 0
    for (t, trash), a, b in zip(tensors, after_plain, before):
        torch.testing.assert_close(t[:-trash], a[:-trash], rtol=0, atol=1e-12)
        changed += int(not torch.equal(a, b))
    assert changed > len(cache.window_kv)  # the step wrote compressed entries, not just window rows
    for i in range(3):
        engine.abort_request(str(i))

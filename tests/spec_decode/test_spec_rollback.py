"""Rollback of rejected drafts: after a verification, the main model's cache is bit for bit what plain
decoding of the accepted tokens leaves (window KV, compressed entries, indexer keys, compressor rings
with the CSA overlap, boundary records), also when a window, compression or block boundary falls inside
the drafts and the rejection lands just before or just after it.

Both engines are batch-invariant (a row's arithmetic does not depend on what else the step computes),
so the comparison is exact; only the pools' trash rows are left out.
"""

from __future__ import annotations

import engine_fixtures
import pytest
import torch
from engine_fixtures import greedy, make_prompt
from spec_fixtures import oracle_drafts, spec
from test_spec_decode_graphs import with_spec_graphs

make_llm = engine_fixtures.make_llm
one_torch_thread = engine_fixtures.one_torch_thread
tiny_path = engine_fixtures.tiny_path

K = 3
MAX_TOKENS = 12


def main_cache(engine) -> dict[str, torch.Tensor]:
    """Every main-layer cache tensor without its trash rows (copies)."""
    c, cfg, bs = engine.cache, engine.model_config, engine.cache.block_size
    out = {}
    for layer in range(cfg.num_hidden_layers):
        out[f"window.{layer}"] = c.window_kv[layer][: c.num_window_blocks * bs]
        for name, pools, states, bounds, branch in (
            ("comp", c.comp_kv, c.comp_state, c.comp_boundary, c.specs[layer].compressor),
            ("index", c.index_keys, c.index_state, c.index_boundary, c.specs[layer].indexer),
        ):
            if branch is None:
                continue
            out[f"{name}.{layer}"] = pools[layer][: c.num_blocks * bs // branch.rate]
            for i, ring in enumerate(states[layer]):
                out[f"{name}_ring{i}.{layer}"] = ring[: c.num_state_slots * branch.rows]
            for i, record in enumerate(bounds.get(layer, ())):
                out[f"{name}_boundary{i}.{layer}"] = record[: c.num_blocks * branch.rate]
    return {k: v.clone() for k, v in out.items()}


def run_steps(engine, prompt, steps):
    engine.add_request("r", {"prompt_token_ids": prompt}, greedy(MAX_TOKENS))
    for _ in range(steps):
        engine.step()
    (seq,) = engine.scheduler.running
    return seq


@pytest.mark.parametrize("config", ["tiny", pytest.param("tiny_hc1", marks=pytest.mark.slow)])  # hc: no rows of its own
# 13 and 15 (slow) shift the rejection by one; 12, 14, 16 already land it on both sides of position 15/16
@pytest.mark.parametrize("prompt_len", [12, pytest.param(13, marks=pytest.mark.slow), 14,
                                        pytest.param(15, marks=pytest.mark.slow), 16])
@pytest.mark.parametrize("accepted", range(K + 1))
@pytest.mark.parametrize("verify", ["eager", "graph"])
def test_rejected_drafts_leave_no_trace(config, prompt_len, accepted, verify, tiny_path, make_llm):
    """Prompt lengths 12..16 put the verified positions [P, P+3] across position 15/16: the end of
    compression windows (rates 4 and 8; 2 and 4 for tiny_hc1) and of the first 16-token block; with
    ``accepted`` drafts kept the rejection lands at every offset around it. ``graph``: the verification
    runs the padded graph layout, whose prologue saves every token's rows (the undo log of CUDA graphs)."""
    path = tiny_path(config)
    prompt = make_prompt(prompt_len, seed=prompt_len)
    ref_llm = make_llm(path, dtype="float64", batch_invariant=True)
    ref = ref_llm.generate([{"prompt_token_ids": prompt}], greedy(MAX_TOKENS), use_tqdm=False)[0].outputs[0].token_ids
    plain_engine = make_llm(path, dtype="float64", batch_invariant=True).llm_engine
    plain_seq = run_steps(plain_engine, prompt, 1 + accepted + 1)  # prefill, then one decode per kept token

    llm = make_llm(path, dtype="float64", batch_invariant=True, **spec(K))
    oracle_drafts(llm, {tuple(prompt): ref}, lambda seq, m, j: j >= accepted)
    engine = llm.llm_engine
    steps = with_spec_graphs(llm, K, [1, 2]) if verify == "graph" else None
    seq = run_steps(engine, prompt, 2)  # prefill (draws drafts), then one verification
    assert steps is None or steps == [(1, 1 + K)]
    assert engine.spec_decode_stats()["num_accepted_tokens"] == accepted
    assert seq.output_token_ids == plain_seq.output_token_ids == ref[: accepted + 2]
    assert seq.num_computed_tokens == plain_seq.num_computed_tokens == prompt_len + accepted + 1

    bs = engine.block_manager.block_size
    held = -(-seq.num_computed_tokens // bs)
    assert seq.block_table[:held] == plain_seq.block_table[:held]
    assert seq.window_block_table == plain_seq.window_block_table
    mine, theirs = main_cache(engine), main_cache(plain_engine)
    differ = [name for name in mine if not torch.equal(mine[name], theirs[name])]
    assert not differ, f"cache tensors differ from plain decoding after {accepted} accepted drafts: {differ}"
    for e in (engine, plain_engine):
        e.abort_request("r")


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    from deepinfer_core.testing.published_checkpoint import build_published_checkpoint

    return build_published_checkpoint(tmp_path_factory.mktemp("rollback") / "tiny", "tiny", seed=0)


@pytest.mark.parametrize("prompt_len", [13, 15])
@pytest.mark.parametrize("accepted", range(K + 1))
def test_rejected_drafts_leave_no_trace_in_fp8_entries(published, prompt_len, accepted, make_llm):
    """numerics="deepseek": window and compressed pools hold uint8 FP8 entries; rows are saved and put
    back as bytes."""
    kw = dict(dtype="float64", batch_invariant=True, numerics="deepseek")
    prompt = make_prompt(prompt_len, seed=prompt_len)
    ref = make_llm(published, **kw).generate([{"prompt_token_ids": prompt}], greedy(MAX_TOKENS),
                                             use_tqdm=False)[0].outputs[0].token_ids
    plain_engine = make_llm(published, **kw).llm_engine
    plain_seq = run_steps(plain_engine, prompt, 1 + accepted + 1)
    llm = make_llm(published, **kw, **spec(K))
    oracle_drafts(llm, {tuple(prompt): ref}, lambda seq, m, j: j >= accepted)
    engine = llm.llm_engine
    assert engine.cache.window_kv[0].dtype == torch.uint8 and engine.cache.kv_spec.layout == "fp8_ds"
    seq = run_steps(engine, prompt, 2)
    assert engine.spec_decode_stats()["num_accepted_tokens"] == accepted
    assert seq.output_token_ids == plain_seq.output_token_ids == ref[: accepted + 2]
    mine, theirs = main_cache(engine), main_cache(plain_engine)
    differ = [name for name in mine if not torch.equal(mine[name], theirs[name])]
    assert not differ, f"cache tensors differ from plain decoding after {accepted} accepted drafts: {differ}"
    for e in (engine, plain_engine):
        e.abort_request("r")

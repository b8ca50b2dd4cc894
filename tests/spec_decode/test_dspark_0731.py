"""DeepSeek-V4-Flash-0731: the V4 architecture with DSpark stages in place of the MTP layer.

The tiny 0731 (``testing.tiny_0731``: the tiny V4 backbone, four mHC streams, three DSpark stages in the
published layout) loads, its drafter reads the hc-mean of the target layers' outputs, and greedy decoding with
``speculative_config={"method": "dspark"}`` equals decoding without, token for token (float64, cpu_ref), with
random drafts and with oracle drafts that place acceptances and rejections at every offset (rollback of the
windows, CSA/HCA entries and compressor rings the rejected tokens wrote). Invalid configs and methods are
clear errors; plain V4 checkpoints keep their MTP drafter.
"""

from __future__ import annotations

import json
import shutil

import engine_fixtures
import pytest
import test_spec_async
import torch
from engine_fixtures import greedy, make_prompt, run_tokens
from spec_fixtures import oracle_drafts
from test_dspark_decode import dspark
from test_dspark_graphs import SIZES, with_dspark_graphs
from test_spec_async import worker_oracle

from deepinfer_core.config import ModelConfig
from deepinfer_core.model.errors import UnsupportedModelError
from deepinfer_core.models import load_model
from deepinfer_core.models.deepseek_v4.dspark import DeepseekV4DSpark
from deepinfer_core.models.deepseek_v4.mtp import DeepseekV4MTP
from deepinfer_core.spec_decode.dspark_proposer import DSparkProposer
from deepinfer_core.testing.tiny_0731 import build_tiny_0731

make_llm = engine_fixtures.make_llm
make_async = test_spec_async.make_async
one_torch_thread = engine_fixtures.one_torch_thread
tiny_path = engine_fixtures.tiny_path

LENGTHS = [1, 3, 8, 9, 17, 25]
PROMPTS = [make_prompt(n, seed=70 + i) for i, n in enumerate(LENGTHS)]
MAX_TOKENS = 10
_REF: dict = {}


@pytest.fixture(scope="session")
def tiny_0731(tmp_path_factory) -> object:
    return build_tiny_0731(tmp_path_factory.mktemp("tiny_0731") / "m")


def reference(make_llm, path) -> dict:
    if str(path) not in _REF:
        llm = make_llm(path, dtype="float64")
        _REF[str(path)] = dict(zip(map(tuple, PROMPTS), run_tokens(llm, PROMPTS, greedy(MAX_TOKENS + 4))))
    return _REF[str(path)]


def expected(ref: dict) -> list[list[int]]:
    return [ref[tuple(p)][:MAX_TOKENS] for p in PROMPTS]


# --- config and loading ------------------------------------------------------------------------------


def test_config_declares_the_stages(tiny_0731):
    cfg = ModelConfig.from_pretrained(tiny_0731)
    raw = json.loads((tiny_0731 / "config.json").read_text())
    assert raw["num_nextn_predict_layers"] == 1 and raw["n_mtp_layers"] == 3
    assert len(raw["compress_ratios"]) == cfg.num_hidden_layers + 3
    assert cfg.num_nextn_predict_layers == 3 and cfg.dspark_block_size == 3
    assert cfg.dspark_target_layer_ids == [1, 2, 3] and cfg.drafter_moe_config() == (cfg.n_routed_experts, 2)
    assert len(cfg.architecture.cache_layout(cfg).layers) == cfg.num_hidden_layers + 3


def test_tiny_0731_loads_its_stages(tiny_0731):
    model = load_model(tiny_0731, dtype=torch.float64)
    assert isinstance(model.drafter, DeepseekV4DSpark) and model.dspark is model.drafter
    assert not model.has_mtp and len(model.drafter.weights) == 3
    assert model.drafter.weights[0].main_proj.weight.shape == (64, 3 * 64)
    assert all(s.block.moe.experts.w13.weight.shape[0] == 6 for s in model.drafter.weights)
    names = dict(model.named_parameters())
    assert "mtp.2.confidence_head.proj.weight" in names and "mtp.0.e_proj.weight" not in names


def test_forward_returns_the_target_layers_outputs(tiny_0731):
    """What the drafter reads: the stream mean of layers 1, 2, 3's outputs, concatenated."""
    from deepinfer_core.model.cache import ModelCache
    from deepinfer_core.model.metadata import SeqSpan, build_forward_batch

    model = load_model(tiny_0731, dtype=torch.float64)
    cfg = model.cfg
    cache = ModelCache(cfg, 4, 4, 2, 16, torch.float64, "cpu")
    ids = make_prompt(6, seed=1)
    batch = build_forward_batch(ids, [SeqSpan(0, 6, [0], [0], 0)], model.compressor_specs(), 16,
                                cfg.sliding_window, [5])
    seen = []
    block = model.block

    def spy(*args):
        out = block(*args)
        seen.append(out.mean(dim=1))
        return out

    model.block = spy
    _, hidden = model.forward(batch, cache)
    assert hidden.shape == (6, 3 * cfg.hidden_size)
    torch.testing.assert_close(hidden, torch.cat(seen[1:4], dim=-1), rtol=0, atol=0)


def test_checkpoint_without_stages_has_no_drafter(tmp_path):
    """Without the stages the checkpoint loads as a target without a drafter."""
    path = build_tiny_0731(tmp_path / "m", with_drafter=False)
    model = load_model(path, dtype=torch.float64)
    assert model.drafter is None


# --- greedy equality ---------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 3])
def test_dspark_greedy_equal(k, tiny_0731, make_llm):
    ref = reference(make_llm, tiny_0731)
    llm = make_llm(tiny_0731, dtype="float64", **dspark(k))
    assert isinstance(llm.llm_engine.runner.proposer, DSparkProposer)
    assert run_tokens(llm, PROMPTS, greedy(MAX_TOKENS)) == expected(ref)
    stats = llm.llm_engine.spec_decode_stats()
    assert stats["num_draft_tokens"] > 0 and len(stats["verified_per_position"]) == k


def test_dspark_greedy_equal_over_a_dense_cache(tiny_0731, make_llm):
    """Under transformers numerics the window pools hold plain values (not DeepSeek's FP8 entries)."""
    ref = make_llm(tiny_0731, dtype="float64", numerics="transformers")
    want = run_tokens(ref, PROMPTS, greedy(MAX_TOKENS))
    llm = make_llm(tiny_0731, dtype="float64", numerics="transformers", **dspark(2))
    assert not llm.llm_engine.cache.kv_spec.is_fp8
    assert run_tokens(llm, PROMPTS, greedy(MAX_TOKENS)) == want
    assert llm.llm_engine.spec_decode_stats()["num_draft_tokens"] > 0


def mixed(seq, m, j):
    """A deterministic mix of rejection points: every accepted length 0..k occurs."""
    return (seq.seq_id * 7 + m * 3 + j * 5) % 4 == 0


def test_oracle_drafts_greedy_equal(tiny_0731, make_llm):
    """Accepted and rejected drafts at every offset: the caches the rejected tokens wrote are put back."""
    ref = reference(make_llm, tiny_0731)
    llm = make_llm(tiny_0731, dtype="float64", max_num_batched_tokens=5, max_num_seqs=3, **dspark(3))
    oracle_drafts(llm, ref, mixed)
    assert run_tokens(llm, PROMPTS, greedy(MAX_TOKENS)) == expected(ref)
    stats = llm.llm_engine.spec_decode_stats()
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]


def test_confidence_scheduling_stays_greedy_equal(tiny_0731, make_llm):
    ref = reference(make_llm, tiny_0731)
    llm = make_llm(tiny_0731, dtype="float64", **dspark(3, "confidence"))
    assert run_tokens(llm, PROMPTS, greedy(MAX_TOKENS)) == expected(ref)


@pytest.mark.parametrize("k", [1, 3])
def test_graph_drafting_greedy_equal(k, tiny_0731, make_llm, make_async):
    """Async scheduling, verification and drafting through ``DSparkGraphs`` (``capture=False``: what a replay
    computes), an oracle placing rejections at every offset: the output is the one without speculation."""
    ref = reference(make_llm, tiny_0731)
    llm = make_async(tiny_0731, dtype="float64", max_num_seqs=8, **dspark(k))
    steps, sizes_run = with_dspark_graphs(llm, k, SIZES)
    worker_oracle(llm, ref, mixed)
    assert run_tokens(llm, PROMPTS, greedy(MAX_TOKENS)) == expected(ref)
    assert [q for _, q in steps].count(1 + k) >= 2 and len(sizes_run) >= 2, (steps, sizes_run)
    assert llm.llm_engine.spec_decode_stats()["num_accepted_tokens"] > 0


# --- errors ------------------------------------------------------------------------------------------


def test_mtp_method_refused_for_dspark_stages(tiny_0731, make_llm):
    with pytest.raises(ValueError, match=r"'mtp' is not available for DeepseekV4ForCausalLM \(its drafters: "
                                         r"\['dspark'\]\)"):
        make_llm(tiny_0731, dtype="float64", speculative_config={"method": "mtp", "num_speculative_tokens": 1})


def test_more_drafts_than_the_block_refused(tiny_0731, make_llm):
    with pytest.raises(ValueError, match="more than the DSpark block"):
        make_llm(tiny_0731, dtype="float64", **dspark(4))


def _with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


@pytest.mark.parametrize("changes, match", [
    ({"compress_ratios": [0, 4, 8, 4, 0, 0]}, "compress_ratios has 6 entries; 4 layers and 3 stages need 7"),
    ({"compress_ratios": [0, 4, 8, 4, 0, 4, 0]}, "window-only"),
    ({"dspark_target_layer_ids": [1, 4]}, "outside the 4 backbone layers"),
    ({"dspark_target_layer_ids": [3, 2]}, "strictly increasing"),
    ({"dspark_target_layer_ids": []}, "is empty"),
    ({"dspark_block_size": 0}, "dspark_block_size must be an integer >= 1"),
    ({"dspark_noise_token_id": 384}, "not a token id"),
    ({"dspark_n_routed_experts": 2, "dspark_n_activated_experts": 3}, "route 3 of 2 experts"),
])
def test_invalid_0731_configs(tiny_0731, tmp_path, changes, match):
    path = _with_config(tiny_0731, tmp_path / "m", **changes)
    with pytest.raises(UnsupportedModelError, match=match):
        ModelConfig.from_pretrained(path)


def test_published_defaults_fill_missing_drafter_keys(tiny_0731, tmp_path):
    """A 0731 config naming only ``n_mtp_layers`` takes the published block, noise token and Markov rank, and
    the last backbone layers as targets."""
    path = _with_config(tiny_0731, tmp_path / "m", dspark_block_size=None, dspark_noise_token_id=None,
                        dspark_markov_rank=None, dspark_target_layer_ids=None, vocab_size=129280)
    cfg = ModelConfig.from_pretrained(path)
    assert (cfg.dspark_block_size, cfg.dspark_noise_token_id, cfg.dspark_markov_rank) == (5, 128799, 256)
    assert cfg.dspark_target_layer_ids == [1, 2, 3] and cfg.num_nextn_predict_layers == 3


# --- plain V4 as before ------------------------------------------------------------------------------


def test_plain_v4_keeps_its_mtp_drafter(tiny_path, make_llm):
    path = tiny_path("tiny")
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.dspark is None and cfg.dspark_block_size == 0 and cfg.num_nextn_predict_layers == 1
    model = load_model(path, dtype=torch.float64)
    assert isinstance(model.drafter, DeepseekV4MTP) and model.has_mtp and model.dspark is None
    with pytest.raises(ValueError, match=r"'dspark' is not available for DeepseekV4ForCausalLM.*mtp"):
        make_llm(path, dtype="float64", **dspark(1))

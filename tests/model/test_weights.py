"""Typed weight records: what the loader builds per layer, their checkpoint names, the ops the forward
calls given them, and ``deepinfer_process_weights``: a plugin's re-laid record is what the engine runs."""

from __future__ import annotations

import re

import pytest
import torch
from model_fixtures import run_forward_and_mtp

from deepinfer_core import plugins
from deepinfer_core.config import ModelConfig
from deepinfer_core.entrypoints.llm import LLM
from deepinfer_core.model.loader import CheckpointError, fp8_weight_names, load_weights, read_checkpoint
from deepinfer_core.models import load_model
from deepinfer_core.models.deepseek_v4.weights import Compressor, Indexer, Linear, ModelWeights, build_weights
from deepinfer_core.quant.fp8 import FP8_DTYPE, quantize_params_fp8
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.testing.model_runner import SimpleRunner
from deepinfer_core.testing.tiny_model import build_tiny_checkpoint

try:
    from plugin_helpers import FakeDists
except ImportError:  # tests/ imported as a package
    from tests.plugin_helpers import FakeDists

#: whole 128x128 tiles for the experts, so FP8 mode keeps them E4M3 (as in test_fp8)
ALIGNED = dict(hidden_size=256, moe_intermediate_size=128, q_lora_rank=160)


@pytest.fixture(autouse=True)
def one_thread_no_packs(monkeypatch):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv(plugins.ALLOWLIST_ENV, "")  # installed kernel packs are not what is tested here
    plugins._LOADED.clear()
    yield
    plugins._LOADED.clear()
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("w") / "tiny", "tiny")


@pytest.fixture(scope="module")
def aligned(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("w") / "aligned", "tiny", **ALIGNED)


# --- the records -------------------------------------------------------------------------------------


def test_loader_builds_one_record_per_component(tiny):
    """tiny: layer 0 sliding window + hash routing, layers 1-3 CSA, HCA, CSA with learned routing, one
    MTP block."""
    cfg = ModelConfig.from_pretrained(tiny)
    w = load_weights(cfg, tiny, torch.float32)
    assert isinstance(w, ModelWeights) and len(w.layers) == 4 and len(w.mtp) == 1
    swa, csa, hca, _ = (layer.attn for layer in w.layers)
    assert isinstance(csa.compressor, Compressor) and isinstance(csa.indexer, Indexer)
    assert isinstance(hca.compressor, Compressor) and hca.indexer is None
    assert swa.compressor is None and swa.indexer is None and w.mtp[0].block.attn.compressor is None
    assert csa.compressor.ape.shape == (4, 2 * cfg.head_dim) and hca.compressor.ape.shape == (8, cfg.head_dim)
    assert csa.indexer.compressor.norm.shape == (cfg.index_head_dim,)
    hashed, learned = w.layers[0].moe.gate, w.layers[1].moe.gate
    assert hashed.tid2eid.dtype == torch.long and hashed.bias is None
    assert learned.tid2eid is None and learned.bias.shape == (cfg.n_routed_experts,)
    experts = w.layers[2].moe.experts
    assert experts.w13.weight.shape == (cfg.n_routed_experts, 2 * cfg.moe_intermediate_size, cfg.hidden_size)
    assert w.layers[1].moe.shared.w13.weight.shape == (2 * cfg.moe_intermediate_size, cfg.hidden_size)
    assert w.layers[1].attn_hc.fn.shape == ((2 + cfg.hc_mult) * cfg.hc_mult, cfg.hc_mult * cfg.hidden_size)
    assert w.output.hc.fn.shape == (cfg.hc_mult, cfg.hc_mult * cfg.hidden_size)
    assert all(isinstance(x, Linear) and x.scale is None
               for x in (w.head, csa.wq_a, csa.wo_b, experts.w13, w.mtp[0].e_proj))


@pytest.mark.parametrize("fp8", [False, True])
def test_named_parameters_are_the_checkpoint_tensors_under_their_names(aligned, fp8):
    """Every tensor the checkpoint reader produced lands in one field and is named back unchanged."""
    cfg = ModelConfig.from_pretrained(aligned)
    flat = read_checkpoint(cfg, aligned, torch.float32, keep_fp8=fp8)
    if fp8:
        quantize_params_fp8(flat, fp8_weight_names(cfg))
    named = dict(build_weights(cfg, dict(flat)).named_parameters())
    assert set(named) == set(flat)
    assert all(named[k] is flat[k] for k in flat)
    assert ("layers.1.attn.wq_a.weight_scale" in named) == fp8


def test_fp8_linears_carry_their_scale(aligned):
    w = load_weights(ModelConfig.from_pretrained(aligned), aligned, torch.float32, keep_fp8=True)
    attn, experts = w.layers[1].attn, w.layers[1].moe.experts
    assert attn.wq_a.is_fp8 and attn.wq_a.weight.dtype == FP8_DTYPE and attn.wq_a.scale.shape == (2, 2)
    assert experts.is_fp8 and experts.w2.scale.shape[0] == experts.w2.weight.shape[0]
    assert not w.head.is_fp8 and not w.layers[1].moe.gate.weight.is_fp8 and not w.mtp[0].e_proj.is_fp8


def test_a_missing_tensor_is_named(tiny):
    cfg = ModelConfig.from_pretrained(tiny)
    flat = read_checkpoint(cfg, tiny, torch.float32)
    del flat["layers.1.attn.wq_b.weight"]
    with pytest.raises(CheckpointError, match=re.escape("layers.1.attn.wq_b.weight")):
        build_weights(cfg, flat)


# --- ops_in_use ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["float32", "fp8", "no_mtp", "sliding_only"])
def test_ops_in_use_are_the_ops_the_forward_calls(case, aligned, tmp_path):
    if case == "no_mtp":
        path = build_tiny_checkpoint(tmp_path / "c", "tiny", with_mtp=False)
    elif case == "sliding_only":
        path = build_tiny_checkpoint(tmp_path / "c", "tiny", layer_types=["sliding_attention"] * 4)
    else:
        path = aligned
    model = load_model(path, dtype=torch.float32, quantization="fp8" if case == "fp8" else None)
    forward, mtp = run_forward_and_mtp(model)
    assert model.ops_in_use(mtp=False) == forward
    assert model.ops_in_use() == forward | mtp
    assert model.has_mtp == (case != "no_mtp") and bool(mtp) == model.has_mtp
    fp8_ops = {"linear_fp8", "moe_experts_fp8"}
    assert fp8_ops <= forward if case == "fp8" else not fp8_ops & forward
    assert ("moe_experts" in forward) == (case != "fp8")
    assert ("compress_windows" in forward and "indexer_topk" in forward) == (case != "sliding_only")


# --- deepinfer_process_weights ---------------------------------------------------------------------------

RELAYING_PACK = """
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.models.deepseek_v4.weights import Linear, ModelWeights

CALLS = []

@hookimpl
def deepinfer_process_weights(weights, model_config):
    CALLS.append((type(weights) is ModelWeights, model_config.num_hidden_layers))
    weights.head = Linear(-weights.head.weight)  # a marked head: greedy now picks the least likely token
    attn = weights.layers[0].attn
    attn.wq_a = Linear(attn.wq_a.weight.t().contiguous().t(), attn.wq_a.scale)  # column-major re-layout
"""


@pytest.fixture
def relaying_pack(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    fake = FakeDists(site)
    fake.ensure_repo_dists(monkeypatch)
    fake.add("deepinfer-relay", {plugins.KERNEL_GROUP: {"relay": "relay_pack"}}, {"relay_pack": RELAYING_PACK})
    yield
    fake.cleanup()


def test_process_weights_plugin_relays_weights_the_engine_runs(tiny, relaying_pack, monkeypatch):
    import sys

    ids = torch.randint(2, 384, (12,), generator=torch.Generator().manual_seed(4)).tolist()
    plain = load_model(tiny, dtype=torch.float64)
    want = SimpleRunner(plain, 1, len(ids), block_size=16).step({0: ids})[0][-1]

    monkeypatch.setenv(plugins.ALLOWLIST_ENV, "relay")
    model = load_model(tiny, dtype=torch.float64)
    assert sys.modules["relay_pack"].CALLS == [(True, 4)]  # once, with the records
    wq_a = model.weights.layers[0].attn.wq_a.weight
    assert wq_a.stride() == (1, wq_a.shape[0]) and torch.equal(wq_a, plain.weights.layers[0].attn.wq_a.weight)
    got = SimpleRunner(model, 1, len(ids), block_size=16).step({0: ids})[0][-1]
    torch.testing.assert_close(got, -want, rtol=1e-10, atol=1e-10)

    llm = LLM(model=tiny, dtype="float64", max_num_seqs=1)
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=1),
                       use_tqdm=False)
    assert out[0].outputs[0].token_ids == [int(want.argmin())]

"""``numerics="deepseek"`` with ``quantization="fp8"`` and with routed experts held in a float dtype.

FP8 mode under deepseek numerics keeps in E4M3 only the projections DeepSeek's model.py runs through
its FP8 GEMM (not the compressors, the indexer's ``weights_proj`` or non-FP4 routed experts) and
multiplies them with ``linear_fp8_ue8m0``; routed experts held in a float dtype run through
``moe_experts_act_quant``, DeepSeek's quantised expert arithmetic. Both give exactly the logits of the
published FP8/FP4 checkpoint under deepseek numerics, where the weights hold the same values.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_fixtures import engine_logits, no_kernel_packs, prompt, run_forward_and_mtp

from deepinfer_core.models import load_model
from deepinfer_core.models.deepseek_v4 import DeepseekV4Model
from deepinfer_core.quant.fp4 import is_power_of_two
from deepinfer_core.testing.published_checkpoint import build_published_checkpoint, write_dequantised_copy

IDS = prompt(40, 384, seed=7)


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> Path:
    return build_published_checkpoint(tmp_path_factory.mktemp("pub") / "tiny", "tiny", seed=2)


@pytest.fixture(scope="module")
def dequantised(published, tmp_path_factory) -> Path:
    return write_dequantised_copy(published, tmp_path_factory.mktemp("deq") / "tiny")


def load(path: Path, **kw) -> DeepseekV4Model:
    with no_kernel_packs():
        return load_model(path, dtype=kw.pop("dtype", torch.float32), **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_float_experts_under_deepseek_numerics_equal_the_packed_fp4_ones(published, dequantised, dtype):
    """The dequantised copy (float32 weights, no quantization_config) forced to deepseek numerics: its
    routed experts quantise their activations as DeepSeek's FP4 experts do, bit for bit."""
    floats = load(dequantised, dtype=dtype, numerics="deepseek")
    assert not floats.weights.layers[1].moe.experts.is_fp4
    assert "moe_experts_act_quant" in floats.ops_in_use() and "moe_experts" not in floats.ops_in_use()
    want = engine_logits(load(published, dtype=dtype, numerics="deepseek"), IDS)
    assert torch.equal(engine_logits(floats, IDS), want)
    assert not torch.equal(engine_logits(load(dequantised, dtype=dtype), IDS), want)  # transformers numerics


def test_fp8_mode_keeps_what_deepseek_runs_in_fp8(published, dequantised):
    """From the published file the E4M3 tensors stay E4M3; from a float checkpoint FP8 mode quantises the
    same set, with power-of-two scales as DeepSeek publishes them; never the compressors, the indexer's
    weights_proj or the routed experts (packed FP4 stays packed FP4)."""
    for path in (published, dequantised):
        model = load(path, quantization="fp8", numerics="deepseek")
        names = {n for n, t in model.named_parameters() if t.dtype == torch.float8_e4m3fn}
        assert "layers.1.attn.wq_a.weight" in names and "layers.1.ffn.shared_experts.w13" in names
        assert not {n for n in names if ".compressor." in n or "weights_proj" in n or ".ffn.experts." in n}
        scale = model.p["layers.1.attn.wq_a.weight_scale"]
        assert is_power_of_two(scale)
    transformers_fp8 = load(dequantised, quantization="fp8", numerics="transformers")
    assert transformers_fp8.weights.layers[1].moe.experts.is_fp8  # what deepseek numerics leave out


def test_fp8_mode_under_deepseek_numerics_from_a_float_checkpoint_equals_the_published_one(published, dequantised):
    """The float copy quantised on load (ue8m0 weight scales) holds the published E4M3 values again."""
    ours = engine_logits(load(dequantised, quantization="fp8", numerics="deepseek"), IDS)
    assert torch.equal(ours, engine_logits(load(published, quantization="fp8", numerics="deepseek"), IDS))


def test_fp8_mode_under_deepseek_numerics_in_bfloat16(published):
    """bf16: the FP8 GEMM accumulates in float32 before rounding (as DeepSeek's fp8_gemm), the
    dequantised path multiplies bf16 values: the logits differ by rounding only, the weights take
    less memory."""
    fp8 = load(published, dtype=torch.bfloat16, quantization="fp8", numerics="deepseek")
    plain = load(published, dtype=torch.bfloat16, numerics="deepseek")
    a, b = engine_logits(fp8, IDS).double(), engine_logits(plain, IDS).double()
    assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() > 0.99

    def weight_bytes(model):
        return sum(t.numel() * t.element_size() for _, t in model.named_parameters())

    assert weight_bytes(fp8) < weight_bytes(plain)


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_ops_in_use_under_deepseek_numerics_are_the_ops_the_forward_calls(published, dequantised, quantization):
    for path in (published, dequantised):
        model = load(path, quantization=quantization, numerics="deepseek")
        forward, mtp = run_forward_and_mtp(model)
        assert model.ops_in_use(mtp=False) == forward and model.ops_in_use() == forward | mtp
        assert {"kv_fp8_pack", "sparse_attention_fp8"} <= forward and "sparse_attention" not in forward

"""DeepSeek's published checkpoint layout: flat names, FP8 E4M3 linears with ue8m0 (``float8_e8m0fnu``)
block scales, FP4 e2m1 routed experts packed two a byte with e8m0 scales per 32 inputs,
``quantization_config`` and ``expert_dtype`` in config.json; transformers' in-memory names as a second
layout; FP4 experts kept packed with ``moe_experts_fp4``; and an error naming the tensor and file for
every bad input.

The checkpoints are written by :mod:`deepinfer_core.testing.published_checkpoint` from the tiny builder's
random weights; the reference is the same values dequantised to float32 (the builder's own unpacking).
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from model_fixtures import engine_logits, no_kernel_packs, prompt
from safetensors.torch import load_file, save_file

from deepinfer_core.config import ModelConfig
from deepinfer_core.model.loader import CheckpointError, expected_file_names, load_weights
from deepinfer_core.models import default_numerics, load_model
from deepinfer_core.models.deepseek_v4 import DeepseekV4Model
from deepinfer_core.models.deepseek_v4.manifest import FP4_NAMES, FP8_NAMES
from deepinfer_core.models.deepseek_v4.weights import Experts, Linear, records
from deepinfer_core.ops import native
from deepinfer_core.plugins import build_op_table
from deepinfer_core.quant.fp4 import (
    E2M1_VALUES,
    dequantize_fp4_block,
    fake_quant_act_ue8m0,
    pack_fp4,
    quantize_fp4_block,
    unpack_fp4,
)
from deepinfer_core.testing.published_checkpoint import (
    build_published_checkpoint,
    write_dequantised_copy,
    write_tensors,
)
from deepinfer_core.testing.tiny_model import build_tiny_checkpoint, load_hf_model


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> Path:
    return build_published_checkpoint(tmp_path_factory.mktemp("pub") / "tiny", "tiny")


@pytest.fixture(scope="module")
def dequantised(published, tmp_path_factory) -> Path:
    return write_dequantised_copy(published, tmp_path_factory.mktemp("deq") / "tiny")


def load(path: Path, **kw) -> DeepseekV4Model:
    with no_kernel_packs():
        return load_model(path, dtype=kw.pop("dtype", torch.float32), **kw)


def greedy_tokens(model: DeepseekV4Model, ids: list[int], steps: int = 12) -> list[int]:
    """Prefill ``ids``, then decode ``steps`` tokens one at a time, always the argmax."""
    from deepinfer_core.testing.model_runner import SimpleRunner

    runner = SimpleRunner(model, 1, len(ids) + steps)
    logits = runner.step({0: ids})[0]
    out = []
    for _ in range(steps):
        out.append(int(logits[-1].argmax()))
        logits = runner.step({0: [out[-1]]})[0]
    return out


def files_of(path: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


def copy_of(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config, indent=2))


IDS = prompt(20, 384, seed=11)


# --- the layout as written -------------------------------------------------------------------------


def test_the_tiny_checkpoint_has_the_published_names_dtypes_and_packing(published):
    tensors = files_of(published)
    cfg = ModelConfig.from_pretrained(published)
    weights = {n for n in tensors if not n.endswith(".scale")}
    assert weights == set(expected_file_names(cfg))  # DeepSeek's names, experts one by one, nothing else
    assert "layers.1.attn.kv_norm.weight" in tensors and "mtp.0.attn.kv_norm.weight" in tensors
    w1, s1 = tensors["layers.1.ffn.experts.0.w1.weight"], tensors["layers.1.ffn.experts.0.w1.scale"]
    assert w1.dtype == torch.int8 and w1.shape == (cfg.moe_intermediate_size, cfg.hidden_size // 2)
    assert s1.dtype == torch.float8_e8m0fnu and s1.shape == (cfg.moe_intermediate_size, cfg.hidden_size // 32)
    wq, sq = tensors["layers.1.attn.wq_b.weight"], tensors["layers.1.attn.wq_b.scale"]
    assert wq.dtype == torch.float8_e4m3fn and sq.dtype == torch.float8_e8m0fnu and sq.shape == (1, 1)
    for name, t in tensors.items():
        if name.endswith(".scale"):
            continue
        if FP4_NAMES.search(name):
            assert t.dtype == torch.int8, name
        elif FP8_NAMES.search(name):
            assert t.dtype == torch.float8_e4m3fn and name.removesuffix(".weight") + ".scale" in tensors, name
    assert tensors["embed.weight"].dtype == torch.bfloat16 and tensors["layers.0.ffn.gate.tid2eid"].dtype == torch.int32
    assert tensors["layers.2.attn.compressor.wkv.weight"].dtype == torch.bfloat16
    assert tensors["layers.1.hc_attn_fn"].dtype == torch.float32
    assert tensors["layers.1.attn.attn_sink"].dtype == torch.float32
    config = json.loads((published / "config.json").read_text())
    assert config["quantization_config"]["scale_fmt"] == "ue8m0" and config["expert_dtype"] == "fp4"


def test_fp4_packing_is_low_nibble_first():
    """Byte 0xA1 holds code 1 (0.5) in its low nibble, code 10 (-1.0) in its high one, as DeepSeek's
    convert.py reads it."""
    packed = torch.tensor([[0xA1, 0x7F]], dtype=torch.uint8)
    assert unpack_fp4(packed).tolist() == [[0.5, -1.0, -6.0, 6.0]]
    assert torch.equal(pack_fp4(torch.tensor([[1, 10, 15, 7]])), packed)
    values = torch.tensor(E2M1_VALUES).repeat(4).view(2, 32)  # every code, twice per row
    packed, scale = quantize_fp4_block(values * 4.0)
    assert torch.equal(scale.view(torch.uint8), torch.full((2, 1), 129, dtype=torch.uint8))  # 2**2
    assert torch.equal(dequantize_fp4_block(packed, scale), values * 4.0)


# --- loads equal to the dequantised weights --------------------------------------------------------


def test_published_checkpoint_loads_equal_to_its_dequantised_copy(published, dequantised):
    """Dequantised on load (quantization=None): the same parameters, so the same logits bit for bit and
    the same greedy tokens, prefill and decode."""
    pub, deq = load(published, numerics="transformers"), load(dequantised)
    assert torch.equal(engine_logits(pub, IDS), engine_logits(deq, IDS))
    assert greedy_tokens(pub, IDS) == greedy_tokens(deq, IDS)
    p, d = pub.p, deq.p
    assert set(p) == set(d) and all(torch.equal(p[n], d[n]) for n in p)


def _dequantise_experts(model: DeepseekV4Model) -> DeepseekV4Model:
    """The model with every packed-FP4 expert stack replaced by its float32 values."""
    w = model.weights
    for ex in records([*w.layers, *w.mtp], leaves=(Experts,)):
        if isinstance(ex, Experts):
            for name in ("w13", "w2"):
                lin = getattr(ex, name)
                setattr(ex, name, Linear(dequantize_fp4_block(lin.weight, lin.scale, torch.float32)))
    return model


def test_fp4_experts_stay_packed_and_compute_as_dequantised(published):
    """quantization="fp8": routed experts stay FP4 in memory (uint8 [E, 2I, D/2], e8m0 [E, 2I, D/32],
    a quarter of bf16's bytes with the scales), run through moe_experts_fp4, whose transformers-numerics
    result is moe_experts on the dequantised weights: same logits, same greedy tokens."""
    model = load(published, quantization="fp8", numerics="transformers")
    cfg = model.cfg
    ex = model.weights.layers[1].moe.experts
    e, i, d = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    assert ex.is_fp4 and ex.w13.weight.dtype == torch.uint8 and ex.w13.weight.shape == (e, 2 * i, d // 2)
    assert ex.w13.scale.dtype == torch.float8_e8m0fnu and ex.w13.scale.shape == (e, 2 * i, d // 32)
    assert ex.w2.weight.shape == (e, d, i // 2) and ex.w2.scale.shape == (e, d, i // 32)
    packed_bytes = sum(t.numel() * t.element_size() for t in (ex.w13.weight, ex.w13.scale, ex.w2.weight, ex.w2.scale))
    assert packed_bytes * 3.7 < 2 * (e * 2 * i * d + e * d * i)  # 17 bytes per 32 weights vs bf16's 64
    assert "moe_experts_fp4" in model.ops_in_use() and "moe_experts" not in model.ops_in_use()
    assert model.weights.layers[1].attn.wq_a.is_fp8
    logits, tokens = engine_logits(model, IDS), greedy_tokens(model, IDS)
    reference = _dequantise_experts(load(published, quantization="fp8", numerics="transformers"))
    assert "moe_experts" in reference.ops_in_use()
    assert torch.equal(logits, engine_logits(reference, IDS))
    assert tokens == greedy_tokens(reference, IDS)


def test_sharded_published_checkpoint_with_scales_in_other_shards(published, dequantised, tmp_path):
    path = copy_of(published, tmp_path / "sharded")
    files = write_tensors(path, files_of(published), shards=3)
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(files) == 3 and index["layers.1.attn.wq_a.weight"] != index["layers.1.attn.wq_a.scale"]
    assert torch.equal(engine_logits(load(path, numerics="transformers"), IDS), engine_logits(load(dequantised), IDS))


def test_numerics_default_follows_quantization_config(published, dequantised):
    assert default_numerics(ModelConfig.from_pretrained(published)) == "deepseek"
    assert default_numerics(ModelConfig.from_pretrained(dequantised)) == "transformers"
    assert load(published).numerics == "deepseek"
    with pytest.raises(ValueError, match="numerics 'mine'"):
        load(published, numerics="mine")


def test_only_a_range_of_experts_is_loaded(published):
    cfg = ModelConfig.from_pretrained(published)
    full = load_weights(cfg, published, torch.float32)
    part = load_weights(cfg, published, torch.float32, keep_fp8=True, experts=range(2, 4))
    packed = load_weights(cfg, published, torch.float32, keep_fp8=True)
    for layer in (1, 3):
        ex, ref = part.layers[layer].moe.experts, packed.layers[layer].moe.experts
        assert ex.w13.weight.shape[0] == 2 and torch.equal(ex.w13.weight, ref.w13.weight[2:4])
        assert torch.equal(ex.w2.scale.view(torch.uint8), ref.w2.scale[2:4].view(torch.uint8))
    part = load_weights(cfg, published, torch.float32, experts=range(4, 6))
    assert torch.equal(part.layers[2].moe.experts.w13.weight, full.layers[2].moe.experts.w13.weight[4:6])
    with pytest.raises(ValueError, match="contiguous range"):
        load_weights(cfg, published, torch.float32, experts=range(0, 6, 2))


def test_transformers_in_memory_names_load_as_a_second_layout(tmp_path):
    """``model.layers.N.self_attn.q_a_proj.weight``, merged ``mlp.experts.gate_up_proj`` [E, 2I, D]: the
    state dict of transformers' own model loads and gives the saved checkpoint's logits."""
    src = build_tiny_checkpoint(tmp_path / "saved", "tiny", with_mtp=False)
    hf = load_hf_model(src, torch.float32)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.1.self_attn.q_a_proj.weight" in state and "model.layers.1.mlp.experts.gate_up_proj" in state
    dst = copy_of(src, tmp_path / "hf_names")
    (dst / "model.safetensors").unlink()
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    ours, theirs = load(dst), load(src)
    assert all(torch.equal(ours.p[n], t) for n, t in theirs.p.items()) and set(ours.p) == set(theirs.p)
    # the same values; the logits to the last bits only (BLAS kernels vary with the tensors' alignment)
    torch.testing.assert_close(engine_logits(ours, IDS), engine_logits(theirs, IDS), rtol=1e-5, atol=1e-5)


# --- the FP4 op ------------------------------------------------------------------------------------


def _fp4_case(seed: int = 0, tokens: int = 9, e: int = 4, d: int = 256, inter: int = 128, k: int = 2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, d, generator=g)
    w13, s13 = quantize_fp4_block(torch.randn(e, 2 * inter, d, generator=g) * d**-0.5 * 3)
    w2, s2 = quantize_fp4_block(torch.randn(e, d, inter, generator=g) * inter**-0.5)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)])
    ids[0, 1] = -1  # a pair routed elsewhere: skipped
    weights = torch.rand(tokens, k, generator=g) + 0.2
    return x, w13, s13, w2, s2, ids, weights


def test_moe_experts_fp4_without_act_quant_is_moe_experts_on_dequantised_weights():
    x, w13, s13, w2, s2, ids, weights = _fp4_case()
    out = native.moe_experts_fp4(x, w13, s13, w2, s2, ids, weights, 10.0, False)
    ref = native.moe_experts(x, dequantize_fp4_block(w13, s13), dequantize_fp4_block(w2, s2), ids, weights, 10.0)
    assert torch.equal(out, ref)


def test_moe_experts_fp4_with_act_quant_follows_deepseeks_expert():
    """quant_act=True as DeepSeek's Expert.forward: E4M3 activations with power-of-two scales per 128,
    the routing weight applied before w2, summed per token; here in float64, expert by expert."""
    x, w13, s13, w2, s2, ids, weights = _fp4_case(seed=1)
    x = x.double()
    out = native.moe_experts_fp4(x, w13, s13, w2, s2, ids, weights.double(), 10.0, True)
    want = torch.zeros_like(x)
    inter = w2.shape[-1] * 2
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot])
            if e < 0:
                continue
            w1w3 = dequantize_fp4_block(w13[e], s13[e], torch.float64)
            xq = fake_quant_act_ue8m0(x[t : t + 1])
            gate, up = (xq @ w1w3[:inter].T).clamp(max=10.0), (xq @ w1w3[inter:].T).clamp(-10.0, 10.0)
            h = torch.nn.functional.silu(gate) * up * weights[t, slot].double()
            want[t] += (fake_quant_act_ue8m0(h) @ dequantize_fp4_block(w2[e], s2[e], torch.float64).T)[0]
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    plain = native.moe_experts_fp4(x, w13, s13, w2, s2, ids, weights.double(), 10.0, False)
    assert not torch.equal(out, plain)  # the quantisation steps are visible


def test_fake_act_quant_uses_power_of_two_scales():
    x = torch.tensor([[448.0 * 3, 1.0, -2.5] + [0.0] * 125, [0.0] * 128])
    q = fake_quant_act_ue8m0(x)
    # amax 1344 -> scale 2^ceil(log2(3)) = 4: 1.0 / 4 and -2.5 / 4 are exact in E4M3, 1344 / 4 = 336 lies
    # midway between E4M3's 320 and 352 and rounds to the even 320 (a per-group amax / 448 scale would
    # have kept it exact)
    assert q[0, :3].tolist() == [1280.0, 1.0, -2.5] and torch.equal(q[1], x[1])
    x = torch.full((1, 128), 1.0)
    x[0, 0] = 300.0  # scale 1: 300 rounds to E4M3's 288 (step 32 above 256)
    assert fake_quant_act_ue8m0(x)[0, 0] == 288.0


def test_catalogue_and_cpu_ref_serve_the_fp4_op():
    from deepinfer_core.ops.catalogue import CATALOGUE

    assert "moe_experts_fp4" in CATALOGUE and not CATALOGUE["moe_experts_fp4"].batch_invariant
    table = build_op_table("cpu_ref", dtype=torch.float32)
    assert table.chosen["moe_experts_fp4"].fn is native.moe_experts_fp4
    assert table.syncs_host(["moe_experts_fp4"]) == ["moe_experts_fp4"]


# --- errors: each names the tensor and its file ----------------------------------------------------


def _rewrite(src: Path, dst: Path, edit) -> Path:
    path = copy_of(src, dst)
    tensors = files_of(path)
    edit(tensors)
    write_tensors(path, tensors)
    return path


EXPERT = "layers.1.ffn.experts.2.w1"


def _unquantise(tensors: dict[str, torch.Tensor], name: str) -> None:
    del tensors[name + ".scale"]
    tensors[name + ".weight"] = torch.zeros(32, 64, dtype=torch.bfloat16)


@pytest.mark.parametrize(("case", "edit", "message"), [
    ("fp4_weight_shape", lambda t: t.update({EXPERT + ".weight": t[EXPERT + ".weight"][:, :-1].contiguous()}),
     rf"{EXPERT}\.weight .*shape \(32, 31\), expected \(32, 32\)"),
    ("fp4_scale_shape", lambda t: t.update({EXPERT + ".scale": t[EXPERT + ".scale"][:, :1].contiguous()}),
     rf"block scale of {EXPERT}\.weight .*shape \(32, 1\), expected \(32, 2\)"),
    ("fp4_scale_dtype", lambda t: t.update({EXPERT + ".scale": t[EXPERT + ".scale"].view(torch.int8)}),
     rf"block scale of {EXPERT}\.weight .*dtype torch\.int8"),
    ("fp4_without_scale", lambda t: t.pop(EXPERT + ".scale"), rf"FP4 tensor {EXPERT}\.weight .*no block scale"),
    ("expert_in_bf16", lambda t: _unquantise(t, EXPERT),
     rf"expert_dtype 'fp4'.*{EXPERT}\.weight"),
    ("fp8_scale_shape", lambda t: t.update({"layers.2.attn.wq_b.scale": torch.ones(2, 1).to(torch.float8_e8m0fnu)}),
     r"block scale of layers\.2\.attn\.wq_b\.weight has shape \(2, 1\), expected \(1, 1\)"),
    ("fp8_scale_not_pow2", lambda t: t.update({"layers.2.attn.wq_b.scale": torch.full((1, 1), 0.3)}),
     r"layers\.2\.attn\.wq_b\.weight .*not a power of two.*ue8m0"),
    ("scale_of_a_float_weight", lambda t: t.update({"layers.2.attn.compressor.wkv.scale": torch.ones(1, 1)}),
     r"layers\.2\.attn\.compressor\.wkv\.weight .*not quantised, but has a block scale"),
    ("scale_without_weight", lambda t: t.update({"layers.2.attn.wq_z.scale": torch.ones(1, 1)}),
     r"layers\.2\.attn\.wq_z\.scale .*without its weight"),
    ("e5m2_weight",
     lambda t: t.update({"layers.2.attn.wq_b.weight": t["layers.2.attn.wq_b.weight"].to(torch.float8_e5m2)}),
     r"layers\.2\.attn\.wq_b\.weight .*dtype torch\.float8_e5m2"),
    ("float_tid2eid", lambda t: t.update({"layers.0.ffn.gate.tid2eid": t["layers.0.ffn.gate.tid2eid"].float()}),
     r"layers\.0\.ffn\.gate\.tid2eid .*int32 or int64"),
    ("unknown_name", lambda t: t.update({"layers.1.attn.wq_c.weight": torch.zeros(4)}),
     r"layers\.1\.attn\.wq_c\.weight \('layers\.1\.attn\.wq_c\.weight' in model\.safetensors\)"),
    ("expert_out_of_range",
     lambda t: t.update({"layers.1.ffn.experts.6.w2.weight": t["layers.1.ffn.experts.0.w2.weight"].clone()}),
     r"layers\.1\.ffn\.experts\.6\.w2\.weight .*6 experts"),
    ("two_names_one_tensor",
     lambda t: t.update({"layers.1.attn.norm.weight": t["layers.1.attn.kv_norm.weight"].clone()}),
     r"both the tensor layers\.1\.attn\.kv_norm\.weight"),
    ("missing_expert", lambda t: t.pop("layers.3.ffn.experts.5.w3.weight"), r"layers\.3\.ffn\.experts\.5\.w3\.weight"),
])
def test_bad_published_tensors_are_named(published, tmp_path, case, edit, message):
    path = _rewrite(published, tmp_path / case, edit)
    with pytest.raises(CheckpointError, match=message) as info:
        load(path)
    if case not in ("missing_expert", "two_names_one_tensor"):
        assert "model.safetensors" in str(info.value)


@pytest.mark.parametrize(("case", "config", "message"), [
    ("no_expert_dtype", {"expert_dtype": None, "quantization_config": None},
     r"layers\.\d\.ffn\.experts\.\d\.w\d\.weight .*packed FP4.*expert_dtype"),
    ("block_64", {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [64, 64]}},
     r"weight_block_size \[64, 64\] is not supported"),
    ("awq", {"quantization_config": {"quant_method": "awq"}}, r"quant_method 'awq'"),
    ("scale_fmt", {"quantization_config": {"quant_method": "fp8", "scale_fmt": "ue4m3"}}, r"scale_fmt 'ue4m3'"),
])
def test_a_quantization_the_loader_does_not_read_is_refused(published, tmp_path, case, config, message):
    path = copy_of(published, tmp_path / case)
    edit_config(path, **config)
    with pytest.raises(CheckpointError, match=message):
        load(path)


def test_truncated_or_corrupted_files_are_clear_errors(published, tmp_path):
    path = copy_of(published, tmp_path / "trunc")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=r"cannot read .*model\.safetensors.*truncated"):
        load(path)
    (path / "model.safetensors").write_bytes(b"\x20\x00\x00\x00\x00\x00\x00\x00" + b"{" * 32 + data[40:])
    with pytest.raises(CheckpointError, match=r"cannot read .*model\.safetensors"):
        load(path)


def test_an_index_that_misplaces_a_tensor_is_named(published, tmp_path):
    path = copy_of(published, tmp_path / "index")
    write_tensors(path, files_of(published), shards=2)
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    name = "layers.1.attn.wq_a.weight"
    index["weight_map"][name] = next(f for f in set(index["weight_map"].values()) if f != index["weight_map"][name])
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=re.escape(name)):
        load(path)


def test_fp4_kept_checkpoint_matches_the_dequantised_one_in_bfloat16(published):
    """In bf16 too the FP4 values are exact: the packed and the dequantised experts give the same logits."""
    model = load(published, dtype=torch.bfloat16, quantization="fp8", numerics="transformers")
    reference = _dequantise_experts(load(published, dtype=torch.bfloat16, quantization="fp8", numerics="transformers"))
    for ex in records([*reference.weights.layers, *reference.weights.mtp], leaves=(Experts,)):
        if isinstance(ex, Experts):
            ex.w13, ex.w2 = (replace(lin, weight=lin.weight.bfloat16()) for lin in (ex.w13, ex.w2))
    assert torch.equal(engine_logits(model, IDS), engine_logits(reference, IDS))


# --- through the engine ----------------------------------------------------------------------------


@pytest.mark.parametrize("numerics", ["transformers", "deepseek"])
def test_the_engine_serves_the_published_checkpoint(published, numerics):
    """``LLM(..., numerics=...)`` reaches the model; greedy tokens as the model gives them alone."""
    from deepinfer_core.entrypoints.llm import LLM
    from deepinfer_core.sampling.params import SamplingParams

    with no_kernel_packs():
        llm = LLM(str(published), dtype="float32", numerics=numerics, block_size=16)
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        out = llm.generate([{"prompt_token_ids": IDS}], params)[0].outputs[0].token_ids
    model = llm.llm_engine.model
    assert model.numerics == numerics and model.weights.layers[1].moe.experts.is_fp4 == (numerics == "deepseek")
    assert list(out) == greedy_tokens(load(published, numerics=numerics), IDS)

"""Self-tests of the V4.1 reference harness (``v41_reference``): its kernel stand-ins, the release
inventory it derives from model.py, strict loading, and that model.py (patched) decodes what it prefills.

The model tests use a tiny config that crosses every V4.1 feature at short lengths: ratio-2 and ratio-1
KV sources and readers, a re-indexing layer behind a candidate source, a window shorter than the prompt,
Engram at two layers (the repo's tiny tokenizer feeding the hash), three DSpark stages, FP8 linears and FP4
experts (vision off); random release-layout weights.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import engine_fixtures
import pytest
import torch
import torch.nn.functional as F
import v41_reference as ref

import deepinfer_core
from deepinfer_core.quant.fp4 import e8m0_from_float, quantize_fp4_block
from deepinfer_core.quant.fp8 import quantize_fp8_block

pytestmark = pytest.mark.skipif(not ref.reference_present(), reason=f"{ref.REFERENCE_DIR} not present")

TOKENIZER_DIR = Path(deepinfer_core.__file__).resolve().parent / "assets" / "deepseek-v4-tiny"
MAX_SEQ_LEN = 64
PROMPT_LEN = 40
PREFILL = 13  # odd: a ratio-2 group is left open across the prefill/decode boundary


one_torch_thread = engine_fixtures.one_torch_thread  # one intra-op thread: the tiny model's ops are faster


# --- the stand-ins ---------------------------------------------------------------------------------


def test_reference_dir_is_the_shared_release_folder():
    assert ref.REFERENCE_DIR.parts[-4:] == ("shared", "reference", "deepseek-v4.1-flash", "inference")
    assert (ref.REFERENCE_DIR / "model.py").is_file() and (ref.REFERENCE_DIR / "config.json").is_file()
    assert not (ref.REFERENCE_DIR / "kernel.py").exists()  # why the stand-ins exist


def test_act_quant_power_of_two_scales_and_qdq():
    x = torch.randn(3, 64, dtype=torch.float64) * 3
    x[1, :32] = 0  # an all-zero group: amax floored at 1e-4
    q, s = ref.act_quant(x, 32, "ue8m0", torch.float8_e8m0fnu)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu and s.shape == (3, 2)
    sf = s.double()
    amax = x.unflatten(-1, (-1, 32)).abs().amax(-1).clamp(min=1e-4)
    assert torch.equal(sf, torch.exp2(torch.ceil(torch.log2(amax / 448))))
    y = x.clone()
    assert ref.act_quant(y, 32, "ue8m0", torch.float8_e8m0fnu, inplace=True) is y
    assert torch.equal(y, (q.double().unflatten(-1, (-1, 32)) * sf.unsqueeze(-1)).flatten(-2))


def test_fp4_act_quant_rounds_to_nearest_even_with_either_scale():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, 6.0])
    x = torch.zeros(1, 32)
    x[0, : ties.numel()] = ties  # amax 6: the E8M0 scale is 1
    y = ref.fp4_act_quant(x.clone(), 32, True)
    assert y[0, : ties.numel()].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -1.0, 6.0]
    packed, s = ref.fp4_act_quant(x.clone(), 32)
    assert packed.dtype == torch.float4_e2m1fn_x2 and s.float().item() == 1.0
    assert torch.equal(ref.unpack_fp4(packed) * s.float(), y)
    # E8M0: the floor keeps an all-zero group's scale a normal power of two
    assert ref.fp4_act_quant(torch.zeros(1, 32), 32)[1].float().item() == 2.0**-126
    # E4M3 scales per 16: scale = e4m3(amax / 6) (7/6 -> 1.125), the values clamped to +-6 (7/1.125 > 6)
    g = torch.zeros(2, 16)
    g[1, 0], g[1, 1] = 7.0, -1.0
    packed, s = ref.fp4_act_quant(g.clone(), 16, scale_dtype=torch.float8_e4m3fn)
    assert s.dtype == torch.float8_e4m3fn and s.float().flatten().tolist() == [2.0**-9, 1.125]
    qdq = ref.fp4_act_quant(g.clone(), 16, True, scale_dtype=torch.float8_e4m3fn)
    assert qdq[0].abs().sum() == 0 and qdq[1, :2].tolist() == [6.75, -1.125]


def test_fp4_unpacking_matches_convert_py():
    """Low nibble first and one scale per 32 along ``in``: the same values as convert.py's lossless
    FP4 -> FP8 cast (``cast_e2m1fn_to_e4m3fn``) gives."""
    convert = ref._load_file_module("deepseek_v41_convert_test", ref.REFERENCE_DIR / "convert.py")
    w = torch.randn(64, 128)
    packed, scale = quantize_fp4_block(w)
    packed = packed.view(torch.int8)
    fp8, fp8_scale = convert.cast_e2m1fn_to_e4m3fn(packed, scale)
    ours = ref.dequantize_fp4(packed, scale, torch.float64)
    assert torch.equal(ours, ref.dequantize_fp8(fp8, fp8_scale, torch.float64))
    # and the GEMM dequantises the same way
    a = torch.randn(5, 128)
    q, s = ref.act_quant(a, 32, "ue8m0", torch.float8_e8m0fnu)
    out = ref.fp4_gemm(q, s, packed.view(torch.float4_e2m1fn_x2), scale, act_block_size=32, out_dtype=torch.float64)
    a_deq = q.double() * s.double().repeat_interleave(32, -1)
    torch.testing.assert_close(out, a_deq @ ours.T, rtol=1e-12, atol=1e-12)
    w8, s8 = quantize_fp8_block(w, block=32, ue8m0=True)
    out8 = ref.fp8_gemm(q, s, w8, e8m0_from_float(s8), block_size=32, out_dtype=torch.float64)
    w8_deq = w8.double() * s8.double().repeat_interleave(32, 0).repeat_interleave(32, 1)
    torch.testing.assert_close(out8, a_deq @ w8_deq.T, rtol=1e-12, atol=1e-12)


def test_hc_split_sinkhorn_equals_the_engines_hc_pre():
    from deepinfer_core.ops import native

    n, d, eps, iters = 4, 16, 1e-6, 20
    g = torch.Generator().manual_seed(0)
    streams = torch.randn(5, n, d, generator=g, dtype=torch.float64)
    fn = torch.randn((2 + n) * n, n * d, generator=g, dtype=torch.float64) * 0.1
    base = torch.randn((2 + n) * n, generator=g, dtype=torch.float64) * 0.3
    scale = torch.rand(3, generator=g, dtype=torch.float64) + 0.5
    flat = streams.flatten(1)
    mixes = F.linear(flat, fn) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + 1e-20)  # Block.hc_mixes
    pre, post, comb = ref.hc_split_sinkhorn(mixes, scale, base, n, iters, eps)
    post_e, comb_e, collapsed = native.hc_pre(streams, fn, base, scale, iters, eps, 1e-20)
    torch.testing.assert_close(post, post_e, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(comb, comb_e, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close((pre.unsqueeze(-1) * streams).sum(1), collapsed, rtol=1e-12, atol=1e-12)


def test_sparse_attn_is_a_softmax_with_a_sink_over_the_named_rows():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 3, 2, 8, generator=g, dtype=torch.float64)
    kv = torch.randn(1, 6, 8, generator=g, dtype=torch.float64)
    sink = torch.tensor([0.5, -1.0])
    idx = torch.tensor([[[0, -1, 2], [5, 1, -1], [-1, -1, 3]]], dtype=torch.int32)
    out = ref.sparse_attn(q, kv, sink, idx, 0.3)
    for m in range(3):
        rows = [int(i) for i in idx[0, m] if i >= 0]
        for h in range(2):
            logits = torch.stack([(q[0, m, h] * kv[0, r]).sum() * 0.3 for r in rows])
            p = logits.exp() / (logits.exp().sum() + torch.exp(sink[h].double()))
            want = (p.unsqueeze(-1) * kv[0, rows]).sum(0)
            torch.testing.assert_close(out[0, m, h], want, rtol=1e-12, atol=1e-12)


def test_stable_topk_puts_the_lowest_index_first_among_ties():
    x = torch.tensor([[0.0, 1.0, 0.0, 1.0, float("-inf"), 0.0, float("-inf")]])
    with ref.ReferenceMode():
        assert x.topk(5, dim=-1).indices.tolist() == [[1, 3, 0, 2, 5]]
        assert torch.topk(x, 7, sorted=False).indices.tolist() == [[1, 3, 0, 2, 5, 4, 6]]


# --- the release inventory ---------------------------------------------------------------------------


def test_the_inventory_of_model_py_is_the_releases():
    """README section 2: 96,085 tensors holding 510,286,023,000 bytes, by dtype F8_E4M3 357, I8 47,232,
    F8_E8M0 47,589, BF16 520, F32 387 (the vision tower is in; its RMSNorm weights are bf16 there)."""
    args = json.loads((ref.REFERENCE_DIR / "config.json").read_text())
    inventory = ref.release_inventory(args, max_seq_len=256)
    counts, nbytes = {}, {}
    for shape, dtype in inventory.values():
        counts[dtype] = counts.get(dtype, 0) + 1
        nbytes[dtype] = nbytes.get(dtype, 0) + torch.Size(shape).numel() * ref.BYTES[dtype]
    assert len(inventory) == 96_085
    assert counts == {torch.float8_e4m3fn: 357, torch.int8: 47_232, torch.float8_e8m0fnu: 47_589,
                      torch.bfloat16: 520, torch.float32: 387}
    assert sum(nbytes.values()) == 510_286_023_000
    # the README's rounded per-dtype figures
    assert [round(nbytes[d] / 1e9, p) for d, p in ((torch.float8_e4m3fn, 1), (torch.int8, 1),
                                                   (torch.float8_e8m0fnu, 1), (torch.bfloat16, 2),
                                                   (torch.float32, 2))] == [204.0, 278.6, 23.6, 3.95, 0.17]
    assert inventory["layers.1.engram.embed.weight"] == ((384_006_168, 256), torch.float8_e4m3fn)
    assert inventory["layers.14.engram.embed.scale"] == ((384_016_682, 8), torch.float8_e8m0fnu)
    assert inventory["layers.3.attn.wo_a.scale"] == ((256, 128), torch.float8_e8m0fnu)
    assert inventory["mtp.0.ffn.experts.127.w2.weight"] == ((5120, 1152), torch.int8)
    assert "mtp.0.embed.weight" not in inventory and "mtp.2.head.weight" not in inventory
    assert ref.engram_table_rows(args) == tuple(args["engram_num_embeddings"])


# --- the tiny model ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(TOKENIZER_DIR), config=transformers.PretrainedConfig())


def make_tiny_args(tokenizer) -> dict:
    """The tiny config (flat ``inference/config.json`` naming) for ``tokenizer``'s vocab."""
    args = dict(
        vocab_size=len(tokenizer), dim=64, moe_inter_dim=64, n_layers=6, n_mtp_layers=3, n_heads=2,
        n_routed_experts=8, n_shared_experts=1, n_activated_experts=2, score_func="sqrtsoftplus", route_scale=1.5,
        swiglu_limit=10.0, q_lora_rank=64, head_dim=64, rope_head_dim=16, norm_eps=1e-20, o_groups=2,
        o_lora_rank=32, window_size=8, kv_source_layers=[1, 3], index_source_layers=[1, 3, 5],
        original_seq_len=32, rope_theta=10000, rope_factor=4, beta_fast=32, beta_slow=1, index_n_heads=2,
        index_head_dim=32, index_topk=4, candidate_source_layer=3, candidate_topk_blocks=4, candidate_block_size=2,
        hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, engram_layer_ids=[1, 4], engram_vocab_size=1000,
        engram_max_ngram_size=3, engram_pad_id=2, engram_n_heads=2, engram_head_dim=64, dtype="fp8",
        expert_dtype="fp4", compress_rope_theta=160000, compress_ratios=[0, 2, 2, 1, 1, 1, 0, 0, 0],
        vision_n_layers=0, dspark_block_size=3, dspark_noise_token_id=4000, dspark_target_layer_ids=[3, 4, 5],
        dspark_markov_rank=32, dspark_n_routed_experts=4, dspark_n_activated_experts=2,
    )
    args["engram_num_embeddings"] = list(ref.engram_table_rows(args))
    engram = ref.load_reference_module("engram")
    args["engram_compressed_vocab_size"] = engram.build_compressed_token_map(tokenizer)[1]
    return args


@pytest.fixture(scope="module")
def tiny_args(tokenizer) -> dict:
    return make_tiny_args(tokenizer)


def _float_tensor(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    leaf = name.rsplit(".", 1)[-1]
    r = torch.randn(shape, generator=g)
    if name.endswith("norm.weight") or leaf in ("q_weight", "k_weight"):
        return 1 + 0.1 * r
    if leaf == "attn_sink":
        return 0.5 * r
    if leaf.startswith("hc_") and leaf.endswith("_fn"):
        return 0.05 * r
    if leaf.startswith("hc_"):
        return 0.3 * r + (0.5 if leaf.endswith("_scale") else 0.0)
    if leaf in ("bias", "bias_vl"):
        return 0.01 * r
    if name in ("embed.weight",) or name.endswith("markov_head.embed.weight"):
        return r
    return r * shape[-1] ** -0.5


def release_tensors(args: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors in the release layout for ``args``, from :func:`ref.release_inventory`."""
    inventory = ref.release_inventory(args, max_seq_len=MAX_SEQ_LEN)
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, (shape, dtype) in inventory.items():
        if dtype == torch.float8_e8m0fnu:
            continue  # made with its weight
        scale_name = name.removesuffix("weight") + "scale"
        if ".engram.embed." in name:  # rows of E4M3 with an E8M0 scale per 32
            out[name], out[scale_name] = ref.act_quant(torch.randn(shape, generator=g), 32, "ue8m0",
                                                       torch.float8_e8m0fnu)
        elif dtype == torch.float8_e4m3fn:
            w = torch.randn(shape, generator=g) * shape[1] ** -0.5
            q, s = quantize_fp8_block(w, block=32, ue8m0=True)
            out[name], out[scale_name] = q, e8m0_from_float(s)
        elif dtype == torch.int8:
            w = torch.randn(shape[0], 2 * shape[1], generator=g) * (2 * shape[1]) ** -0.5
            packed, s = quantize_fp4_block(w)
            out[name], out[scale_name] = packed.view(torch.int8), s
        else:
            out[name] = _float_tensor(name, shape, g).to(dtype)
    assert {n: (tuple(t.shape), t.dtype) for n, t in out.items()} == inventory
    return out


@pytest.fixture(scope="module")
def tiny_tensors(tiny_args) -> dict[str, torch.Tensor]:
    return release_tensors(tiny_args)


@pytest.fixture(scope="module")
def ids() -> list[int]:
    return torch.randint(3, 4000, (PROMPT_LEN,), generator=torch.Generator().manual_seed(7)).tolist()


def test_the_tiny_config_crosses_every_feature(tiny_args, tiny_tensors):
    names = set(tiny_tensors)
    for expected in ("layers.1.attn.compressor.wgate.weight", "layers.3.attn.compressor.wkv.weight",
                     "layers.1.attn.indexer.wk.weight", "layers.5.attn.indexer.wq_b.weight",
                     "layers.1.engram.embed.scale", "layers.4.engram.wkv.scale", "mtp.0.main_proj.scale",
                     "mtp.2.confidence_head.proj.weight", "mtp.2.markov_head.head.weight",
                     "layers.2.ffn.experts.7.w3.weight", "mtp.1.ffn.experts.3.w1.scale", "layers.0.attn.wo_a.scale"):
        assert expected in names, expected
    assert "layers.3.attn.compressor.wgate.weight" not in names  # ratio 1: no gate
    assert "layers.5.attn.indexer.wk.weight" not in names  # reindexes with layer 3's keys
    assert "layers.2.attn.indexer.wq_b.weight" not in names  # reuses layer 1's selection
    assert not any(n.startswith(("mtp.0.embed.", "mtp.2.head.")) for n in names)
    assert tiny_args["engram_compressed_vocab_size"] < tiny_args["vocab_size"]


def test_loading_is_strict(tiny_args, tiny_tensors, tokenizer):
    missing = dict(tiny_tensors)
    del missing["layers.3.attn.indexer.k_norm.weight"]
    with pytest.raises(ValueError, match=r"missing \(1\).*layers\.3\.attn\.indexer\.k_norm\.weight"):
        ref.load_reference(tiny_args, missing, tokenizer, quant=False, max_seq_len=MAX_SEQ_LEN)
    extra = {**tiny_tensors, "mtp.0.embed.weight": tiny_tensors["embed.weight"]}  # tied: not in the release
    with pytest.raises(ValueError, match=r"unexpected \(1\).*mtp\.0\.embed\.weight"):
        ref.load_reference(tiny_args, extra, tokenizer, quant=True, max_seq_len=MAX_SEQ_LEN)
    bad = {**tiny_tensors, "layers.0.attn.wq_a.scale": tiny_tensors["layers.0.attn.wq_a.scale"][:1]}
    with pytest.raises(ValueError, match=r"wq_a"):
        ref.load_reference(tiny_args, bad, tokenizer, quant=True, max_seq_len=MAX_SEQ_LEN)


def test_loaded_parameters_hold_what_each_mode_promises(tiny_args, tiny_tensors, tokenizer):
    fp = ref.load_reference(tiny_args, tiny_tensors, tokenizer, quant=False, dtype=torch.float64,
                            max_seq_len=MAX_SEQ_LEN)
    kept = {n for n, p in fp.named_parameters() if p.dtype != torch.float64}
    assert kept == {"layers.1.engram.embed.weight", "layers.1.engram.embed.scale",
                    "layers.4.engram.embed.weight", "layers.4.engram.embed.scale"}
    assert fp.layers[2].ffn.experts[0].w1.weight.dtype == torch.float64
    q = ref.load_reference(tiny_args, tiny_tensors, tokenizer, quant=True, max_seq_len=MAX_SEQ_LEN)
    attn, expert = q.layers[1].attn, q.layers[1].ffn.experts[5].w2
    assert attn.wq_a.weight.dtype == torch.float8_e4m3fn and attn.wq_a.weight.scale is attn.wq_a.scale
    assert expert.weight.dtype == torch.float4_e2m1fn_x2 and expert.weight.scale.shape == (64, 2)
    assert attn.wo_a.weight.dtype == torch.float32 and attn.compressor.wkv.weight.dtype == torch.float32
    assert q.head.weight.dtype == torch.float32 and q.layers[1].hc_attn_fn.dtype == torch.float32
    # wo_a is dequantised as convert.py does; in both modes the same values
    torch.testing.assert_close(fp.layers[1].attn.wo_a.weight.float(), attn.wo_a.weight, rtol=0, atol=0)
    assert fp.mtp[2].head is fp.head and fp.mtp[0].embed is fp.embed


def _rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per position: max |a - b| over the vocab, relative to b's largest logit."""
    return (a - b).abs().amax(-1) / b.abs().max()


def test_float64_decode_equals_prefill_with_the_index_key_patch(tiny_args, tiny_tensors, tokenizer, ids,
                                                               record_property):
    """Quantisation off, float64: prefilling 13 of 40 tokens and decoding the rest gives every position's
    logits within 1e-10 of prefilling all 40 (the window of 8, ratio-2 groups left open across steps,
    candidate blocks and the index top-k are all crossed). Without the patch, model.py's decode differs:
    its ratio-2 indexer reads the ratio-1 source's keys on every step that completes no group."""
    t0 = time.perf_counter()
    model = ref.load_reference(tiny_args, tiny_tensors, tokenizer, quant=False, dtype=torch.float64,
                               max_seq_len=MAX_SEQ_LEN)
    full = ref.teacher_forced_logits(model, ids, len(ids))
    part = ref.teacher_forced_logits(model, ids, PREFILL)
    assert full.shape == (PROMPT_LEN, tiny_args["vocab_size"]) and torch.isfinite(full).all()
    assert full.std() > 0.1  # not a degenerate model
    rt = model.reference_module.shared_attn  # after the last decode step: what the features did
    assert rt.candidates.shape[-1] == PROMPT_LEN and 0 < rt.candidates.sum() < PROMPT_LEN
    assert rt.topk_idxs.shape[-1] == tiny_args["index_topk"]
    rel = _rel(part, full)
    record_property("decode_vs_prefill_float64", float(rel.max()))
    assert rel.max() <= 1e-10, rel

    unpatched = ref.load_reference(tiny_args, tiny_tensors, tokenizer, quant=False, dtype=torch.float64,
                                   max_seq_len=MAX_SEQ_LEN, patch_index_k=False)
    assert not unpatched.reference_module.index_k_patched
    assert torch.equal(ref.teacher_forced_logits(unpatched, ids, len(ids)), full)  # prefill: the same
    bad = _rel(ref.teacher_forced_logits(unpatched, ids, PREFILL), full)
    record_property("decode_vs_prefill_unpatched", float(bad.max()))
    assert bad[:PREFILL].max() <= 1e-10 and bad[PREFILL + 1 :].max() > 1e-3, bad
    print(f"float64 decode vs prefill: patched {float(rel.max()):.2e}, unpatched {float(bad.max()):.2e} "
          f"({time.perf_counter() - t0:.1f}s)")


def test_quantised_float32_runs_and_decode_agrees_with_prefill(tiny_args, tiny_tensors, tokenizer, ids,
                                                              record_property):
    """The quantised reference (FP8 activations, FP4 experts, FP8 window KV, FP4 compressed KV and index
    keys) in float32: finite logits; the first decoded position equals the prefill's within 1e-3 of the
    logit scale, and most others do too (a float32 summation-order difference can flip an E4M3/e2m1
    rounding, which a random model does not absorb: measured, not asserted beyond the first token)."""
    model = ref.load_reference(tiny_args, tiny_tensors, tokenizer, quant=True, dtype=torch.float32,
                               max_seq_len=MAX_SEQ_LEN)
    full = ref.teacher_forced_logits(model, ids, len(ids))
    part = ref.teacher_forced_logits(model, ids, PREFILL)
    assert torch.isfinite(full).all() and torch.isfinite(part).all()
    rel = _rel(part, full)
    share = float((rel <= 1e-3).double().mean())
    record_property("decode_vs_prefill_quantised_share_1e-3", share)
    print(f"quantised float32 decode vs prefill: {share:.0%} of positions within 1e-3, max {float(rel.max()):.2e}")
    assert rel[: PREFILL + 1].max() <= 1e-3, rel
    # the quantisation steps are on: the unquantised run differs
    plain = ref.teacher_forced_logits(
        ref.load_reference(tiny_args, tiny_tensors, tokenizer, quant=False, max_seq_len=MAX_SEQ_LEN), ids, len(ids))
    assert _rel(plain, full).max() > 1e-3

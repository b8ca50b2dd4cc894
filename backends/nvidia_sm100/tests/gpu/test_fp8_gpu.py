"""The block-FP8 Triton kernels on the GPU at DeepSeek-V4-Flash shapes against the cpu_ref reference
(float64 on the CPU), their capture in a CUDA graph, and the engine with ``quantization="fp8"``."""

from __future__ import annotations

import pytest
import torch
from gpu_support import BACKEND, V4_FLASH_WIDTHS, gpu_marks

from deepinfer_core.plugins import build_op_table
from deepinfer_core.quant.fp8 import quantize_act_fp8, quantize_fp8_block
from deepinfer_core.testing import conformance as conf
from deepinfer_core.testing.compare import assert_close

pytestmark = gpu_marks()

#: V4-Flash projections (N, K): wq_a, wq_b, wkv, wo_b, shared w13, shared w2, and a ragged one
LINEAR_SHAPES = [(1024, 4096), (32768, 1024), (512, 4096), (4096, 8192), (4096, 4096), (4096, 2048), (1000, 4100)]


@pytest.fixture(scope="module")
def reference():
    return conf.reference_op_table()


@pytest.fixture(scope="module")
def table(device):
    return build_op_table(BACKEND, dtype=torch.bfloat16, device=device, model_config=V4_FLASH_WIDTHS,
                          allow_reference_fallback=True)


def _weight(g: torch.Generator, *shape: int):
    """Random E4M3 weights with their tile scales, made where ``g`` is (256 V4-Flash experts on the CPU took
    most of the suite's slowest test), one expert at a time: the float32 stack of 256 experts' gate/up is
    16 GiB before quantisation, beyond what one of the suite's workers may hold."""
    if len(shape) == 2:
        return quantize_fp8_block(torch.randn(*shape, generator=g, device=g.device) * shape[-1] ** -0.5)
    q, s = _weight(g, *shape[1:])
    qs, ss = q.new_empty(shape), s.new_empty(shape[0], *s.shape)
    qs[0], ss[0] = q, s
    for e in range(1, shape[0]):
        qs[e], ss[e] = _weight(g, *shape[1:])
    return qs, ss


def _args64(args):
    """Activations and routing weights in float64; E4M3 weights stay E4M3 (256 experts in float64 would
    take 51 GB)."""
    return tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dtype != torch.float8_e4m3fn
                 else a for a in args)


def test_fp8_ops_are_served_by_a_kernel(table):
    """The Triton kernels (or DeepGEMM where it is installed and passed its self-check), never torch."""
    for op in ("linear_fp8", "moe_experts_fp8"):
        fn = table.chosen[op].fn
        assert fn.__module__ in ("deepinfer_nvidia_sm100.fp8_ops", "deepinfer_nvidia_sm100.external"), op
        assert not fn.__name__.endswith("_torch"), op


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
@pytest.mark.parametrize("m, k", [(5, 4096), (200, 4100)])
def test_activation_quantisation_matches_torch_bit_for_bit(m, k, dtype, device):
    """The compiled quantisation kernel: E4M3 values and scales equal ``quantize_act_fp8``'s exactly (an
    all-zero row, a massive-activation channel, a partial last group, E4M3 subnormals)."""
    from deepinfer_nvidia_sm100 import fp8_ops

    g = torch.Generator().manual_seed(m + k)
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4
    x[:, 3] *= 30.0
    x[:, 130] = 1e-5  # far below its group's amax / 448 / 64: an E4M3 subnormal or zero
    x[0] = 0.0
    x = x.to(dtype)
    want_q, want_s = quantize_act_fp8(x)
    for mn_major in (False, True):
        got_q, got_s = fp8_ops.quantize_act(x.to(device), mn_major=mn_major)
        if mn_major:  # DeepGEMM's SM90 layout: column by column, each padded to 16 bytes
            assert got_s.stride() == (1, -(-m // 4) * 4)
        assert torch.equal(got_s.cpu(), want_s)
        got_bits, want_bits = got_q.cpu().view(torch.uint8), want_q.view(torch.uint8)
        bad = (got_bits != want_bits).nonzero()[:8].tolist()
        assert not bad, [(r, c, float(x[r, c]), float(want_s[r, c // 128]), int(got_bits[r, c]),
                          int(want_bits[r, c])) for r, c in bad]


def test_activation_quantisation_into_slab_rows(device):
    """The masked MoE's first operand: token rows quantised straight into their pairs' rows of the expert
    slabs, scales MN-major per slab; a pair whose row is past the slabs skipped, the other rows untouched;
    equal to the whole-tensor kernel's rows."""
    from deepinfer_nvidia_sm100 import fp8_ops

    g = torch.Generator(device).manual_seed(7)
    tokens, k, slabs, slab_m, d = 50, 6, 8, 128, 4096 + 128
    x = torch.randn(tokens, d, generator=g, device=device).bfloat16()
    src = torch.arange(tokens * k, device=device) // k
    dst = torch.randperm(slabs * slab_m, generator=g, device=device)[: tokens * k]
    dst[::7] = slabs * slab_m
    q = torch.zeros(slabs * slab_m, d, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    s = fp8_ops.mn_major_scales(slab_m, d // 128, device, slabs=slabs)
    s.fill_(-1.0)
    fp8_ops.quantize_act_rows(x, src, dst, q, s)
    want_q, want_s = fp8_ops.quantize_act(x)
    keep = dst < slabs * slab_m
    rows, tok = dst[keep], src[keep]
    flat_s = s.reshape(slabs * slab_m, -1)
    assert torch.equal(q.view(torch.uint8)[rows], want_q.view(torch.uint8)[tok])
    assert torch.equal(flat_s[rows], want_s[tok])
    chosen = torch.zeros(slabs * slab_m, dtype=torch.bool, device=device)
    chosen[rows] = True
    assert (q.view(torch.uint8)[~chosen] == 0).all() and (flat_s[~chosen] == -1).all()


@pytest.mark.parametrize("m, inter", [(3, 2048), (300, 2048), (77, 300)])
def test_swiglu_quantisation_matches_torch(m, inter, device):
    """SwiGLU of bfloat16 gate/up rows and its quantisation in one launch (the DeepGEMM MoE's h): the
    scales of ``quantize_act_fp8`` on ``native.swiglu`` in float32, and its E4M3 values but for the odd
    one a float32 rounding of the sigmoid moves across a tie (one E4M3 step at most)."""
    from deepinfer_nvidia_sm100 import fp8_ops

    from deepinfer_core.ops import native
    from deepinfer_core.quant.fp8 import dequantize_act_fp8

    g = torch.Generator().manual_seed(m + inter)
    gu = (torch.randn(m, 2 * inter, generator=g) * torch.logspace(-3, 1, m).unsqueeze(1)).bfloat16()
    gu[0, :5] = 1e4  # past the clamp
    want_q, want_s = quantize_act_fp8(native.swiglu(gu.float(), 10.0))
    q, s = fp8_ops.swiglu_quantize(gu.to(device), 10.0)
    q2, s2 = fp8_ops.swiglu_quantize(gu.to(device), 10.0, mn_major=True)  # DeepGEMM's layout, same values
    assert s2.stride() == (1, -(-m // 4) * 4)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, s)
    q, s = q.cpu(), s.cpu()
    assert q.shape == want_q.shape and s.shape == want_s.shape
    torch.testing.assert_close(s, want_s, rtol=1e-6, atol=0)
    assert (q.view(torch.uint8) != want_q.view(torch.uint8)).float().mean() < 1e-3
    got, want = dequantize_act_fp8(q, s), dequantize_act_fp8(want_q, want_s)
    step = want.abs() / 8 + want_s.repeat_interleave(128, -1)[:, :inter] * 2.0**-9
    assert ((got - want).abs() <= step).all()


def test_swiglu_quantisation_of_chosen_rows_writes_those_rows_only(device):
    """The masked MoE's h: rows ``rows`` of gate/up into the same rows of the slab, a row index past the
    slab (a trash pair) skipped; equal to the whole-tensor kernel on those rows, the others untouched."""
    from deepinfer_nvidia_sm100 import fp8_ops

    g = torch.Generator(device).manual_seed(5)
    slab, inter = 300, 2048 + 128
    gu = torch.randn(slab, 2 * inter, generator=g, device=device).bfloat16()
    rows = torch.randperm(slab, generator=g, device=device)[:100]
    rows[::9] = slab
    want_q, want_s = fp8_ops.swiglu_quantize(gu, 10.0)
    chosen = torch.zeros(slab, dtype=torch.bool, device=device)
    chosen[rows[rows < slab]] = True
    row_major = torch.full((slab, inter // 128), -1.0, device=device)
    slabs = fp8_ops.mn_major_scales(slab // 3, inter // 128, device, slabs=3).fill_(-1.0)  # DeepGEMM's layout
    for s in (row_major, slabs):
        q = torch.zeros(slab, inter, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
        fp8_ops.swiglu_quantize_rows(gu, 10.0, rows, q, s)
        flat = s.reshape(slab, -1)
        assert torch.equal(q.view(torch.uint8)[chosen], want_q.view(torch.uint8)[chosen])
        assert torch.equal(flat[chosen], want_s[chosen])
        assert (q.view(torch.uint8)[~chosen] == 0).all() and (flat[~chosen] == -1).all()


@pytest.mark.parametrize("tokens, k, groups", [(1, 6, 256), (64, 6, 256), (37, 8, 16)])
def test_masked_moe_layout_in_one_launch_matches_torch(tokens, k, groups, device):
    """The masked MoE's layout kernel: the torch layout's slab rows, pairs per expert and merged weights
    (ids outside [0, G) to the trash, a token's repeated expert once), and each pair's token."""
    from deepinfer_nvidia_sm100 import external, fp8_ops

    g = torch.Generator(device).manual_seed(tokens + k)
    ids = torch.randint(0, groups, (tokens, k), generator=g, device=device, dtype=torch.int32)
    ids[0, -1], ids[-1, 0] = -1, groups
    weights = torch.rand(tokens, k, generator=g, device=device)
    want = external.masked_layout(ids, weights, groups, 128)
    dest, counts, merged, token = fp8_ops.masked_layout(ids, weights, groups, 128)
    assert torch.equal(dest, want[0]) and torch.equal(counts, want[1])
    torch.testing.assert_close(merged, want[2], rtol=1e-6, atol=0)
    assert torch.equal(token, torch.arange(tokens * k, device=device) // k)


def test_moe_combine_sums_each_tokens_rows_in_one_launch(device):
    """The DeepGEMM MoE's combine: each token's k rows (gathered by row, a slot without one adds 0) weighted
    and summed in float32; rows nothing points at (padding, NaN here) are never read."""
    from deepinfer_nvidia_sm100 import external, fp8_ops

    g = torch.Generator(device).manual_seed(3)
    tokens, k, d = 37, 6, 4096 + 40  # a ragged last column block
    rows = torch.randn(300, d, generator=g, device=device).bfloat16()
    rows[290:] = float("nan")
    row_of = torch.randint(0, 290, (tokens * k,), generator=g, device=device)
    row_of[::7] = 300  # no row
    weights = torch.rand(tokens * k, generator=g, device=device)
    got = fp8_ops.combine_rows(rows, row_of, weights, tokens, k, torch.bfloat16)
    want = external.combine_rows_torch(rows, row_of, weights, tokens, k, torch.float32)
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, d) and not torch.isnan(got).any()
    torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=8e-3)


@pytest.mark.parametrize("m", [1, 64, 200])
@pytest.mark.parametrize("n, k", LINEAR_SHAPES)
def test_linear_fp8_at_v4_flash_shapes(n, k, m, reference, device):
    from deepinfer_nvidia_sm100 import fp8_ops

    g = torch.Generator().manual_seed(n + k + m)
    x = torch.randn(m, k, generator=g)
    x[..., 3] *= 30.0
    w, s = _weight(g, n, k)
    want = reference.linear_fp8(*_args64((x.bfloat16(), w, s)))
    got = fp8_ops.linear_fp8(x.bfloat16().to(device), w.to(device), s.to(device))
    assert got.dtype == torch.bfloat16
    assert_close(got.cpu(), want, dtype=torch.bfloat16, name=f"linear_fp8 {m}x{k} -> {n}")
    got32 = fp8_ops.linear_fp8(x.to(device), w.to(device), s.to(device))
    assert_close(got32.cpu(), reference.linear_fp8(*_args64((x, w, s))), dtype=torch.float32,
                 name=f"linear_fp8 float32 {m}x{k} -> {n}")


def _moe_case(g: torch.Generator, tokens: int, experts: int = 256, top_k: int = 6, d: int = 4096, inter: int = 2048):
    dev = g.device
    x = torch.randn(tokens, d, generator=g, device=dev).bfloat16()
    w13, s13 = _weight(g, experts, 2 * inter, d)
    w2, s2 = _weight(g, experts, d, inter)
    ids = torch.stack([torch.randperm(experts, generator=g, device=dev)[:top_k] for _ in range(tokens)])
    ids[0, :2] = -1  # experts of another rank
    weights = torch.rand(tokens, top_k, generator=g, device=dev) + 0.2
    return x, w13, s13, w2, s2, ids, weights, 10.0


@pytest.mark.parametrize("tokens", [3, 12])
def test_moe_experts_fp8_256_experts_top6(tokens, reference, device):
    from deepinfer_nvidia_sm100 import fp8_ops

    args = _moe_case(torch.Generator(device).manual_seed(tokens), tokens)
    want = reference.moe_experts_fp8(*_args64(tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)))
    got = fp8_ops.moe_experts_fp8(*args)
    assert got.dtype == torch.bfloat16
    assert_close(got.cpu(), want, dtype=torch.bfloat16, name=f"moe_experts_fp8 {tokens} tokens")


def test_moe_experts_fp8_tiles_for_many_pairs_give_the_same_sums(device):
    """Above 4096 (token, expert) pairs the Triton FP8 MoE takes other tiles (``moe_tiles``); each output is
    still the same float32 sum in the same K order, so it equals the tiles the reference tests above cover."""
    from deepinfer_nvidia_sm100 import fp8_ops

    args = _moe_case(torch.Generator(device).manual_seed(700), 700)
    fewer = fp8_ops.moe_tiles(4096)
    assert fp8_ops.moe_tiles(700 * 6) != fewer
    assert torch.equal(fp8_ops.moe_experts_fp8(*args), fp8_ops.moe_experts_fp8_tiled(*args, tiles=fewer))


def _deep_gemm_moe(table):
    from deepinfer_nvidia_sm100 import external

    if table.chosen["moe_experts_fp8"].fn is not external.deep_gemm_moe_experts_fp8:
        pytest.skip("DeepGEMM does not serve moe_experts_fp8 here (not installed, or its self-check failed)")
    return external.deep_gemm_moe_experts_fp8


@pytest.mark.parametrize("tokens,contiguous", [(1, False), (12, False), (64, False), (80, False), (80, True)],
                         ids=["masked1", "masked12", "masked64", "triton80", "contiguous80"])
def test_deep_gemm_moe_experts_fp8_256_experts_top6(tokens, contiguous, table, reference, device, monkeypatch):
    """Up to MASKED_MAX_TOKENS tokens the masked grouped GEMM, above it the Triton FP8 MoE, or the contiguous
    GEMM when opted in. The library rounds gate/up to bfloat16 before h is quantised to E4M3 (as
    DeepSeek's inference code does; the catalogue keeps float32): an h element near an E4M3 rounding
    boundary moves one E4M3 step (2^-3), which elementwise bfloat16 tolerances cannot absorb. The same
    computation with exact GEMMs and those roundings (on the CPU, 32 experts, 1 to 64 tokens) is 1.4-1.7%
    off the reference in relative norm, cosine 0.99985-0.99990; a pair in the wrong expert's rows is off
    by O(1)."""
    from deepinfer_nvidia_sm100 import external

    monkeypatch.setattr(external, "_contiguous_fp8_moe", lambda: contiguous)
    moe = _deep_gemm_moe(table)
    args = _moe_case(torch.Generator(device).manual_seed(tokens), tokens)
    want = reference.moe_experts_fp8(*_args64(tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)))
    got = moe(*args).cpu().double()
    assert got.shape == want.shape and not torch.isnan(got).any()
    assert (got - want).norm() / want.norm() < 0.03
    assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.9995


def test_deep_gemm_masked_moe_captures_in_a_cuda_graph(table, device):
    moe = _deep_gemm_moe(table)
    g = torch.Generator(device).manual_seed(5)
    args = list(_moe_case(g, 16))
    eager = moe(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe(*args)
    args[0].copy_(torch.randn(args[0].shape, generator=g, device=device).bfloat16())
    args[5].copy_(torch.stack([torch.randperm(256, generator=g, device=device)[:6] for _ in range(16)]))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, moe(*args))  # new tokens and routing, read from the same buffers
    assert not torch.equal(captured, eager)


def test_fp8_ops_capture_in_a_cuda_graph(device):
    from deepinfer_nvidia_sm100 import fp8_ops

    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 4096, generator=g).bfloat16().to(device)
    w, s = (t.to(device) for t in _weight(g, 1024, 4096))
    moe = [a.to(device) if isinstance(a, torch.Tensor) else a for a in _moe_case(g, 8, experts=16)]
    moe[0] = x
    eager = (fp8_ops.linear_fp8(x, w, s), fp8_ops.moe_experts_fp8(*moe))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = (fp8_ops.linear_fp8(x, w, s), fp8_ops.moe_experts_fp8(*moe))
    x.copy_(torch.randn(8, 4096, generator=g).bfloat16().to(device))
    graph.replay()
    torch.cuda.synchronize()
    again = (fp8_ops.linear_fp8(x, w, s), fp8_ops.moe_experts_fp8(*moe))
    for a, b in zip(captured, again):
        assert torch.equal(a, b)
    assert not torch.equal(captured[0], eager[0])


def test_engine_with_fp8_weights_on_the_gpu():
    from deepinfer_core.default_model import v4_model_path
    from deepinfer_core.entrypoints.llm import LLM
    from deepinfer_core.sampling.params import SamplingParams

    prompts = ["def fibonacci(n):", "The quick brown fox", "import os, sys", "class Node:"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    v4 = str(v4_model_path())  # block-FP8 quantisation of a bf16 checkpoint: V4's path
    base = LLM(v4, backend=BACKEND, dtype="bfloat16", max_num_seqs=4, enforce_eager=True)
    want = base.generate(prompts, params, use_tqdm=False)
    del base
    fp8 = LLM(v4, backend=BACKEND, dtype="bfloat16", max_num_seqs=4, quantization="fp8")
    got = fp8.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 16 for o in got)
    same = sum(a.outputs[0].token_ids[:4] == b.outputs[0].token_ids[:4] for a, b in zip(want, got))
    assert same >= 2, [(a.outputs[0].token_ids, b.outputs[0].token_ids) for a, b in zip(want, got)]

"""The Triton FP4 grouped MoE (``triton_ops.moe_experts_fp4``; ``DEEPINFER_NVIDIA_FP4_TRITON=0`` turns it off)
called directly on the GPU at DeepSeek-V4-Flash shapes (hidden 4096, moe_inter 2048, 256 experts top-6;
1, 64 and 300 tokens: 16- and 64-row blocks), against the core's native body on the same GPU in float32
on the same (rounded) tokens, and its capture in a CUDA graph; and DeepSeek-V4.1's ops on the same kernels
(activations quantised per 32 channels, FP4 and float experts) at V4.1 widths (hidden 5120, moe_inter
2304, 384 experts top-6).

Weights: random e2m1 codes in both nibbles with ue8m0 scales (w13 2^-9, w2 2^-7, times 2^-1 .. 2^1 per row
and per 32-input group), so that the outputs are O(1) as the suite's tolerances assume.
Tolerances: W4A16 (``quant_act=False``) the suite's per-dtype ones (``deepinfer_core.testing.compare``);
DeepSeek's numerics (``quant_act=True``) the conformance suite's rule for them (all but 2% of the elements
within the dtype's tolerance, at least FP8_REQUANT's, and the cosine: a bfloat16 rounding of gate/up or h
may move an E4M3 step of h, which shifts its token's outputs), and in bfloat16 against the native body in
bfloat16 too, which rounds where the kernel rounds: at most 1% of the elements differing at all.
Run on the CPU under Triton's interpreter at these widths with 8 experts and 1 token, the test passed;
the native body in bfloat16 against the float32 reference there: 0.17% outside, cosine 0.99974.
"""

from __future__ import annotations

import pytest
import torch
from gpu_support import gpu_marks, run_without_host_sync

from deepinfer_core.ops import native
from deepinfer_core.testing.compare import Tolerance, assert_close, tolerance_for
from deepinfer_core.testing.conformance import FP8_REQUANT

pytestmark = gpu_marks()

HIDDEN, INTER, EXPERTS, TOP_K = 4096, 2048, 256, 6
SWIGLU_LIMIT = 10.0
#: the scales' base exponents: gate/up O(1) over 4096 inputs, the output O(1) over 2048
W13_BASE, W2_BASE = -9, -7


def _fp4(g: torch.Generator, device, n: int, k: int, base: int,
         experts: int = EXPERTS) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed e2m1 uint8 [E, n, k/2] and ue8m0 scales [E, n, k/32], built on the device."""
    packed = torch.randint(0, 256, (experts, n, k // 2), dtype=torch.uint8, device=device, generator=g)
    row = torch.randint(-1, 2, (experts, n, 1), dtype=torch.int16, device=device, generator=g)
    group = torch.randint(-1, 2, (experts, n, k // 32), dtype=torch.int16, device=device, generator=g)
    scale = (127 + base + row + group).to(torch.uint8).view(torch.float8_e8m0fnu)
    return packed, scale


@pytest.fixture(scope="module")
def experts(device):
    """w13, s13, w2, s2 of 256 V4-Flash experts (3.2 GB)."""
    g = torch.Generator(device=device).manual_seed(0)
    w13, s13 = _fp4(g, device, 2 * INTER, HIDDEN, W13_BASE)
    w2, s2 = _fp4(g, device, HIDDEN, INTER, W2_BASE)
    return w13, s13, w2, s2


def _routing(tokens: int, seed: int, device, hidden: int = HIDDEN, experts: int = EXPERTS):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:TOP_K] for _ in range(tokens)])
    ids[0, :2] = -1  # experts of another rank
    if tokens > 2:
        ids[2] = -1
    weights = torch.rand(tokens, TOP_K, generator=g) + 0.2
    return x.to(device), ids.to(device), weights.to(device)


def _check_requant(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    own = tolerance_for(dtype)
    tol = Tolerance(max(own.atol, FP8_REQUANT.atol), max(own.rtol, FP8_REQUANT.rtol), min(own.min_cosine, 1 - 2e-4))
    a, e = got.double(), want.double()
    outside = (a - e).abs() > tol.atol + tol.rtol * e.abs()
    assert outside.double().mean().item() <= 0.02, f"{name}: {int(outside.sum())} of {outside.numel()} outside"
    cosine = torch.nn.functional.cosine_similarity(a.flatten(), e.flatten(), dim=0).item()
    assert cosine >= tol.min_cosine, f"{name}: cosine {cosine}"


@pytest.mark.parametrize("quant_act", [False, True], ids=["w4a16", "w4a8_deepseek"])
@pytest.mark.parametrize("tokens", [1, 64, 300])
def test_fp4_moe_at_v4_flash_shapes(tokens, quant_act, experts, device):
    from deepinfer_nvidia_sm100 import triton_ops

    w13, s13, w2, s2 = experts
    x, ids, weights = _routing(tokens, tokens, device)
    for dtype in (torch.bfloat16, torch.float32):
        name = f"moe_experts_fp4 {tokens} tokens {dtype} quant_act={quant_act}"
        xd = x.to(dtype)
        # the float32 reference on the same (rounded) tokens: with quant_act a bfloat16 rounding of x moves
        # E4M3 steps of its quantisation (cosine 0.9992 to the unrounded tokens', at these shapes)
        want = native.moe_experts_fp4(xd.float(), w13, s13, w2, s2, ids, weights, SWIGLU_LIMIT, quant_act)
        assert 0.5 < want.abs().max().item() < 20  # outputs O(1): the tolerances mean what they say
        got = triton_ops.moe_experts_fp4(xd, w13, s13, w2, s2, ids, weights, SWIGLU_LIMIT, quant_act)
        assert got.dtype == dtype and got.shape == x.shape
        if tokens > 2:  # routed to no local expert
            assert torch.equal(got[2], torch.zeros_like(got[2])), name
        if not quant_act:
            assert_close(got.cpu(), want.cpu(), dtype=dtype, name=name)
            continue
        _check_requant(got.cpu(), want.cpu(), dtype, name)
        if dtype != torch.float32:  # (in float32 that is ``want``, and nothing is rounded: sums differ in ulps)
            same = native.moe_experts_fp4(xd, w13, s13, w2, s2, ids, weights, SWIGLU_LIMIT, True)
            differing = (got != same).double().mean().item()
            assert differing <= 0.01, f"{name}: {differing:.2%} differ from the native body in {dtype}"


def test_fp4_moe_captures_in_a_cuda_graph(experts, device):
    """Captured and replayed on new tokens and new routing (written in place), both numerics: the same
    bits as eager calls; and no call waits for the device."""
    from deepinfer_nvidia_sm100 import triton_ops

    w13, s13, w2, s2 = experts
    x, ids, weights = _routing(64, 1, device)
    x = x.bfloat16()

    def step():
        return [triton_ops.moe_experts_fp4(x, w13, s13, w2, s2, ids, weights, SWIGLU_LIMIT, q) for q in (False, True)]

    eager = step()  # compiles outside the capture
    run_without_host_sync(step)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    x2, ids2, weights2 = _routing(64, 2, device)
    x.copy_(x2.bfloat16())
    ids.copy_(ids2)
    weights.copy_(weights2)
    graph.replay()
    torch.cuda.synchronize()
    again = step()
    for got, want in zip(captured, again):
        assert torch.equal(got, want)
    assert not torch.equal(captured[0], eager[0])


# --- DeepSeek-V4.1: activations quantised per 32 channels ------------------------------------------
V41_HIDDEN, V41_INTER, V41_EXPERTS, V41_BLOCK = 5120, 2304, 384, 32
#: experts of the float-weight op (bfloat16 experts at V4.1 widths: 71 MB each)
V41_FLOAT_EXPERTS = 32


@pytest.fixture(scope="module")
def v41_experts(device):
    """w13, s13, w2, s2 of 384 V4.1-Flash experts (6.8 GB)."""
    g = torch.Generator(device=device).manual_seed(41)
    w13, s13 = _fp4(g, device, 2 * V41_INTER, V41_HIDDEN, W13_BASE, V41_EXPERTS)
    w2, s2 = _fp4(g, device, V41_HIDDEN, V41_INTER, W2_BASE, V41_EXPERTS)
    return w13, s13, w2, s2


@pytest.mark.parametrize("tokens", [1, 64, 300])
def test_v41_quant_act_experts_at_v41_shapes(tokens, v41_experts, device):
    """``moe_experts_fp4_quant_act`` (FP4 experts) and ``moe_experts_quant_act`` (the first 32 experts
    dequantised to the dtype) with V4.1's 32-channel activation groups: the float32 native body on the same
    (rounded) tokens within the quant_act rule, and in bfloat16 the native body in bfloat16 on all but 1%."""
    from deepinfer_nvidia_sm100 import triton_ops

    from deepinfer_core.quant.fp4 import dequantize_fp4_block

    w13, s13, w2, s2 = v41_experts
    x, ids, weights = _routing(tokens, tokens, device, V41_HIDDEN, V41_EXPERTS)
    few = V41_FLOAT_EXPERTS
    _, few_ids, _ = _routing(tokens, tokens, device, V41_HIDDEN, few)
    for dtype in (torch.bfloat16, torch.float32):
        xd = x.to(dtype)
        w13f = dequantize_fp4_block(w13[:few], s13[:few].float(), dtype)
        w2f = dequantize_fp4_block(w2[:few], s2[:few].float(), dtype)
        calls = {
            "moe_experts_fp4_quant_act": ((w13, s13, w2, s2, ids), (w13, s13, w2, s2, ids)),
            "moe_experts_quant_act": ((w13f, w2f, few_ids), (w13f.float(), w2f.float(), few_ids)),
        }
        for op, (kernel_args, ref_args) in calls.items():
            name = f"{op} {tokens} tokens {dtype}"
            want = getattr(native, op)(xd.float(), *ref_args, weights, SWIGLU_LIMIT, V41_BLOCK)
            assert 0.5 < want.abs().max().item() < 40, name  # outputs O(1): the tolerances mean what they say
            got = getattr(triton_ops, op)(xd, *kernel_args, weights, SWIGLU_LIMIT, V41_BLOCK)
            assert got.dtype == dtype and got.shape == x.shape, name
            if tokens > 2:
                assert torch.equal(got[2], torch.zeros_like(got[2])), name
            _check_requant(got.cpu(), want.cpu(), dtype, name)
            if dtype != torch.float32:
                same = getattr(native, op)(xd, *kernel_args, weights, SWIGLU_LIMIT, V41_BLOCK)
                differing = (got != same).double().mean().item()
                assert differing <= 0.01, f"{name}: {differing:.2%} differ from the native body in {dtype}"


def test_v41_quant_act_experts_capture_in_a_cuda_graph(v41_experts, device):
    """Both V4.1 ops captured and replayed on new tokens and routing: eager's bits, no host wait."""
    from deepinfer_nvidia_sm100 import triton_ops

    w13, s13, w2, s2 = v41_experts
    few = V41_FLOAT_EXPERTS
    g = torch.Generator(device=device).manual_seed(3)
    w13f = torch.randn(few, 2 * V41_INTER, V41_HIDDEN, device=device, generator=g).bfloat16() * 0.02
    w2f = torch.randn(few, V41_HIDDEN, V41_INTER, device=device, generator=g).bfloat16() * 0.02
    x, ids, weights = _routing(64, 1, device, V41_HIDDEN, V41_EXPERTS)
    x = x.bfloat16()
    few_ids = torch.where(ids >= 0, ids % few, ids)

    def step():
        return [triton_ops.moe_experts_fp4_quant_act(x, w13, s13, w2, s2, ids, weights, SWIGLU_LIMIT, V41_BLOCK),
                triton_ops.moe_experts_quant_act(x, w13f, w2f, few_ids, weights, SWIGLU_LIMIT, V41_BLOCK)]

    eager = step()
    run_without_host_sync(step)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    x2, ids2, weights2 = _routing(64, 2, device, V41_HIDDEN, V41_EXPERTS)
    x.copy_(x2.bfloat16())
    ids.copy_(ids2)
    few_ids.copy_(torch.where(ids2 >= 0, ids2 % few, ids2))
    weights.copy_(weights2)
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, step()):
        assert torch.equal(got, want)
    assert not torch.equal(captured[0], eager[0])

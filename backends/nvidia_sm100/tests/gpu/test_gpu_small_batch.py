"""The paths a small decode batch takes on a real GPU: sparse attention split over programs, and the
two-pass greedy argmax, against their one-program / one-pass forms and the float64 reference."""

from __future__ import annotations

import pytest
import torch
from gpu_support import gpu_marks

from deepinfer_core.ops import native
from deepinfer_core.sampling.argmax import argmax

pytestmark = gpu_marks()


@pytest.mark.parametrize("tokens", [1, 4, 16, 64])
def test_split_sparse_attention_at_v4_flash_shapes(tokens):
    from deepinfer_nvidia_sm100 import triton_ops

    g = torch.Generator(device="cuda").manual_seed(tokens)
    heads, d = 64, 512

    def randn(*shape):
        return torch.randn(*shape, generator=g, device="cuda")

    q = randn(tokens, heads, d).bfloat16()
    kv, ekv = randn(4096, d).bfloat16(), randn(1024, d).bfloat16()
    idx = torch.randint(-1, 4096, (tokens, 128), generator=g, device="cuda")
    eidx = torch.randint(-1, 1024, (tokens, 512), generator=g, device="cuda")
    eidx[0, 100:] = -1  # a short extra list: whole splits of -1
    sinks = randn(heads)
    splits = triton_ops.attention_splits(tokens, 640, 32)
    assert (splits > 1) == (tokens <= 64)
    got = triton_ops.sparse_attention(q, kv, idx, sinks, d**-0.5, ekv, eidx)
    one = triton_ops.sparse_attention(q, kv, idx, sinks, d**-0.5, ekv, eidx, splits=1)
    want = native.sparse_attention(q.double(), kv.double(), idx, sinks.double(), d**-0.5, ekv.double(), eidx)
    assert (got.double() - want).abs().max() < 2e-2
    assert (got.double() - want).abs().max() <= 2 * (one.double() - want).abs().max() + 4e-3


@pytest.mark.parametrize("rows", [1, 4, 16, 17])
def test_greedy_argmax_on_the_gpu(rows):
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 129280, generator=g, device="cuda")
    assert torch.equal(argmax(x), x.argmax(dim=-1))
    x = torch.randint(0, 4, (rows, 129280), generator=g, device="cuda").float()  # many equal maxima
    assert torch.equal(argmax(x), x.argmax(dim=-1))
    assert torch.equal(argmax(x.bfloat16()), x.bfloat16().argmax(dim=-1))


@pytest.mark.parametrize("width", [64, 1024, 2048, 4096])
def test_select_topk_on_the_gpu(width):
    from deepinfer_nvidia_sm100 import triton_ops

    g = torch.Generator(device="cuda").manual_seed(width)
    scores = torch.randn(8, width, generator=g, device="cuda")
    scores[1] = torch.randint(0, 3, (width,), generator=g, device="cuda").float()  # ties
    cand = torch.randint(-1, 50000, (8, width), generator=g, device="cuda")
    scores[cand < 0] = float("-inf")
    got = triton_ops.select_topk(scores, cand, 40000, 512)
    want = native.select_topk(scores, (cand >= 0) & (cand < 40000), cand, 512)
    assert torch.equal(got, want)

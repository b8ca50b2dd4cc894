"""The algorithms of the ascend_950 TileLang kernels, run on the CPU through their torch mirrors
(:mod:`deepinfer_ascend_950.reference`: same tiling, same order, same intermediate dtypes), match the
core's native bodies, which define the ops' semantics (compared as the conformance suite compares: the
reference in float64, the candidate at its dtype's tolerance). This proves the kernels' maths (online
softmax with the sink as initial state, -1 masking, K padding, bf16 probabilities for the Cube, partial
token blocks), not TileLang's code generation.
"""

from __future__ import annotations

import pytest
import torch
from deepinfer_ascend_950 import reference

from deepinfer_core.ops import native
from deepinfer_core.testing.compare import assert_close


def _attention_case(seed: int, dtype: torch.dtype, t=5, h=16, d=64, n=40, m=24, k=16, k2=20):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, d, generator=g).to(dtype)
    kv = torch.randn(n, d, generator=g).to(dtype)
    extra = torch.randn(m, d, generator=g).to(dtype)
    idx = torch.randint(0, n, (t, k), generator=g)
    idx[torch.rand(t, k, generator=g) < 0.3] = -1
    extra_idx = torch.randint(0, m, (t, k2), generator=g)
    extra_idx[torch.rand(t, k2, generator=g) < 0.3] = -1
    idx[0] = -1
    extra_idx[0] = -1  # token 0 sees nothing: only the sink -> zeros
    sinks = torch.randn(h, generator=g)
    return q, kv, idx, sinks, extra, extra_idx


def _mirror_attention(q, kv, idx, sinks, scale, extra, extra_idx, block_k):
    rows, sel = reference.gather_selected(kv, idx, extra, extra_idx)
    rows, sel = reference.pad_to_blocks(rows, sel, block_k)
    assert rows.shape[1] % block_k == 0
    return reference.sparse_attention_sinks_tiles(q, rows, sel, sinks, scale, block_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_k", [16, 64])
def test_sparse_attention_mirror_matches_native(dtype, block_k):
    q, kv, idx, sinks, extra, extra_idx = _attention_case(0, dtype)
    scale = q.shape[-1] ** -0.5
    got = _mirror_attention(q, kv, idx, sinks, scale, extra, extra_idx, block_k)
    f64 = torch.float64
    want = native.sparse_attention(q.to(f64), kv.to(f64), idx, sinks.to(f64), scale, extra.to(f64), extra_idx)
    assert got.dtype == dtype
    assert_close(got, want.to(dtype), dtype=dtype, name=f"sparse_attention mirror (block_k={block_k})")
    assert torch.equal(got[0], torch.zeros_like(got[0]))  # no valid row: the sink takes all the mass


def test_sparse_attention_mirror_without_extra_pool():
    q, kv, idx, sinks, _, _ = _attention_case(1, torch.float32, k=70)  # 70 -> padded to 128
    scale = 0.1
    got = _mirror_attention(q, kv, idx, sinks, scale, None, None, 64)
    want = native.sparse_attention(q.double(), kv.double(), idx, sinks.double(), scale)
    assert_close(got, want.float(), dtype=torch.float32)


def test_sparse_attention_mirror_large_logits_stay_finite():
    """The running max starts at the sink, so huge logits (and a sink far below them) neither overflow
    nor produce NaN from -inf - -inf."""
    q, kv, idx, sinks, extra, extra_idx = _attention_case(2, torch.float32)
    q = q * 60
    sinks = sinks - 1e4
    got = _mirror_attention(q, kv, idx, sinks, 1.0, extra, extra_idx, 16)
    want = native.sparse_attention(q.double(), kv.double(), idx, sinks.double(), 1.0, extra.double(), extra_idx)
    assert torch.isfinite(got).all()
    # logits of several hundred: float32 rounding of s - max alone is ~1e-5 relative, amplified by exp
    torch.testing.assert_close(got, want.float(), rtol=1e-2, atol=2e-3)


@pytest.mark.parametrize("n_tok,token_block", [(1, 8), (13, 8), (16, 8), (7, 4)])
def test_sinkhorn_mirror_matches_native_hc_pre(n_tok, token_block):
    hc, d, iters, eps = 4, 32, 20, 1e-6
    g = torch.Generator().manual_seed(n_tok)
    streams = torch.randn(n_tok, hc, d, generator=g)
    fn = torch.randn((2 + hc) * hc, hc * d, generator=g) * 0.05
    base = torch.randn((2 + hc) * hc, generator=g) * 0.1
    scale = torch.rand(3, generator=g) + 0.5
    post, comb, collapsed = native.hc_pre(streams.double(), fn.double(), base.double(), scale.double(), iters,
                                          eps, 1e-6)
    # what the backend's hc_pre does around the kernel: the mixes GEMM, then the kernel, then the collapse
    flat = streams.flatten(1)
    mixes = (flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + 1e-6)) @ fn.T
    pre_k, post_k, comb_k = reference.hc_split_sinkhorn_tiles(mixes, scale, base, hc, iters, eps, token_block)
    collapsed_k = (pre_k.unsqueeze(-1) * streams).sum(1)
    assert torch.isfinite(comb_k).all()  # the NaN-padded rows of a partial block are dropped
    assert_close(post_k, post.float(), dtype=torch.float32, name="post")
    assert_close(comb_k, comb.float(), dtype=torch.float32, name="comb")
    assert_close(collapsed_k, collapsed.float(), dtype=torch.float32, name="collapsed")

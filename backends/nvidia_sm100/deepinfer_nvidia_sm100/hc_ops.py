"""Launchers of the mHC Triton kernels (``hc_pre``, ``hc_post``, ``hc_head``, DeepSeek-V4.1's ``hc_mixes`` and
``hc_collapse``), catalogue signatures.

The mixing projection fn . flatten(streams) is one float32 GEMM; everything after it is one kernel.
Streams in :data:`~.triton_ops.KERNEL_DTYPES` only (the registration's predicate declines other model
dtypes at build time). No host synchronisation.
"""

from __future__ import annotations

import functools

import torch

from deepinfer_nvidia_sm100.triton_ops import _cdiv, _k, _pow2, _rows

BLOCK_D = 512
#: below this many tokens each token's collapse is split over programs of BLOCK_D channels: one program a
#: token walks its row's channel blocks one after another (13 us a call at batch 1, V4-Flash widths)
SPLIT_BELOW_TOKENS = 32


@functools.lru_cache(maxsize=1)
def _kernels():
    _k()  # the interpreter patches, when interpreting
    from deepinfer_nvidia_sm100 import hc_kernels

    return hc_kernels


def _matmul(a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return a @ weight.T


def _launch(streams, mixes, base, scale, iters, hc_eps, norm_eps, head: bool, pre, post, comb, out, slices: int):
    """``hc_pre_kernel`` over contiguous ``streams`` [T, n, D] (T > 0) and their mixes; ``out`` None: no
    collapse, ``pre`` stored instead (one program a token)."""
    tokens, n, d = streams.shape
    block_d = min(_pow2(d), BLOCK_D)
    d_slice = _cdiv(_cdiv(d, slices), block_d) * block_d
    collapse = out is not None
    out = out if collapse else pre
    _kernels().hc_pre_kernel[(tokens, _cdiv(d, d_slice))](
        streams, streams.stride(0), streams.stride(1), mixes, mixes.stride(0), base.float().contiguous(),
        scale.float().contiguous(), pre, post, comb, out, out.stride(0), n, d, d_slice, int(iters), float(hc_eps),
        float(norm_eps), HEAD=head, COLLAPSE=collapse, BLOCK_N=max(_pow2(n), 2), BLOCK_D=block_d, num_warps=4,
    )


def _collapse(streams, fn, base, scale, iters, hc_eps, norm_eps, head: bool, mm=_matmul, mixes=None,
              slices: int | None = None):
    """``slices``: programs per token (default: one per BLOCK_D channels below SPLIT_BELOW_TOKENS
    tokens, else 1); every count gives the same bits."""
    tokens, n, d = streams.shape
    streams = streams.contiguous()
    if mixes is None:
        mixes = mm(streams.reshape(tokens, n * d).float(), fn.float())
    mixes = mixes.contiguous()
    post = torch.empty((tokens, n), dtype=torch.float32, device=streams.device)
    comb = torch.empty((tokens, n, n), dtype=torch.float32, device=streams.device)
    out = torch.empty((tokens, d), dtype=streams.dtype, device=streams.device)
    if tokens == 0:
        return post, comb, out
    if slices is None:
        slices = _cdiv(d, min(_pow2(d), BLOCK_D)) if tokens < SPLIT_BELOW_TOKENS else 1
    _launch(streams, mixes, base, scale, iters, hc_eps, norm_eps, head, post, post, comb, out, slices)
    return post, comb, out


def hc_pre(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, *, mm=_matmul):
    """``mm(a, weight)``: the mixing GEMM a . weight^T in float32 (batch-invariant mode passes its own)."""
    return _collapse(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, head=False, mm=mm)


def hc_pre_from_mixes(streams, mixes, base, scale, sinkhorn_iters, hc_eps, norm_eps):
    """``hc_pre`` given its mixing GEMM's result (fn . flatten(streams), float32, not RMS-normalised)."""
    return _collapse(streams, None, base, scale, sinkhorn_iters, hc_eps, norm_eps, head=False, mixes=mixes)


def hc_head(streams, fn, base, scale, hc_eps, norm_eps, *, mm=_matmul):
    return _collapse(streams, fn, base, scale, 1, hc_eps, norm_eps, head=True, mm=mm)[2]


def hc_mixes(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, *, mm=_matmul):
    """DeepSeek-V4.1's ``hc_mixes``: ``hc_pre``'s mixing GEMM and kernel, one program a token storing
    ``pre`` beside ``post`` and ``comb`` instead of the collapse (float32 all three)."""
    tokens, n, d = streams.shape
    streams = streams.contiguous()
    pre = torch.empty((tokens, n), dtype=torch.float32, device=streams.device)
    post = torch.empty((tokens, n), dtype=torch.float32, device=streams.device)
    comb = torch.empty((tokens, n, n), dtype=torch.float32, device=streams.device)
    if tokens:
        mixes = mm(streams.reshape(tokens, n * d).float(), fn.float()).contiguous()
        _launch(streams, mixes, base, scale, sinkhorn_iters, hc_eps, norm_eps, False, pre, post, comb, None, 1)
    return pre, post, comb


def hc_collapse(streams, pre):
    """sum_i pre[t, i] * streams[t, i] in float32: one program per token and BLOCK_D channels."""
    tokens, n, d = streams.shape
    out = torch.empty((tokens, d), dtype=streams.dtype, device=streams.device)
    if tokens == 0 or d == 0:
        return out
    streams, pre = _rows(streams), _rows(pre)
    block_d = min(_pow2(d), BLOCK_D)
    _kernels().hc_collapse_kernel[(tokens, _cdiv(d, block_d))](
        streams, streams.stride(0), streams.stride(1), pre, pre.stride(0), out, out.stride(0), n, d,
        BLOCK_N=max(_pow2(n), 2), BLOCK_D=block_d, num_warps=4,
    )
    return out


def hc_post(block_out, streams, post, comb):
    tokens, n, d = streams.shape
    if tokens == 0:
        return torch.empty_like(streams)
    streams, block_out = streams.contiguous(), _rows(block_out)
    post, comb = post.float().contiguous(), comb.float().contiguous()
    out = torch.empty_like(streams)
    block = min(_pow2(d), 256)
    _kernels().hc_post_kernel[(tokens, -(-d // block))](
        block_out, block_out.stride(0), streams, streams.stride(0), streams.stride(1), post, comb,
        out, out.stride(0), out.stride(1), n, d, BLOCK_N=max(_pow2(n), 2), BLOCK_D=block, num_warps=4,
    )
    return out


ALL_OPS = {"hc_pre": hc_pre, "hc_post": hc_post, "hc_head": hc_head, "hc_collapse": hc_collapse}

"""Torch mirrors of the TileLang-Ascend kernels: the same tiling, the same order of operations and the same
intermediate dtypes, runnable on the CPU.

They are how the kernels' algorithms are checked here (against the core's native bodies, which define the
semantics): the sparse attention's block-wise online softmax with the sink as initial state, its masking
of ``-1`` slots and padding of ``K`` to whole blocks, and the probabilities rounded to the input dtype for
the Cube's second GEMM; the Sinkhorn kernel's token blocks with a partial last block. What they cannot
check is TileLang's code generation: that the AscendC does what the TIR says runs only on an Ascend 950.
"""

from __future__ import annotations

import torch

from deepinfer_core.ops.native import gather_rows


def pad_to_blocks(rows: torch.Tensor, indices: torch.Tensor, block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows [T, K, D]`` and ``indices [T, K]`` padded along ``K`` to a multiple of ``block_k`` (zero rows,
    index -1), as the kernel wrapper passes them."""
    k = rows.shape[1]
    padded = max(block_k, -(-k // block_k) * block_k)
    if padded == k:
        return rows, indices
    rows = torch.cat([rows, rows.new_zeros(rows.shape[0], padded - k, rows.shape[2])], dim=1)
    indices = torch.cat([indices, indices.new_full((indices.shape[0], padded - k), -1)], dim=1)
    return rows, indices


def gather_selected(kv, indices, extra_kv=None, extra_indices=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows each token attends to, window first then extra, ``-1`` slots as zero rows (never read)."""
    rows, _ = gather_rows(kv, indices)
    idx = indices
    if extra_kv is not None and extra_indices is not None and extra_indices.shape[-1] > 0:
        extra_rows, _ = gather_rows(extra_kv, extra_indices)
        rows, idx = torch.cat([rows, extra_rows], 1), torch.cat([indices, extra_indices], 1)
    return rows, idx


def sparse_attention_sinks_tiles(q, rows, indices, sinks, scale: float, block_k: int = 64) -> torch.Tensor:
    """What ``kernels.sparse_attention`` computes, block by block (``q [T, H, D]``, ``rows [T, K, D]``
    with ``K`` a multiple of ``block_k``)."""
    f32 = torch.float32
    t, h, d = q.shape
    m = sinks.to(f32).view(1, h).expand(t, h).clone()  # the sink is the initial max ...
    l = torch.ones(t, h, dtype=f32)  # ... and contributes exp(sink - m) = 1
    acc = torch.zeros(t, h, d, dtype=f32)
    qf = q.to(f32)
    for b in range(0, rows.shape[1], block_k):
        blk = rows[:, b : b + block_k]
        valid = indices[:, b : b + block_k] >= 0
        s = torch.einsum("thd,tkd->thk", qf, blk.to(f32)) * scale  # Cube, float32 in L0C
        s = s.masked_fill(~valid.unsqueeze(1), float("-inf"))
        m_new = torch.maximum(s.amax(-1), m)
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new.unsqueeze(-1))
        l = l * alpha + p.sum(-1)
        p_cube = p.to(q.dtype).to(f32)  # P goes to the Cube in the input dtype
        acc = acc * alpha.unsqueeze(-1) + torch.einsum("thk,tkd->thd", p_cube, blk.to(f32))
        m = m_new
    return (acc / l.unsqueeze(-1)).to(q.dtype)


def hc_split_sinkhorn_tiles(mixes, scale, base, hc: int, sinkhorn_iters: int, eps: float,
                            token_block: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What ``kernels.hc_sinkhorn`` computes, one token block at a time; the rows a partial last block
    pads with are computed on garbage and dropped, as the kernel's clamped stores drop them."""
    f32 = torch.float32
    n_tok = mixes.shape[0]
    blocks = -(-n_tok // token_block)
    padded = torch.full((blocks * token_block, mixes.shape[1]), float("nan"), dtype=f32)
    padded[:n_tok] = mixes.to(f32)
    s, b = scale.to(f32), base.to(f32)
    pres, posts, combs = [], [], []
    for blk in padded.split(token_block):
        pre = torch.sigmoid(blk[:, :hc] * s[0] + b[:hc]) + eps
        post = 2 * torch.sigmoid(blk[:, hc : 2 * hc] * s[1] + b[hc : 2 * hc])
        c = (blk[:, 2 * hc :] * s[2] + b[2 * hc :]).view(-1, hc, hc)
        c = torch.exp(c - c.amax(-1, keepdim=True))
        c = c / c.sum(-1, keepdim=True) + eps
        c = c / (c.sum(-2, keepdim=True) + eps)
        for _ in range(sinkhorn_iters - 1):
            c = c / (c.sum(-1, keepdim=True) + eps)
            c = c / (c.sum(-2, keepdim=True) + eps)
        pres.append(pre), posts.append(post), combs.append(c)
    return torch.cat(pres)[:n_tok], torch.cat(posts)[:n_tok], torch.cat(combs)[:n_tok]

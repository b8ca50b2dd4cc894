"""The block-FP8 Triton launchers (``linear_fp8``, ``moe_experts_fp8``), with the catalogue signatures.

They take float32, bfloat16 and float16 activations (:data:`~.triton_ops.KERNEL_DTYPES`) with E4M3
weights on a device where this backend's Triton kernels run; the registration's predicate declines
other model dtypes at build time (the core's native bodies serve them). They never wait for the device
(sizes come from shapes), so they can be captured in CUDA graphs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from deepinfer_core.quant.fp8 import FP8_DTYPE
from deepinfer_nvidia_sm100.triton_ops import moe_layout

GROUP = 128
#: aim for this many programs per GEMM before splitting K (an H200 has 132 SMs)
TARGET_PROGRAMS = 264


@functools.lru_cache(maxsize=1)
def _k():
    from deepinfer_nvidia_sm100 import fp8_kernels, triton_ops

    triton_ops._k()  # imports Triton the same way, with the interpreter's gaps closed
    return fp8_kernels


@functools.cache
def _fp8_tensor_cores(device: torch.device) -> bool:
    """Tensor-core E4M3 dots need a compiled kernel on compute capability 8.9+ (not the interpreter)."""
    from deepinfer_nvidia_sm100.capability import device_capability, interpreting

    cap = device_capability(device)
    return not interpreting() and cap is not None and cap >= (8, 9)


def _fp8_dot(x: torch.Tensor) -> bool:
    """E4M3 tensor-core dots for bf16/fp16 models; float32 models multiply the same exact E4M3 values in
    float32: on an H200 the E4M3 dots of 64- and 128-row tiles missed float32's tolerance (errors up to
    4e-3 at V4-Flash shapes), as Hopper's FP8 MMA accumulates in fewer bits than float32."""
    return x.dtype != torch.float32 and _fp8_tensor_cores(x.device)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _linear_tiles(m: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) by the number of rows."""
    if m <= 16:
        return 16, 64, 4
    if m <= 64:
        return 64, 64, 4
    return 128, 128, 8


def mn_major_scales(m: int, groups: int, device: torch.device, slabs: int | None = None) -> torch.Tensor:
    """Float32 scales [m, groups] (or [slabs, m, groups]) stored column by column, each column padded to a
    multiple of 4 rows (16 bytes): the layout DeepGEMM's SM90 GEMMs read activation scales in, so that
    they need no transposing copy of their own."""
    lead = () if slabs is None else (slabs,)
    cols = torch.empty((*lead, groups, _cdiv(m, 4) * 4), dtype=torch.float32, device=device)
    return cols[..., :m].transpose(-1, -2)


def _new_scales(m: int, groups: int, device: torch.device, mn_major: bool) -> torch.Tensor:
    if mn_major:
        return mn_major_scales(m, groups, device)
    return torch.empty((m, groups), dtype=torch.float32, device=device)


def _scale_strides(s: torch.Tensor, rows: int) -> tuple[int, int, int, int]:
    """(slab stride, row stride, group stride, rows per slab) of scales [R, groups] or [slabs, M, groups]."""
    if s.dim() == 2:
        return 0, s.stride(0), s.stride(1), max(rows, 1)
    return s.stride(0), s.stride(1), s.stride(2), s.shape[1]


def quantize_act(x2: torch.Tensor, mn_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [M, K] (stride 1 along K) -> (E4M3 [M, K], float32 scales [M, ceil(K/128)]), bit for bit
    :func:`deepinfer_core.quant.fp8.quantize_act_fp8`; ``mn_major``: the scales in
    :func:`mn_major_scales`' layout."""
    m, k = x2.shape
    groups = _cdiv(k, GROUP)
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x2.device)
    s = _new_scales(m, groups, x2.device, mn_major)
    _launch_quantize(x2, q, s, None, None, m, m)
    return q, s


def quantize_act_rows(x2: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, q: torch.Tensor,
                      s: torch.Tensor) -> None:
    """:func:`quantize_act` of rows ``src`` of ``x2`` written to rows ``dst`` (a row of len(q) or more
    skipped) of ``q`` [R, K] and of ``s``: [R, groups], or [slabs, M, groups] of any strides whose row r is
    row r % M of slab r // M; one launch."""
    if src.numel():
        _launch_quantize(x2, q, s, src.contiguous(), dst.contiguous(), src.numel(), q.shape[0])


def _launch_quantize(x2, q, s, src, dst, m, rows) -> None:
    if not m:
        return
    se, sm, sk, slab_m = _scale_strides(s, rows)
    # 16-row tiles: on an H200 they quantised bit for bit, 32-row tiles did not (cause not yet found)
    _k().quantize_fp8_kernel[(_cdiv(m, 16), _cdiv(x2.shape[1], GROUP))](
        x2, x2.stride(0), q, q.stride(0), s, se, sm, sk, q if src is None else src, q if dst is None else dst,
        m, rows, x2.shape[1], slab_m, HAS_IDX=src is not None, BLOCK_M=16, num_warps=4,
    )


def swiglu_quantize(gate_up: torch.Tensor, limit: float, mn_major: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [M, 2I] of gate and up (stride 1 along them) -> swiglu in float32 as (E4M3 [M, I], float32
    scales [M, ceil(I/128)]), one launch; as :func:`quantize_act` on ``native.swiglu``'s float32 rows
    (``mn_major`` likewise)."""
    m, two_i = gate_up.shape
    inter = two_i // 2
    groups = _cdiv(inter, GROUP)
    q = torch.empty((m, inter), dtype=FP8_DTYPE, device=gate_up.device)
    s = _new_scales(m, groups, gate_up.device, mn_major)
    _launch_swiglu(gate_up, limit, None, m, q, s)
    return q, s


def swiglu_quantize_rows(gate_up: torch.Tensor, limit: float, rows: torch.Tensor, q: torch.Tensor,
                         s: torch.Tensor) -> None:
    """:func:`swiglu_quantize` of rows ``rows`` (int64, distinct where below len(gate_up); the others
    skipped) of ``gate_up``, written to the same rows of ``q`` and of ``s`` (as in
    :func:`quantize_act_rows`); one launch."""
    _launch_swiglu(gate_up, limit, rows, rows.numel(), q, s)


def _launch_swiglu(gate_up, limit, rows, m, q, s) -> None:
    if not m:
        return
    inter = gate_up.shape[1] // 2
    se, sm, sk, slab_m = _scale_strides(s, gate_up.shape[0])
    _k().swiglu_quantize_kernel[(_cdiv(m, 16), _cdiv(inter, GROUP))](
        gate_up, gate_up.stride(0), q, q.stride(0), s, se, sm, sk, q if rows is None else rows, m,
        gate_up.shape[0], inter, slab_m, float(limit), HAS_IDX=rows is not None, BLOCK_M=16, num_warps=4,
    )


def masked_layout(topk_ids: torch.Tensor, topk_weights: torch.Tensor, groups: int, max_m: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``external.masked_layout`` in one launch: (slab row [P] int64, pairs per expert [groups] int32,
    weights [P] float32, token [P] int64) of the P = tokens * k (token, slot) pairs."""
    ids = topk_ids.reshape(-1).contiguous()
    tw = topk_weights.reshape(-1).contiguous()
    pairs, k = ids.numel(), topk_ids.shape[-1]
    dest = torch.empty(pairs, dtype=torch.int64, device=ids.device)
    token = torch.empty(pairs, dtype=torch.int64, device=ids.device)
    weights = torch.empty(pairs, dtype=torch.float32, device=ids.device)
    counts = torch.empty(groups, dtype=torch.int32, device=ids.device)
    block = 64
    pair_blocks = _cdiv(pairs, block)
    _k().masked_layout_kernel[(pair_blocks + _cdiv(groups, block),)](
        ids, tw, dest, token, weights, counts, pairs, groups, max_m, pair_blocks, K=k, BLOCK=block, num_warps=4,
    )
    return dest, counts, weights, token


def combine_rows(rows: torch.Tensor, row_of: torch.Tensor, weights: torch.Tensor, tokens: int, k: int,
                 dtype: torch.dtype) -> torch.Tensor:
    """[tokens, D] in ``dtype``: token t's sum over its k slots of ``weights[t*k + j] * rows[row_of[t*k + j]]``
    in float32 in slot order (``row_of`` = len(rows): no row, adds 0); one launch. ``rows`` [R, D] with stride
    1 along D, ``row_of`` int64 and ``weights`` float32 [tokens * k], contiguous."""
    d = rows.shape[1]
    out = torch.empty((tokens, d), dtype=dtype, device=rows.device)
    if tokens:
        _k().moe_combine_kernel[(tokens, _cdiv(d, 1024))](
            rows, rows.stride(0), row_of, weights, out, out.stride(0), d, rows.shape[0],
            K=k, BLOCK_D=1024, num_warps=4,
        )
    return out


def linear_fp8(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    n, k = weight.shape
    if x.numel() == 0:
        return x.new_empty((*x.shape[:-1], n))
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    xq, xs = quantize_act(x2)
    block_m, block_n, warps = _linear_tiles(m)
    tiles = _cdiv(m, block_m) * _cdiv(n, block_n)
    groups = _cdiv(k, GROUP)
    split = max(1, min(groups, TARGET_PROGRAMS // tiles))
    per_split = _cdiv(groups, split)
    split = _cdiv(groups, per_split)
    weight, weight_scale = weight.contiguous(), weight_scale.float().contiguous()
    if split == 1:
        out = torch.empty((1, m, n), dtype=x.dtype, device=x.device)
    else:
        out = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    _k().linear_fp8_kernel[(_cdiv(m, block_m), _cdiv(n, block_n), split)](
        xq, xq.stride(0), xs, xs.stride(0), weight, weight.stride(0), weight_scale, weight_scale.stride(0),
        out, out.stride(0), out.stride(1), m, n, k, per_split,
        BLOCK_M=block_m, BLOCK_N=block_n, FP8_DOT=_fp8_dot(x), num_warps=warps,
    )
    result = out[0] if split == 1 else out.sum(0).to(x.dtype)
    return result.view(*x.shape[:-1], n)


@dataclass(frozen=True)
class MoeTiles:
    """Launch shapes of the grouped FP8 MoE: rows per block (each expert's rows padded to it), then warps
    and pipeline stages of the gate/up kernel, and output columns, warps and stages of the down kernel."""

    block_m: int
    up_warps: int
    up_stages: int
    down_n: int
    down_warps: int
    down_stages: int


def moe_tiles(pairs: int) -> MoeTiles:
    """The tiles for a call of ``pairs`` (token, slot) pairs."""
    if pairs <= 64:
        return MoeTiles(16, 4, 3, 64, 4, 3)
    if pairs <= 4096:
        return MoeTiles(64, 8, 3, 64, 4, 3)
    return MoeTiles(64, 8, 4, 256, 8, 3)  # on an H200: 4096 tokens of V4-Flash's MoE in 4.44 ms, not 4.81


def moe_experts_fp8(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, swiglu_limit) -> torch.Tensor:
    """Grouped FP8 MoE over rows sorted by expert: the tokens quantised once, gate/up + SwiGLU with h
    quantised in the epilogue, then down scaled by the routing weight; a token's k contributions are
    summed in float32."""
    return moe_experts_fp8_tiled(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, swiglu_limit)


def moe_experts_fp8_tiled(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, swiglu_limit,
                          tiles: MoeTiles | None = None) -> torch.Tensor:
    """:func:`moe_experts_fp8` with the launch shapes ``tiles`` (default :func:`moe_tiles`)."""
    if x.numel() == 0:
        return torch.zeros_like(x)
    tiles = tiles or moe_tiles(topk_ids.numel())
    lay = moe_layout(x, w13, topk_ids, topk_weights, block_m=tiles.block_m)
    block_m, rows, inter, d = lay.block_m, lay.rows, lay.inter, lay.d
    xq, xs = quantize_act(x if x.stride(-1) == 1 else x.contiguous())
    w13, w2 = w13.contiguous(), w2.contiguous()
    s13, s2 = w13_scale.float().contiguous(), w2_scale.float().contiguous()
    hq = torch.empty((rows, inter), dtype=FP8_DTYPE, device=x.device)
    hs = torch.empty((rows, _cdiv(inter, GROUP)), dtype=torch.float32, device=x.device)
    out = torch.zeros((lay.pairs, d), dtype=torch.float32, device=x.device)
    fp8_dot, kern = _fp8_dot(x), _k()
    kern.moe_fp8_gate_up_kernel[(rows // block_m, _cdiv(inter, GROUP))](
        xq, xq.stride(0), xs, xs.stride(0), w13, w13.stride(0), w13.stride(1), s13, s13.stride(0), s13.stride(1),
        lay.sorted_pairs, lay.block_expert, hq, hq.stride(0), hs, hs.stride(0),
        lay.pairs, lay.k, d, inter, float(swiglu_limit),
        BLOCK_M=block_m, FP8_DOT=fp8_dot, num_warps=tiles.up_warps, num_stages=tiles.up_stages,
    )
    kern.moe_fp8_down_kernel[(rows // block_m, _cdiv(d, tiles.down_n))](
        hq, hq.stride(0), hs, hs.stride(0), w2, w2.stride(0), w2.stride(1), s2, s2.stride(0), s2.stride(1),
        lay.sorted_pairs, lay.block_expert, lay.weights, out, out.stride(0), lay.pairs, d, inter,
        BLOCK_M=block_m, BLOCK_N=tiles.down_n, FP8_DOT=fp8_dot, num_warps=tiles.down_warps,
        num_stages=tiles.down_stages,
    )
    return lay.combine(out, x.dtype)


ALL_OPS = {"linear_fp8": linear_fp8, "moe_experts_fp8": moe_experts_fp8}

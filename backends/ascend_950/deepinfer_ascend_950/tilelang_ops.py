"""Catalogued ops served by the TileLang-Ascend kernels of :mod:`.kernels`, compiled for the device once
per kernel configuration (``tilelang.compile(target="ascend")``, which needs CANN's ``bisheng``); the
expert and FP8-KV wrappers (:mod:`.tilelang_moe`, :mod:`.tilelang_kv_fp8`) build on what is here.

- ``hc_pre``: the mixes GEMM and the stream collapse in torch on the NPU, the split + Sinkhorn in the
  :mod:`.kernels.hc_sinkhorn` kernel.
- ``sparse_attention``: the selected rows gathered by torch on the NPU (window then extra, ``-1`` slots as
  zero rows), padded to whole blocks, attention with sinks in :mod:`.kernels.sparse_attention`; heads are
  padded to 16 and tokens processed in chunks so the gathered rows stay under :data:`GATHER_BUDGET`.
- ``hc_post``: all of it in :mod:`.kernels.hc_mix`; ``hc_head``: the mixes GEMM in torch on the NPU, the
  sigmoid and the collapse in :mod:`.kernels.hc_mix`.
- ``linear_fp8``: activations quantised by :func:`.kernels.fp8_gemm.act_quant_fp8`, the scaled E4M3 GEMM
  by :func:`.kernels.fp8_gemm.fp8_gemm`; ``moe_experts_fp8`` and ``moe_experts_fp4``: grouped expert GEMMs
  over device-side expert tiles, in :mod:`.tilelang_moe` (no read-back).
- ``compress_windows``: all of it in :mod:`.kernels.compress_windows`.
- ``act_quant_sim``: the quantise-dequantise in :mod:`.kernels.act_quant_sim`, the Hadamard rotation
  before it in torch on the NPU.
- ``moe_route``: V4's ``sqrtsoftplus`` scores in :mod:`.kernels.route_scores`, the top-k in torch; only
  for a model configured with that scoring (:data:`ROUTE_OPS`).
- ``indexer_topk``: candidate keys gathered like the attention's rows, the scores in
  :mod:`.kernels.indexer_scores`, the stable top-k over them in torch on the NPU.
- ``kv_fp8_pack``, ``sparse_attention_fp8``: in :mod:`.tilelang_kv_fp8`.

A call the kernels do not take (a dtype or width outside theirs, no rows) goes to the native body. These
paths run only on an Ascend 950; here the kernels run in :mod:`.emulator`
(``DEEPINFER_ASCEND_EMULATE=1``) and are lowered to AscendC by the tests.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from deepinfer_ascend_950 import npu, reference
from deepinfer_core.ops import native

BLOCK_K = 64
HEAD_ALIGN = 16
GATHER_BUDGET = 256 << 20  # bytes of gathered rows per kernel call
KERNEL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}  # the Cube's inputs
VECTOR_DTYPES = {**KERNEL_DTYPES, torch.float32: "float32"}


@functools.cache
def cube_cores(index: int = 0) -> int:
    """The NPU's Cube core count (TileLang's driver query), 32 when it cannot say."""
    try:
        from tilelang.carver.arch.driver import get_num_cube_cores

        return int(get_num_cube_cores(index))
    except Exception:
        return 32


def compiled(builder_name: str, **params: Any) -> Any:
    """The kernel ``builder_name`` built with ``params``, compiled for the NPU once (or, under
    ``DEEPINFER_ASCEND_EMULATE=1``, wrapped by the CPU emulator)."""
    return _compiled(builder_name, npu.emulating(), **params)


@functools.cache
def _compiled(builder_name: str, emulate: bool, **params: Any) -> Any:
    from deepinfer_ascend_950.kernels import builder

    program = builder(builder_name)(**params)
    if emulate:
        from deepinfer_ascend_950 import emulator

        return emulator.compile(program)
    import tilelang

    return tilelang.compile(program, target="ascend")


def hc_pre(streams, fn, base, scale, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
    n = streams.shape[1]
    f32 = torch.float32
    flat = streams.flatten(1).to(f32)
    flat = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + norm_eps)
    mixes = (flat @ fn.to(f32).T).contiguous()
    t = streams.shape[0]
    pre = torch.empty(t, n, dtype=f32, device=streams.device)
    post, comb = torch.empty_like(pre), torch.empty(t, n, n, dtype=f32, device=streams.device)
    if t:
        kernel = compiled("hc_split_sinkhorn", hc=n, sinkhorn_iters=int(sinkhorn_iters), eps=float(hc_eps))
        kernel(mixes, scale.to(f32).contiguous(), base.to(f32).contiguous(), pre, post, comb)
    collapsed = (pre.unsqueeze(-1) * streams.to(f32)).sum(dim=1).to(streams.dtype)
    return post, comb, collapsed


def sparse_attention(q, kv, indices, sinks, scale: float, extra_kv=None, extra_indices=None):
    def rows(start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        ex = extra_indices[start:stop] if extra_indices is not None else None
        selected, sel = reference.gather_selected(kv, indices[start:stop], extra_kv, ex)
        return selected.to(q.dtype), sel

    k_total = indices.shape[-1] + (extra_indices.shape[-1] if extra_indices is not None else 0)
    return attend(q, sinks, scale, k_total, rows)


def attend(q, sinks, scale: float, k_total: int, rows) -> torch.Tensor:
    """The sparse attention kernel over ``rows(start, stop) -> (rows [stop - start, K, D] in q.dtype,
    indices [stop - start, K])`` (``-1`` slots zero rows), tokens in chunks under :data:`GATHER_BUDGET`."""
    t, h, d = q.shape
    heads = -(-h // HEAD_ALIGN) * HEAD_ALIGN
    if heads != h:  # padded heads attend with zero queries and sink 0; their outputs are dropped
        q = torch.cat([q, q.new_zeros(t, heads - h, d)], dim=1)
        sinks = torch.cat([sinks, sinks.new_zeros(heads - h)])
    out = torch.empty(t, heads, d, dtype=q.dtype, device=q.device)
    step = max(1, GATHER_BUDGET // max(1, (k_total + BLOCK_K) * d * q.element_size()))
    device = q.device
    kernel = compiled("sparse_attention_sinks", heads=heads, head_dim=d, scale=float(scale),
                      block_k=BLOCK_K, num_cores=cube_cores(device.index or 0), dtype=KERNEL_DTYPES[q.dtype])
    sinks32 = sinks.to(torch.float32).contiguous()
    for start in range(0, t, step):
        stop = min(t, start + step)
        selected, sel = reference.pad_to_blocks(*rows(start, stop), BLOCK_K)
        kernel(q[start:stop].contiguous(), selected.contiguous(), sel.to(torch.int32).contiguous(), sinks32,
               out[start:stop])
    return out[:, :h]


def compress_windows(kv, gate):
    w, length, d = kv.shape
    if w == 0 or kv.dtype not in VECTOR_DTYPES or gate.dtype not in VECTOR_DTYPES or d % min(64, d) or d % 8:
        return native.compress_windows(kv, gate)
    out = torch.empty(w, d, dtype=kv.dtype, device=kv.device)
    kernel = compiled("compress_windows", window=length, dim=d, kv_dtype=VECTOR_DTYPES[kv.dtype],
                      gate_dtype=VECTOR_DTYPES[gate.dtype])
    kernel(kv.contiguous(), gate.contiguous(), out)
    return out


def indexer_topk(q, weights, keys, candidates, topk: int, scale: float):
    t, h, d = q.shape
    if t == 0 or q.dtype not in KERNEL_DTYPES or d % 16:
        return native.indexer_topk(q, weights, keys, candidates, topk, scale)
    heads = -(-h // HEAD_ALIGN) * HEAD_ALIGN
    w = weights.to(torch.float32) * scale
    if heads != h:  # padded heads: zero queries and zero weights add nothing
        q = torch.cat([q, q.new_zeros(t, heads - h, d)], dim=1)
        w = torch.cat([w, w.new_zeros(t, heads - h)], dim=1)
    width = max(BLOCK_K, -(-candidates.shape[-1] // BLOCK_K) * BLOCK_K)
    scores = torch.empty(t, width, dtype=torch.float32, device=q.device)
    kernel = compiled("indexer_scores", heads=heads, dim=d, block_c=BLOCK_K,
                      num_cores=cube_cores(q.device.index or 0), dtype=KERNEL_DTYPES[q.dtype])
    step = max(1, GATHER_BUDGET // max(1, width * d * q.element_size()))
    for start in range(0, t, step):
        stop = min(t, start + step)
        rows, sel = reference.gather_selected(keys, candidates[start:stop])
        rows, sel = reference.pad_to_blocks(rows.to(q.dtype), sel, BLOCK_K)
        kernel(q[start:stop].contiguous(), rows.contiguous(), sel.to(torch.int32).contiguous(),
               w[start:stop].contiguous(), scores[start:stop])
    scores = scores[:, : candidates.shape[-1]]
    return native.select_topk(scores, candidates >= 0, candidates, topk)


def _mix_block(d: int) -> int | None:
    block = min(256, d)
    return block if d % block == 0 and block % 16 == 0 else None


def hc_post(block_out, streams, post, comb):
    t, n, d = streams.shape
    if t == 0 or streams.dtype not in VECTOR_DTYPES or block_out.dtype != streams.dtype or not _mix_block(d) \
            or n > 8:
        return native.hc_post(block_out, streams, post, comb)
    out = torch.empty_like(streams)
    kernel = compiled("hc_post", hc=n, dim=d, dtype=VECTOR_DTYPES[streams.dtype], block_d=_mix_block(d))
    f32 = torch.float32
    kernel(block_out.contiguous(), streams.contiguous(), post.to(f32).contiguous(), comb.to(f32).contiguous(), out)
    return out


def hc_head(streams, fn, base, scale, hc_eps: float, norm_eps: float):
    t, n, d = streams.shape
    if t == 0 or streams.dtype not in VECTOR_DTYPES or not _mix_block(d) or n > 8:
        return native.hc_head(streams, fn, base, scale, hc_eps, norm_eps)
    f32 = torch.float32
    flat = streams.flatten(1).to(f32)
    flat = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + norm_eps)
    mixes = (flat @ fn.to(f32).T).contiguous()
    out = torch.empty(t, d, dtype=streams.dtype, device=streams.device)
    kernel = compiled("hc_head_collapse", hc=n, dim=d, eps=float(hc_eps), dtype=VECTOR_DTYPES[streams.dtype],
                      block_d=_mix_block(d))
    kernel(mixes, scale.to(f32).reshape(1).contiguous(), base.to(f32).contiguous(), streams.contiguous(), out)
    return out


FP8 = torch.float8_e4m3fn
FP8_BLOCK = 128


def _pad_k(t: torch.Tensor) -> torch.Tensor:
    """``t [..., K]`` with zero columns up to a multiple of 128 (the kernels take whole K groups)."""
    pad = -t.shape[-1] % FP8_BLOCK
    if not pad:
        return t.contiguous()
    return torch.cat([t, torch.zeros((*t.shape[:-1], pad), dtype=t.dtype, device=t.device)], dim=-1)


def _act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (K a multiple of 128) -> (E4M3 [M, K], float32 scales [K / 128, M])."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=FP8, device=x.device)
    scales = torch.empty(k // FP8_BLOCK, m, dtype=torch.float32, device=x.device)
    if m:
        compiled("act_quant_fp8", dim=k, dtype=VECTOR_DTYPES[x.dtype])(x.contiguous(), q, scales)
    return q, scales


def _fp8_mm(q, scales, weight, weight_scale, out_dtype: torch.dtype) -> torch.Tensor:
    m, k = q.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=q.device)
    if m:
        kernel = compiled("fp8_gemm", n=n, k=k, out_dtype=VECTOR_DTYPES[out_dtype],
                          num_cores=cube_cores(q.device.index or 0))
        kernel(q, scales.contiguous(), _pad_k(weight), weight_scale.to(torch.float32).contiguous(), out)
    return out


def linear_fp8(x, weight, weight_scale):
    if x.dtype not in VECTOR_DTYPES or weight.dtype != FP8:
        return native.linear_fp8(x, weight, weight_scale)
    lead = x.shape[:-1]
    q, scales = _act_quant(_pad_k(x.reshape(-1, x.shape[-1])))
    return _fp8_mm(q, scales, weight, weight_scale, x.dtype).view(*lead, weight.shape[0])


def act_quant_sim(x, block: int, fmt: str, rotate: bool):
    """The Hadamard rotation (``rotate``) in torch on the NPU, the quantisation in
    :mod:`.kernels.act_quant_sim`; a partial last group padded with zeros (they do not change its amax)."""
    if x.dtype not in VECTOR_DTYPES or fmt not in ("e4m3", "e2m1") or block % 16 or x.numel() == 0:
        return native.act_quant_sim(x, block, fmt, rotate)
    from deepinfer_core.quant.fp4 import hadamard

    k = x.shape[-1]
    flat = (hadamard(x) if rotate else x).reshape(-1, k)
    if k % block:
        flat = torch.cat([flat, flat.new_zeros(flat.shape[0], -k % block)], dim=1)
    out = torch.empty_like(flat)
    compiled("act_quant_sim", dim=flat.shape[1], block=int(block), fmt=fmt, dtype=VECTOR_DTYPES[x.dtype])(
        flat.contiguous(), out)
    return out[:, :k].reshape(x.shape)


ROUTE_ALIGN = 16


def moe_route(logits, scoring_func: str, top_k: int, correction_bias, fixed_ids, routed_scaling_factor: float):
    """``sqrtsoftplus`` scores in :mod:`.kernels.route_scores` (experts padded to 16 with ``-inf``, whose
    score is 0), the top-k and weights as the native body; other scoring functions go to the torch_npu
    fused operator where the NPU has it, else native."""
    t, experts = logits.shape
    if scoring_func != "sqrtsoftplus" or logits.dtype not in VECTOR_DTYPES or t == 0:
        if npu.is_npu(logits.device) and npu.environment().has("npu_moe_gating_top_k"):
            from deepinfer_ascend_950 import npu_ops

            return npu_ops.moe_route(logits, scoring_func, top_k, correction_bias, fixed_ids, routed_scaling_factor)
        return native.moe_route(logits, scoring_func, top_k, correction_bias, fixed_ids, routed_scaling_factor)

    def scores(x: torch.Tensor) -> torch.Tensor:
        width = -(-experts // ROUTE_ALIGN) * ROUTE_ALIGN
        padded = torch.cat([x, x.new_full((t, width - experts), float("-inf"))], dim=1) if width != experts else x
        out = torch.empty_like(padded)
        compiled("sqrt_softplus", experts=width, dtype=VECTOR_DTYPES[x.dtype])(padded.contiguous(), out)
        return out[:, :experts]

    return native.moe_route(logits, scoring_func, top_k, correction_bias, fixed_ids, routed_scaling_factor,
                            scoring={"sqrtsoftplus": scores})


#: ops whose wrapper reads values back to the host (no graph around them)
SYNCS_HOST: frozenset[str] = frozenset()  # the expert ops are grouped on the device (tilelang_moe)

#: this module's ops; :mod:`.tilelang_moe` and :mod:`.tilelang_kv_fp8` hold the others (all of them:
#: :func:`.registration.tilelang_kernel_ops`)
ALL_OPS = {"linear_fp8": linear_fp8, "hc_pre": hc_pre, "hc_post": hc_post,
           "hc_head": hc_head, "sparse_attention": sparse_attention, "compress_windows": compress_windows,
           "indexer_topk": indexer_topk, "act_quant_sim": act_quant_sim}

#: kernels registered only for a model that routes by ``sqrtsoftplus`` (DeepSeek-V4), so that other
#: models keep the torch_npu gating operator for ``moe_route``
ROUTE_OPS = {"moe_route": moe_route}

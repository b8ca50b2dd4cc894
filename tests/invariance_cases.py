"""Row-invariance checks of single ops: a row computed inside a batch against the same row alone.

Plain functions, shared by the CPU interpreter test (``test_nvidia_batch_invariance.py``) and the GPU
one (``gpu/test_gpu_batch_invariance.py``); :data:`SMALL` and :data:`FLASH` are the widths they use.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from deepinfer_core.quant.fp4 import quantize_fp4_block
from deepinfer_core.quant.fp8 import quantize_fp8_block

#: tiny widths (I = 40: not a multiple of 16), for the interpreter
SMALL = dict(D=64, H=4, hd=32, rope=16, n=2, E=6, k=2, I=40, pool=48, window=8, iheads=8, idim=16, L=4)
#: V4-Flash-like widths (hidden 4096, 64 heads of 512, 4 mHC streams, top-6 of 64 local experts)
FLASH = dict(D=4096, H=64, hd=512, rope=64, n=4, E=64, k=6, I=512, pool=2048, window=128, iheads=64, idim=128,
             L=4)

#: per op: the positional arguments holding one entry per row
ROW_ARGS: dict[str, tuple[int, ...]] = {
    "linear": (0,), "grouped_linear": (0,), "swiglu": (0,), "moe_route": (0, 4), "moe_experts": (0, 3, 4),
    "sparse_attention": (0, 2, 6), "indexer_topk": (0, 1, 3), "hc_pre": (0,), "hc_head": (0,),
    "linear_fp8": (0,), "moe_experts_fp8": (0, 5, 6), "moe_experts_fp4": (0, 5, 6), "rms_norm": (0,),
    "rotary_emb": (0, 1, 2), "compress_windows": (0, 1), "hc_post": (0, 1, 2, 3),
    # DeepSeek-V4.1
    "indexer_scores": (0, 1, 3), "candidate_blocks": (0, 1), "hc_mixes": (0,), "hc_collapse": (0, 1),
    "fp4_kv_sim": (0,),
}
#: per op: the per-row list padded to the batch's widest row (-1 slots, or False in a mask), cut to its
#: own width alone, and the other per-row arguments cut alike
TRIMMED = {"sparse_attention": (6,), "indexer_topk": (3,), "indexer_scores": (3,), "candidate_blocks": (1, 0)}
#: ops with an output column per slot of that list: alone a row gives its own width, inside the batch it
#: must give the same there and this padding beyond
COLUMN_OUTPUTS = {"indexer_scores": float("-inf"), "candidate_blocks": False}
#: other cases of an op, named ``op[variant]`` (the routing's other scorings and hash routing)
VARIANTS = ("moe_route[sigmoid]", "moe_route[softmax]", "moe_route[hash]")


def base_op(name: str) -> str:
    return name.split("[")[0]


def _prefix_lists(g: torch.Generator, rows: int, pool: int, most: int, extra_pad: int) -> torch.Tensor:
    """Index lists as the engine builds them: each row's used slots first, then -1 up to the batch's
    widest row plus ``extra_pad``."""
    counts = torch.randint(0, most + 1, (rows,), generator=g)
    out = torch.full((rows, int(counts.max()) + extra_pad), -1, dtype=torch.long)
    for r, c in enumerate(counts.tolist()):
        out[r, :c] = torch.randperm(pool, generator=g)[:c]
    return out


def make_case(op: str, rows: int, dtype: torch.dtype, seed: int, w: dict = SMALL) -> tuple:
    """Arguments of ``op`` for ``rows`` rows at widths ``w`` (on the CPU; see :func:`to_device`)."""
    g = torch.Generator().manual_seed(seed)

    def rn(*shape, std=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float32) * std).to(dtype)

    T, D, H, hd, n, E, k, I, pool = rows, w["D"], w["H"], w["hd"], w["n"], w["E"], w["k"], w["I"], w["pool"]
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    route_w = torch.rand(T, k, generator=g).to(dtype)
    if op == "linear":
        return rn(T, D), rn(3 * D // 2, D, std=D**-0.5), rn(3 * D // 2)
    if op == "grouped_linear":
        return rn(T, 4, D // 4), rn(4 * 64, D // 4, std=(D // 4) ** -0.5)
    if op == "swiglu":
        return rn(T, 2 * I, std=3.0), 7.0
    if op == "moe_route":
        return rn(T, E), "sqrtsoftplus", k, rn(E, std=0.1), None, 1.5
    if op == "moe_route[sigmoid]":
        return rn(T, E), "sigmoid", k, rn(E, std=0.1), None, 2.5
    if op == "moe_route[softmax]":
        return rn(T, E), "softmax", k, None, None, 1.0
    if op == "moe_route[hash]":
        return rn(T, E), "sqrtsoftplus", k, None, ids, 1.5
    if op == "moe_experts":
        return rn(T, D), rn(E, 2 * I, D, std=D**-0.5), rn(E, D, I, std=I**-0.5), ids, route_w, 7.0
    if op == "sparse_attention":
        window = torch.randint(-1, pool, (T, w["window"]), generator=g)
        extra = _prefix_lists(g, T, pool, 3 * w["window"], extra_pad=int(torch.randint(0, 40, (1,), generator=g)))
        return rn(T, H, hd), rn(pool, hd), window, rn(H), hd**-0.5, rn(pool, hd), extra
    if op == "indexer_topk":
        cand = _prefix_lists(g, T, pool, 3 * w["window"], extra_pad=9)
        return rn(T, w["iheads"], w["idim"]), rn(T, w["iheads"]), rn(pool, w["idim"]), cand, w["window"], 0.25
    if op == "hc_pre":
        return (rn(T, n, D), rn((2 + n) * n, n * D, std=(n * D) ** -0.5).float(), rn((2 + n) * n, std=0.5).float(),
                0.5 + rn(3).abs().float(), 20, 1e-6, 1e-6)
    if op == "hc_head":
        return (rn(T, n, D), rn(n, n * D, std=(n * D) ** -0.5).float(), rn(n, std=0.5).float(),
                0.5 + rn(1).abs().float(), 1e-6, 1e-6)
    if op == "hc_post":
        return rn(T, D), rn(T, n, D), rn(T, n).float(), rn(T, n, n).float().softmax(-1)
    if op == "linear_fp8":
        return (rn(T, D), *quantize_fp8_block(rn(3 * D // 2, D, std=D**-0.5).float()))
    if op == "moe_experts_fp8":
        return (rn(T, D), *quantize_fp8_block(rn(E, 2 * I, D, std=D**-0.5).float()),
                *quantize_fp8_block(rn(E, D, I, std=I**-0.5).float()), ids, route_w, 7.0)
    if op == "moe_experts_fp4":
        return (rn(T, D), *quantize_fp4_block(rn(E, 2 * 64, D, std=D**-0.5).float()),
                *quantize_fp4_block(rn(E, D, 64, std=64**-0.5).float()), ids, route_w, 7.0, True)
    if op == "rms_norm":
        return rn(T, D), 1 + rn(D, std=0.1), 1e-6
    if op == "rotary_emb":
        theta = torch.rand(T, w["rope"] // 2, generator=g) * 6.28
        return rn(T, H, hd), theta.cos().to(dtype), theta.sin().to(dtype), False
    if op == "compress_windows":
        gate = rn(T, w["L"], hd)
        gate[:, 0, :4] = float("-inf")
        return rn(T, w["L"], hd), gate
    if op == "indexer_scores":
        cand = _prefix_lists(g, T, pool, 3 * w["window"], extra_pad=9)
        return rn(T, w["iheads"], w["idim"]), rn(T, w["iheads"]), rn(pool, w["idim"]), cand, 0.25
    if op == "candidate_blocks":
        valid = _prefix_lists(g, T, pool, 3 * w["window"], extra_pad=9) >= 0
        return rn(*valid.shape).float(), valid, 4, w["window"] // 4
    if op == "hc_mixes":
        return (rn(T, n, D), rn((2 + n) * n, n * D, std=(n * D) ** -0.5).float(), rn((2 + n) * n, std=0.5).float(),
                0.5 + rn(3).abs().float(), 20, 1e-6, 1e-20)
    if op == "hc_collapse":
        return rn(T, n, D), torch.rand(T, n, generator=g)
    if op == "fp4_kv_sim":
        return rn(T, hd, std=3.0), 16
    raise KeyError(op)


def to_device(args: tuple, device: torch.device | str) -> tuple:
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def alone(op: str, args: tuple, row: int) -> tuple:
    """``args`` of the single row ``row``, its padded index list cut to its own width."""
    op = base_op(op)
    out = [a[row : row + 1] if i in ROW_ARGS[op] and isinstance(a, torch.Tensor) else a for i, a in enumerate(args)]
    if op in TRIMMED:
        lst = out[TRIMMED[op][0]]
        used = lst[0] if lst.dtype == torch.bool else lst[0] >= 0
        width = int(used.nonzero().max()) + 1 if used.any() else 0
        for i in TRIMMED[op]:
            out[i] = out[i][:, :width]
    return tuple(out)


def own_width(op: str, full: torch.Tensor, one: torch.Tensor) -> torch.Tensor | None:
    """The batch's row ``full`` at the width of the row alone (None: its columns beyond are not padding)."""
    op = base_op(op)
    if op not in COLUMN_OUTPUTS:
        return full
    width = one.shape[-1]
    return full[..., :width] if bool((full[..., width:] == COLUMN_OUTPUTS[op]).all()) else None


def same(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    """Bit-identical values (``torch.equal``; NaN equal to NaN)."""
    if a is None or a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))
    return torch.equal(a, b)


def row_differences(op: str, fn: Callable, dtype: torch.dtype, sizes: list[int], *, widths: dict = SMALL,
                    device: torch.device | str = "cpu", rows_checked: int | None = None) -> list[tuple[int, int]]:
    """(batch size, row) pairs whose result inside the batch differs from the row computed alone;
    ``rows_checked``: that many random rows per batch (default all)."""
    bad = []
    for size in sizes:
        args = to_device(make_case(op, size, dtype, seed=size, w=widths), device)
        full = fn(*args)
        full = full if isinstance(full, tuple) else (full,)
        rows = range(size) if rows_checked is None else random.Random(size).sample(range(size), min(size, rows_checked))
        for row in rows:
            one = fn(*alone(op, args, row))
            one = one if isinstance(one, tuple) else (one,)
            if not all(same(own_width(op, f[row : row + 1], o), o) for f, o in zip(full, one)):
                bad.append((size, row))
    return bad

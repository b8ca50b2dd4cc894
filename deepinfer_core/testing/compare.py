"""Comparison of op outputs against the reference, with the per-dtype tolerances stated in one place.

``assert_close`` checks floating outputs (shape, NaN/inf positions, cosine similarity, elementwise
``|a - e| <= atol + rtol * |e|``) and compares integer outputs exactly. ``assert_index_sets_match``
compares top-k style selections as sets per row, allowing them to differ only among entries whose
scores tie (within the dtype's tolerance) with the k-th best score.

Every failure message starts with ``name`` (say which op and which input case) and says what failed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float
    min_cosine: float


#: Tolerance of a candidate computing in ``dtype`` against the float64 reference on the same inputs.
#: Inputs are generated so that outputs are O(1); the cosine is taken over the finite entries.
TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(atol=1e-9, rtol=1e-7, min_cosine=1 - 1e-12),
    torch.float32: Tolerance(atol=1e-4, rtol=1e-4, min_cosine=1 - 1e-6),
    torch.bfloat16: Tolerance(atol=5e-2, rtol=2e-2, min_cosine=0.9995),
    torch.float16: Tolerance(atol=6e-3, rtol=2.5e-3, min_cosine=0.99995),
}

EXACT = Tolerance(atol=0.0, rtol=0.0, min_cosine=1.0)

_SHOW = 5  # how many mismatching positions a message lists


def tolerance_for(dtype: torch.dtype) -> Tolerance:
    try:
        return TOLERANCES[dtype]
    except KeyError:
        raise KeyError(f"no tolerance stated for {dtype}; known: {sorted(map(str, TOLERANCES))}") from None


def _is_float(t: torch.Tensor) -> bool:
    return t.dtype.is_floating_point or t.dtype.is_complex


def _positions(mask: torch.Tensor, limit: int = _SHOW) -> list[tuple[int, ...]]:
    return [tuple(int(i) for i in idx) for idx in mask.nonzero()[:limit]]


def _fmt_pos(pos: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, pos)) + ")"


def _show(mask: torch.Tensor, actual: torch.Tensor, expected: torch.Tensor) -> str:
    items = [
        f"{_fmt_pos(p)}: actual {actual[p].item():.6g} expected {expected[p].item():.6g}"
        for p in _positions(mask)
    ]
    return "; ".join(items)


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    dtype: torch.dtype | None = None,
    name: str = "output",
    exact: bool = False,
    check_dtype: torch.dtype | None = None,
    tol: Tolerance | None = None,
) -> None:
    """Raise ``AssertionError`` unless ``actual`` matches ``expected``.

    ``dtype`` picks the tolerance (default: ``actual.dtype``); ``exact`` demands equal values (NaN and
    inf at the same positions); integer/bool tensors always compare exactly. ``check_dtype`` also
    demands ``actual.dtype == check_dtype``.
    """
    if not isinstance(actual, torch.Tensor):
        raise AssertionError(f"{name}: expected a tensor, got {type(actual).__name__}")
    if check_dtype is not None and actual.dtype != check_dtype:
        raise AssertionError(f"{name}: dtype {actual.dtype}, expected {check_dtype}")
    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(f"{name}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    actual, expected = actual.detach().cpu(), expected.detach().cpu()
    if not _is_float(expected):
        _assert_equal_ints(actual, expected, name)
        return
    if not _is_float(actual):
        raise AssertionError(f"{name}: dtype {actual.dtype} is not floating point, expected {expected.dtype}")
    tol = EXACT if exact else (tol or tolerance_for(dtype or actual.dtype))
    a, e = actual.to(torch.float64), expected.to(torch.float64)

    for what, fa, fe in (
        ("NaN", torch.isnan(a), torch.isnan(e)),
        ("+inf", torch.isposinf(a), torch.isposinf(e)),
        ("-inf", torch.isneginf(a), torch.isneginf(e)),
    ):
        bad = fa != fe
        if bad.any():
            raise AssertionError(
                f"{name}: {what} at different positions ({int(bad.sum())} of {bad.numel()} differ; "
                f"actual has {int(fa.sum())}, expected {int(fe.sum())}); first: {_show(bad, a, e)}"
            )

    finite = torch.isfinite(e)
    if exact:
        bad = finite & (a != e)
        if bad.any():
            err = (a - e).abs().masked_fill(~bad, 0)
            where = _positions(err == err.max(), 1)[0]
            raise AssertionError(
                f"{name}: not exactly equal at {int(bad.sum())} of {bad.numel()} positions "
                f"(max abs err {err.max().item():.3g} at {_fmt_pos(where)}); first: {_show(bad, a, e)}"
            )
        return

    af, ef = a[finite], e[finite]
    if af.numel() == 0:
        return
    na, ne = af.norm(), ef.norm()
    both_tiny = af.abs().max() <= tol.atol and ef.abs().max() <= tol.atol
    if not both_tiny:
        cos = (af @ ef / (na * ne)).item() if na > 0 and ne > 0 else 0.0
        if not cos >= tol.min_cosine:
            raise AssertionError(
                f"{name}: cosine similarity {cos:.9f} < {tol.min_cosine} "
                f"(|actual| {na.item():.4g}, |expected| {ne.item():.4g}, over {af.numel()} finite entries)"
            )

    err = (a - e).abs().masked_fill(~finite, 0)
    bound = tol.atol + tol.rtol * e.abs().masked_fill(~finite, 0)
    bad = err > bound
    if bad.any():
        rel = (err / e.abs()).masked_fill(~finite | (e == 0), 0)
        at_abs = _positions(err == err.max(), 1)[0]
        at_rel = _positions(rel == rel.max(), 1)[0]
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {bad.numel()} elements outside "
            f"atol={tol.atol:g} + rtol={tol.rtol:g}*|e|; "
            f"max abs err {err.max().item():.4g} at {_fmt_pos(at_abs)}, "
            f"max rel err {rel.max().item():.4g} at {_fmt_pos(at_rel)}; first: {_show(bad, a, e)}"
        )


def _assert_equal_ints(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    if _is_float(actual):
        raise AssertionError(f"{name}: dtype {actual.dtype} is floating point, expected {expected.dtype}")
    bad = actual.to(torch.int64) != expected.to(torch.int64)
    if bad.any():
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {bad.numel()} values differ (integer outputs compare exactly); "
            f"first: "
            + "; ".join(
                f"{_fmt_pos(p)}: actual {int(actual[p])} expected {int(expected[p])}" for p in _positions(bad)
            )
        )


def assert_index_sets_match(
    actual: torch.Tensor,
    expected: torch.Tensor,
    scores: torch.Tensor,
    *,
    dtype: torch.dtype,
    name: str = "indices",
    ordered: bool = False,
    tol: Tolerance | None = None,
) -> None:
    """Compare top-k selections row by row, as sets, up to ties.

    ``actual``/``expected`` are ``[R, k]`` column indices into ``scores`` (``[R, S]``, float64,
    ``-inf`` = not selectable); ``-1`` pads a row whose selectable entries are fewer than k, and must
    come last. The sets may differ only in entries whose score lies within ``atol + rtol * max|score|``
    of the k-th best score of the row (a tie). With ``ordered`` the picks must also be best first
    (again up to that tolerance).
    """
    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(f"{name}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    if _is_float(actual):
        raise AssertionError(f"{name}: dtype {actual.dtype} is floating point, expected integer ids")
    actual, expected = actual.detach().cpu().to(torch.int64), expected.cpu().to(torch.int64)
    scores = scores.detach().cpu().to(torch.float64)
    tol = tol or tolerance_for(dtype)
    n_cols = scores.shape[-1]
    for r in range(actual.shape[0]):
        a_row, e_row, s_row = actual[r].tolist(), expected[r].tolist(), scores[r]
        finite = s_row[torch.isfinite(s_row)]
        tie = tol.atol + tol.rtol * (finite.abs().max().item() if finite.numel() else 0.0)
        where = f"{name}: row {r}"
        a_valid = [i for i in a_row if i != -1]
        e_valid = [i for i in e_row if i != -1]
        if a_row[: len(a_valid)] != a_valid:
            raise AssertionError(f"{where}: padding -1 must come after every pick, got {a_row}")
        if len(a_valid) != len(e_valid):
            raise AssertionError(
                f"{where}: {len(a_valid)} picks, expected {len(e_valid)} (the row has {finite.numel()} "
                f"selectable entries); actual {a_row}"
            )
        for i in a_valid:
            if not 0 <= i < n_cols or not torch.isfinite(s_row[i]):
                raise AssertionError(f"{where}: picked {i}, which is not selectable; actual {a_row}")
        if len(set(a_valid)) != len(a_valid):
            raise AssertionError(f"{where}: duplicate picks in {a_row}")
        if not e_valid:
            continue
        kth = min(s_row[i].item() for i in e_valid)
        differ = sorted(set(a_valid) ^ set(e_valid))
        off = [i for i in differ if abs(s_row[i].item() - kth) > tie]
        if off:
            missing = [(i, round(s_row[i].item(), 6)) for i in sorted(set(e_valid) - set(a_valid))]
            extra = [(i, round(s_row[i].item(), 6)) for i in sorted(set(a_valid) - set(e_valid))]
            raise AssertionError(
                f"{where}: selected set differs beyond ties: missing (id, score) {missing[:_SHOW]}, "
                f"extra {extra[:_SHOW]}; k-th best score {kth:.6g}, tie tolerance {tie:.3g}"
            )
        if ordered:
            vals = [s_row[i].item() for i in a_valid]
            for j in range(1, len(vals)):
                if vals[j] > vals[j - 1] + tie:
                    raise AssertionError(
                        f"{where}: not best first: pick {j} (id {a_valid[j]}, score {vals[j]:.6g}) scores "
                        f"above pick {j - 1} (id {a_valid[j - 1]}, score {vals[j - 1]:.6g})"
                    )

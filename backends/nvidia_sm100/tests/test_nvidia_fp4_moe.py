"""The Triton FP4 grouped MoE of nvidia_sm100 (``triton_ops.moe_experts_fp4`` over ``fp4_moe_kernels``) on the
CPU under Triton's interpreter, against the core's native body (the cpu_ref reference of
``moe_experts_fp4``), and its registration (served by default; ``DEEPINFER_NVIDIA_FP4_TRITON=0`` turns it off).

The kernels run in one fresh process (``nvidia_fp4_moe_worker.py``, which also builds the inputs: see its
``moe_case`` for the cases): Triton decides when it is first imported whether it interprets. The
references are computed here. Tolerances, per element, are relative to the largest |reference| of the
element's output column (the cases' down projections spread their columns over four orders of magnitude):

* W4A16 (``quant_act=False``), against the native body in float64 (the weights dequantised exactly, no
  rounding): :data:`W4A16_TOL`. The kernel rounds only h and the output to the dtype; the native body in
  bfloat16, which rounds every step, is itself 1.4e-2 away. Measured (Triton 3.6 interpreter): float32
  2.4e-6, float16 8.6e-4, bfloat16 7.9e-3.
* DeepSeek's numerics (``quant_act=True``), against the native body in the same dtype, which rounds where
  the kernel rounds: float32 within :data:`QUANT_F32_TOL`; bfloat16 and float16 equal except on at most
  :data:`QUANT_MAX_DIFFERING` of the elements (a sum of another order rounding the other way, which can
  move an E4M3 step of h), those within the W4A16 tolerance; the ``exact`` case (every sum exact in
  float32) bit for bit. Measured: float32 1.9e-7, bfloat16 and float16 bit for bit in every case.
* the activation quantisation: bit for bit :func:`~deepinfer_core.quant.fp4.fake_quant_act_ue8m0`.
* the op table built with the switch: ``moe_experts_fp4`` served by the kernel, not flagged as syncing
  the host, and the conformance suite's cases (its own tolerances) at the tiny preset.

The GPU counterpart (V4-Flash shapes, CUDA-graph capture) is ``gpu/test_gpu_fp4_moe.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from nvidia_fp4_moe_worker import (
    CASES,
    QUANT_ACT_CASES,
    TABLE_OPS,
    TILE_CASES,
    act_rows,
    case_id,
    moe_case,
    quant_act_case,
    quant_act_id,
    tile_case_id,
)
from nvidia_interpreter import check_served_by_default_and_switch, run_worker, triton_installed

from deepinfer_core.ops import native
from deepinfer_core.quant.fp4 import fake_quant_act_ue8m0

BACKEND = "nvidia_sm100"
WORKER = Path(__file__).resolve().parent / "nvidia_fp4_moe_worker.py"
FP4_ENV = "DEEPINFER_NVIDIA_FP4_TRITON"
W4A16_TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}
W4A16_MIN_COSINE = {torch.float32: 1 - 1e-9, torch.float16: 1 - 1e-6, torch.bfloat16: 1 - 2e-5}
QUANT_F32_TOL = 1e-6
QUANT_MAX_DIFFERING = 0.01


needs_triton = pytest.mark.skipif(not triton_installed(), reason="triton is not installed")


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    return run_worker(WORKER, tmp_path_factory.mktemp("fp4_moe") / "results.pt", FP4_ENV)


def _float64(args: tuple) -> tuple:
    """x and the routing weights in float64; the packed weights and their scales as they are."""
    return tuple(a.double() if i in (0, 6) else a for i, a in enumerate(args))


def _normalised_error(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| / the largest |want| of the column (1 where a column is all zero)."""
    column = want.abs().amax(dim=0, keepdim=True)
    return (got.double() - want.double()).abs() / torch.where(column > 0, column, torch.ones_like(column))


def _cosine(got: torch.Tensor, want: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(got.double().flatten(), want.double().flatten(), dim=0).item()


@needs_triton
@pytest.mark.parametrize("name, dtype, quant_act", CASES, ids=[case_id(*c) for c in CASES])
def test_kernel_matches_the_native_body(name, dtype, quant_act, interpreted):
    check_against_native(moe_case(name, dtype, quant_act), interpreted["moe"][case_id(name, dtype, quant_act)],
                         exact=name == "exact")


@needs_triton
@pytest.mark.parametrize("tiles, dtype, quant_act", TILE_CASES, ids=[tile_case_id(*c) for c in TILE_CASES])
def test_other_launch_shapes_match_the_native_body(tiles, dtype, quant_act, interpreted):
    """The ``ragged`` case (hidden 96, intermediate 160) with 128- and 256-input K steps, which run past
    the rows' ends, and narrower column blocks: the same tolerances as the default shapes."""
    got = interpreted["tiles"][tile_case_id(tiles, dtype, quant_act)]
    check_against_native(moe_case("ragged", dtype, quant_act), got)


def check_against_native(args: tuple, got: torch.Tensor, exact: bool = False) -> None:
    """``moe_experts_fp4(*args)`` by the kernel (``got``) against the native body, by the rules above."""
    dtype, quant_act = args[0].dtype, args[-1]
    assert got.dtype == dtype and got.shape == args[0].shape
    ids = args[5]
    unrouted = (ids < 0).all(dim=1)
    assert unrouted.any() and torch.equal(got[unrouted], torch.zeros_like(got[unrouted]))
    if not quant_act:
        want = native.moe_experts_fp4(*_float64(args))
        err = _normalised_error(got, want).max().item()
        assert err <= W4A16_TOL[dtype], (err, W4A16_TOL[dtype])
        assert _cosine(got, want) >= W4A16_MIN_COSINE[dtype]
        return
    want = native.moe_experts_fp4(*args)
    err = _normalised_error(got, want)
    if dtype == torch.float32:
        assert err.max().item() <= QUANT_F32_TOL, err.max().item()
    elif exact:
        assert torch.equal(got, want), f"{int((got != want).sum())} elements differ"
    else:
        differing = (got != want).double().mean().item()
        assert differing <= QUANT_MAX_DIFFERING, differing
        assert err.max().item() <= W4A16_TOL[dtype], err.max().item()


@needs_triton
@pytest.mark.parametrize("op, block, dtype", QUANT_ACT_CASES, ids=[quant_act_id(*c) for c in QUANT_ACT_CASES])
def test_quant_act_kernels_match_the_native_body(op, block, dtype, interpreted):
    """DeepSeek's numerics per 32 channels (V4.1) on FP4 experts, and on float experts per 32 and 128: the
    native body in the same dtype, within the quant_act rule above."""
    args = quant_act_case(op, block, dtype)
    got = interpreted["quant_act"][quant_act_id(op, block, dtype)]
    assert got.dtype == dtype and got.shape == args[0].shape
    unrouted = (args[-3 if op == "moe_experts_act_quant" else -4] < 0).all(dim=1)  # topk_ids
    assert unrouted.any() and torch.equal(got[unrouted], torch.zeros_like(got[unrouted]))
    want = getattr(native, op)(*args)
    err = _normalised_error(got, want)
    if dtype == torch.float32:
        assert err.max().item() <= QUANT_F32_TOL, err.max().item()
    else:
        differing = (got != want).double().mean().item()
        assert differing <= QUANT_MAX_DIFFERING, differing
        assert err.max().item() <= W4A16_TOL[dtype], err.max().item()


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_activation_quantisation_is_bit_for_bit(dtype, interpreted):
    got = interpreted["act"][str(dtype)]
    want = fake_quant_act_ue8m0(act_rows(dtype)).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"{int((got != want).sum())} differ"
    got32 = interpreted["act"][f"{dtype}/32"]  # V4.1's groups, in the model dtype
    want32 = fake_quant_act_ue8m0(act_rows(dtype), 32)
    assert got32.dtype == dtype and torch.equal(got32, want32), f"{int((got32 != want32).sum())} differ"


@needs_triton
@pytest.mark.parametrize("op", TABLE_OPS)
@pytest.mark.parametrize("dtype", ["torch.float32", "torch.bfloat16"])
def test_the_switch_serves_the_kernel_which_conforms(op, dtype, interpreted):
    entry = interpreted["tables"][f"{op}/{dtype}"]
    assert "error" not in entry, entry["error"]
    assert (entry["module"], entry["name"]) == ("deepinfer_nvidia_sm100.triton_ops", op)
    assert entry["provider"] == f"deepinfer.backends:{BACKEND}"
    assert entry["syncs_host"] == []  # CUDA-graph capturable: the engine may capture the MoE
    assert entry["cases"] >= 1 and not entry["failed"], "\n\n".join(entry["failed"])


@pytest.mark.parametrize("op", TABLE_OPS)
def test_the_kernel_serves_by_default_and_its_switch_turns_it_off(op, monkeypatch):
    from deepinfer_nvidia_sm100 import registration, triton_ops

    assert registration.FP4_TRITON_ENV == FP4_ENV
    reg = check_served_by_default_and_switch(monkeypatch, op, FP4_ENV, getattr(triton_ops, op), TABLE_OPS)
    assert getattr(native, op) in [impl.fn for impl in reg.candidates(op)]

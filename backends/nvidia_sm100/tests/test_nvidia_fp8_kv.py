"""The Triton ``sparse_attention_fp8`` of nvidia_sm100 (``triton_ops.sparse_attention_fp8`` over
``fp8_kv_kernels``: the FP8 KV entries read in place, decoded in registers) on the CPU under Triton's
interpreter, against the core's native body (the cpu_ref reference of ``sparse_attention_fp8``), and its
registration (served by default; ``DEEPINFER_NVIDIA_FP8_KV_TRITON=0`` turns it off).

The kernel runs in one fresh process (``nvidia_fp8_kv_worker.py``, which also builds the inputs: see its
``attention_case`` for the cases: a partial scale group, heads and widths that are not powers of two, -1
slots, a token with no key, window and extra lists, group sizes 2^-24 .. 2^6, unaligned entries, 64 heads
x 512). The references are computed here. Errors, per element, are relative to the largest |reference| of
the element's (token, head) row (the cases' outputs span several orders of magnitude):

* against the native body in float64 on the same entries (decoded exactly): :data:`TOL` and
  :data:`MIN_COSINE`. Measured (Triton 3.6 interpreter): float32 4.2e-7, float16 6.6e-4, bfloat16 1.2e-2
  (1 - cosine 2.4e-14, 2.2e-8, 3.2e-6); the native body in the queries' dtype (the cpu_ref reference) is
  itself 9.2e-7, 4.2e-4 and 3.5e-3 away. bfloat16 is further off than the reference because the
  interpreter truncates the probabilities' float32-to-bfloat16 cast (a compiled kernel rounds to nearest).
* the ``exact`` case (one key per token, sinks -inf: the output is the key's row, every finite E4M3 code,
  scales 2^-40 .. 2^40): bit for bit the native body, in float32 and bfloat16.
* against the Triton ``sparse_attention`` on pools of the same entries decoded: float32 within
  :data:`DENSE_F32_TOL` (measured 7.2e-7: the K dimension summed in 64-wide rather than 128-wide chunks);
  bfloat16 and float16 differ in at most :data:`DENSE_MAX_DIFFERING` of the elements (measured: 0 in the
  small cases, 4e-5 at 64 x 512, where a bfloat16 probability rounds the other way).
* the op table built with the switch: ``sparse_attention_fp8`` served by the kernel, not flagged as
  syncing the host, and the conformance suite's cases (its own tolerances) at the tiny preset.

The GPU counterpart (V4-Flash decode shapes, CUDA-graph capture) is ``gpu/test_gpu_fp8_kv.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from deepinfer_cpu_ref.ops import ALL_OPS as REF
from nvidia_fp8_kv_worker import CASES, attention_case, case_id
from nvidia_interpreter import check_served_by_default_and_switch, run_worker, triton_installed

from deepinfer_core.ops import native
from deepinfer_core.quant.kv_fp8 import pack_kv_fp8

BACKEND = "nvidia_sm100"
WORKER = Path(__file__).resolve().parent / "nvidia_fp8_kv_worker.py"
FP8_KV_ENV = "DEEPINFER_NVIDIA_FP8_KV_TRITON"
TOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 2.5e-2}
MIN_COSINE = {torch.float32: 1 - 1e-12, torch.float16: 1 - 2e-7, torch.bfloat16: 1 - 2e-5}
DENSE_F32_TOL = 2e-6
DENSE_MAX_DIFFERING = 1e-3


needs_triton = pytest.mark.skipif(not triton_installed(), reason="triton is not installed")


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    return run_worker(WORKER, tmp_path_factory.mktemp("fp8_kv") / "results.pt", FP8_KV_ENV)


def _float64(args: tuple) -> tuple:
    """The queries and sinks in float64; the entries (and the dtype of their RoPE values) as they are."""
    q, kv, idx, sinks, *rest = args
    return (q.double(), kv, idx, sinks.double(), *rest)


def _row_error(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| / the largest |want| of the (token, head) row (1 where a row is all zero)."""
    row = want.double().abs().amax(dim=-1, keepdim=True)
    return (got.double() - want.double()).abs() / torch.where(row > 0, row, torch.ones_like(row))


def _cosine(got: torch.Tensor, want: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(got.double().flatten(), want.double().flatten(), dim=0).item()


@needs_triton
@pytest.mark.parametrize("name, dtype", CASES, ids=[case_id(*c) for c in CASES])
def test_kernel_matches_the_native_body(name, dtype, interpreted):
    args = attention_case(name, dtype)
    got = interpreted["fp8"][case_id(name, dtype)]
    assert got.dtype == dtype and got.shape == args[0].shape
    if name == "exact":
        for want in (native.sparse_attention_fp8(*args), REF["sparse_attention_fp8"](*args)):
            assert torch.equal(got, want), f"{int((got != want).sum())} elements differ"
        return
    # token 0 has no key: only the sink, whose value is zero
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    want = native.sparse_attention_fp8(*_float64(args))
    err = _row_error(got, want).max().item()
    assert err <= TOL[dtype], (err, TOL[dtype])
    assert _cosine(got, want) >= MIN_COSINE[dtype]
    # and the cpu_ref reference in the queries' dtype, within the same tolerance of float64
    assert _row_error(REF["sparse_attention_fp8"](*args), want).max().item() <= TOL[dtype]


@needs_triton
@pytest.mark.parametrize("name, dtype", CASES, ids=[case_id(*c) for c in CASES])
def test_split_kernel_matches_the_native_body(name, dtype, interpreted):
    """Each query's columns split over three programs (what a small batch runs), then merged."""
    args = attention_case(name, dtype)
    got = interpreted["fp8_split"][case_id(name, dtype)]
    assert got.dtype == dtype and got.shape == args[0].shape
    want = native.sparse_attention_fp8(*_float64(args))
    assert _row_error(got, want).max().item() <= TOL[dtype]
    assert _cosine(got, want) >= MIN_COSINE[dtype]


@needs_triton
@pytest.mark.parametrize("name, dtype", CASES, ids=[case_id(*c) for c in CASES])
def test_kernel_matches_the_dense_kernel(name, dtype, interpreted):
    got = interpreted["fp8"][case_id(name, dtype)]
    dense = interpreted["dense"][case_id(name, dtype)]
    if dtype == torch.float32:
        assert _row_error(got, dense).max().item() <= DENSE_F32_TOL
    else:
        differing = (got != dense).double().mean().item()
        assert differing <= DENSE_MAX_DIFFERING, differing


@needs_triton
@pytest.mark.parametrize("dtype", ["torch.float32", "torch.bfloat16"])
def test_the_switch_serves_the_kernel_which_conforms(dtype, interpreted):
    entry = interpreted["tables"][dtype]
    assert "error" not in entry, entry["error"]
    assert (entry["module"], entry["name"]) == ("deepinfer_nvidia_sm100.triton_ops", "sparse_attention_fp8")
    assert entry["provider"] == f"deepinfer.backends:{BACKEND}"
    assert entry["syncs_host"] == []  # CUDA-graph capturable
    assert entry["cases"] == 2 and not entry["failed"], "\n\n".join(entry["failed"])


def test_the_kernel_serves_by_default_and_its_switch_turns_it_off(monkeypatch):
    from deepinfer_nvidia_sm100 import registration, triton_ops

    assert registration.FP8_KV_TRITON_ENV == FP8_KV_ENV
    check_served_by_default_and_switch(monkeypatch, "sparse_attention_fp8", FP8_KV_ENV, triton_ops.sparse_attention_fp8)


def test_the_launcher_checks_the_entries_and_sends_float64_to_the_native_body():
    """Neither path reaches Triton: a pool whose entries are not the queries' width is an error naming it;
    RoPE values in float64 (a dtype the kernel does not decode) are the native body's."""
    from deepinfer_nvidia_sm100 import triton_ops

    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 128, generator=g)
    kv = pack_kv_fp8(torch.randn(6, 128, generator=g), 64)  # 64 + 256 + 1 bytes -> 328
    idx = torch.tensor([[0, 1, -1], [2, -1, 5]])
    sinks = torch.randn(4, generator=g)
    with pytest.raises(ValueError, match="kv must be uint8 entries"):
        triton_ops.sparse_attention_fp8(q, kv[:, :-8], idx, sinks, 0.1, 64, torch.float32)
    with pytest.raises(ValueError, match="extra_kv must be uint8 entries"):
        triton_ops.sparse_attention_fp8(q, kv, idx, sinks, 0.1, 64, torch.float32, kv[:, 8:], idx)
    kv64 = pack_kv_fp8(torch.randn(6, 128, generator=g, dtype=torch.float64), 64)
    got = triton_ops.sparse_attention_fp8(q.double(), kv64, idx, sinks.double(), 0.1, 64, torch.float64)
    assert torch.equal(got, native.sparse_attention_fp8(q.double(), kv64, idx, sinks.double(), 0.1, 64, torch.float64))

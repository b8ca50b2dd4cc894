"""The library adapters chosen only on request (slower than the Triton kernels at the shapes measured on
an H200, or not measured yet) against cpu_ref at the v4_flash preset, so that opting in stays correct. Skipped where the
library is not installed or its self-check failed."""

from __future__ import annotations

import pytest
import torch
from gpu_support import BACKEND, V4_FLASH_WIDTHS, gpu_marks

from deepinfer_core.plugins import build_op_table
from deepinfer_core.testing import conformance as conf

pytestmark = gpu_marks()

OPT_INS = [("sparse_attention", "FLASH_MLA_BF16_ENV", "flash_mla_sparse_attention"),
           ("moe_experts", "DEEPGEMM_MOE_ENV", "deep_gemm_moe_experts"),
           ("hc_pre", "DEEPGEMM_HC_ENV", "deep_gemm_hc_pre")]


@pytest.mark.parametrize("op, env, fn", OPT_INS, ids=[o[0] for o in OPT_INS])
def test_opted_in_adapter_matches_cpu_ref(op, env, fn, monkeypatch, device):
    from deepinfer_nvidia_sm100 import external

    monkeypatch.setenv(getattr(external, env), "1")
    table = build_op_table(BACKEND, dtype=torch.bfloat16, device=device, model_config=V4_FLASH_WIDTHS,
                           allow_reference_fallback=True)
    if table.chosen[op].fn is not getattr(external, fn):
        pytest.skip(f"{fn} does not serve {op} here (library not installed, or its self-check failed)")
    results = conf.check_op(op, table, conf.reference_op_table(), "v4_flash", torch.bfloat16, device=device,
                            backend=BACKEND)
    assert results and not any(r.fallback for r in results)
    failed = [r for r in results if not r.passed]
    assert not failed, "\n\n".join(str(r) for r in failed)

"""Running nvidia_sm100's Triton kernels on the CPU under Triton's interpreter, in a fresh process (the
switches must be set before triton is first imported): the parent's fixture and the worker's op-table
record, and the check of their switches, shared by the FP4 MoE and FP8 KV kernels' tests
(``test_nvidia_fp4_moe.py``, ``test_nvidia_fp8_kv.py``)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import traceback
from pathlib import Path

import torch

BACKEND = "nvidia_sm100"


def triton_installed() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def run_worker(worker: Path, out: Path, switch: str) -> dict:
    """Run ``worker OUT`` under the interpreter with ``switch`` on (the Triton FP8 GEMM and MoE switched off)
    and load what it saved."""
    env = {**os.environ, "DEEPINFER_NVIDIA_ALLOW_CPU": "1", "TRITON_INTERPRET": "1", switch: "1"}
    env["DEEPINFER_NVIDIA_FP8_TRITON"] = "0"
    done = subprocess.run([sys.executable, str(worker), str(out)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0 and out.exists(), f"the interpreter run failed:\n{done.stderr[-4000:]}"
    return torch.load(out, weights_only=False)


def op_table_record(op: str, dtype: torch.dtype) -> dict:
    """In the worker: what the backend's op table serves ``op`` with, and its conformance results at the
    tiny preset (or the traceback of what failed)."""
    from deepinfer_core.testing import conformance as conf

    entry: dict = {}
    try:
        table = conf.candidate_op_table(BACKEND, dtype, conf.backend_device(BACKEND))
        fn = table.chosen[op].fn
        entry.update(module=fn.__module__, name=fn.__name__, provider=table.provider(op),
                     syncs_host=table.syncs_host([op]))
        results = conf.check_op(op, table, conf.reference_op_table(), "tiny", dtype, backend=BACKEND)
        entry["cases"] = len(results)
        entry["failed"] = [str(r) for r in results if not r.passed or r.fallback]
    except Exception:
        entry["error"] = traceback.format_exc()
    return entry


def check_served_by_default_and_switch(monkeypatch, op: str, env: str, kernel, switched=None):
    """The kernel of ``op`` is registered whatever ``env`` says; it serves on the dtypes the Triton kernels
    take unless ``env=0``, which leaves ``op`` to the native body and changes no op but those of ``switched``
    (default: ``op`` alone). Read when a table is built. Returns the registry (switch unset)."""
    from deepinfer_nvidia_sm100 import capability, registration

    from deepinfer_core.ops.registry import BuildContext
    from deepinfer_core.plugins import collect_registry, load_backend

    monkeypatch.setenv("DEEPINFER_NVIDIA_ALLOW_CPU", "1")
    monkeypatch.setattr(capability, "triton_usable", lambda device=None: (True, ""))

    def labels(switch, dtype):
        if switch is None:
            monkeypatch.delenv(env, raising=False)
        else:
            monkeypatch.setenv(env, switch)
        return registration.op_labels(reg, BuildContext(backend=BACKEND, dtype=dtype, device=torch.device("cpu")))

    monkeypatch.delenv(env, raising=False)
    reg = collect_registry(load_backend(BACKEND))
    assert kernel in [impl.fn for impl in reg.candidates(op)]
    default, on, off = (labels(switch, torch.bfloat16) for switch in (None, "1", "0"))
    assert default[op] == on[op] == "triton"
    assert off[op] == "torch"
    assert {o for o in default if default[o] != off[o]} == set(switched or {op})
    assert labels(None, torch.float32)[op] == "triton"
    assert labels(None, torch.float64)[op] == "torch"
    return reg

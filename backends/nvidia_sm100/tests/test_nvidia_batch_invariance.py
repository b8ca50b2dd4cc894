"""Batch-invariant mode on the nvidia_sm100 backend, on the CPU under Triton's interpreter.

* Ops: every op the mode resolves to a batch-invariant implementation (and the default kernels
  declared invariant by construction) conforms to cpu_ref and gives, for each row of batches of
  random sizes, exactly (``torch.equal``) what it gives for the row alone.
* The engine: the tiny model builds in the mode (no ``MissingOpError``), every op served by this
  backend; slow: a request alone and inside random batches gives identical tokens and logprobs.

The interpreted work runs in fresh processes (``nvidia_invariance_worker.py``): Triton decides when it
is first imported whether it interprets. The GPU counterpart is ``gpu/test_gpu_batch_invariance.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from invariance_cases import ROW_ARGS, VARIANTS

from deepinfer_core.ops.catalogue import CATALOGUE
from deepinfer_core.ops.registry import MissingOpError
from deepinfer_core.plugins import build_op_table

BACKEND = "nvidia_sm100"
PROVIDER = f"deepinfer.backends:{BACKEND}"
WORKER = Path(__file__).resolve().parent / "nvidia_invariance_worker.py"
NOT_INVARIANT_BY_DEFAULT = sorted(op for op, spec in CATALOGUE.items() if not spec.batch_invariant)
#: batch sizes: 2, then two drawn at random (fixed seed, so a failure can be replayed), the second
#: above 32 rows (more than one row tile of every GEMM)
_rng = random.Random(21)
SIZES = [2, _rng.randrange(3, 17), _rng.randrange(33, 41)]


def _triton_installed() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


needs_triton = pytest.mark.skipif(not _triton_installed(), reason="triton is not installed")


def _interpreted(*args: str, timeout: int) -> dict:
    env = {**os.environ, "DEEPINFER_NVIDIA_ALLOW_CPU": "1", "TRITON_INTERPRET": "1"}
    env["DEEPINFER_NVIDIA_FP8_TRITON"] = "0"
    done = subprocess.run([sys.executable, str(WORKER), *args], capture_output=True, text=True, env=env,
                          timeout=timeout)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULTS ")), None)
    assert done.returncode == 0 and line, f"the interpreter run failed:\n{done.stderr[-4000:]}"
    return json.loads(line[len("RESULTS "):])


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return _interpreted("ops", ",".join(map(str, SIZES)), timeout=900)


@needs_triton
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("op", sorted({*ROW_ARGS, *VARIANTS, *NOT_INVARIANT_BY_DEFAULT}))
def test_invariant_op_conforms_and_each_row_equals_the_row_alone(op, dtype, interpreted):
    result = interpreted["ops"][f"{op}/{dtype}"]
    assert result["conform"], result["message"]
    assert result["provider"] == PROVIDER and result["declared"], result
    assert not result["rows"], f"{op}: (batch size, row) differing from alone: {result['rows'][:8]}"


@needs_triton
def test_engine_builds_in_batch_invariant_mode(interpreted):
    chosen = interpreted["build"]
    assert set(chosen) == set(CATALOGUE)
    assert {impl["provider"] for impl in chosen.values()} == {PROVIDER}
    for op in NOT_INVARIANT_BY_DEFAULT:
        assert chosen[op]["declared"], op
        assert chosen[op]["invariant_ops"], (op, chosen[op])


@needs_triton
@pytest.mark.slow
def test_request_alone_equals_it_inside_random_batches():
    result = _interpreted("engine", "0", "2", timeout=1800)
    assert result["providers"] == [PROVIDER]
    for run in result["runs"]:
        assert run["same"] and run["steps"] == 6, run


def test_without_triton_the_mode_names_the_ops_it_lacks(monkeypatch):
    """On the CPU without the interpreter only the native bodies serve: the mode is refused, by op."""
    monkeypatch.setenv("DEEPINFER_NVIDIA_ALLOW_CPU", "1")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(MissingOpError, match="batch-invariant") as err:
        build_op_table(BACKEND, dtype=torch.float32, device=torch.device("cpu"), batch_invariant=True)
    for op in NOT_INVARIANT_BY_DEFAULT:
        assert repr(op) in str(err.value)

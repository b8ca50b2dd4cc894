"""Fixtures of the GPU suite (``pytest -m gpu backends/nvidia_sm100/tests/gpu``): every test here needs a
CUDA device on which the nvidia_sm100 backend is available, and is skipped, with the reason, elsewhere.

Checkpoints are the tiny DeepSeek-V4 models of ``deepinfer_core.testing.tiny_model``, built once per
session. TF32 is switched off for the whole suite: float32 results must match the float32/float64 CPU
reference, which TF32 matmuls (10-bit mantissa) would not.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from gpu_support import BACKEND


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With ``DEEPINFER_TEST_TIMES`` set, one line per test phase (node id, phase, seconds, outcome)
    appended to that file as it ends: the times survive a run stopped by its time limit, which pytest's
    ``--durations`` table (printed at the end) does not."""
    path = os.environ.get("DEEPINFER_TEST_TIMES")
    if path and "PYTEST_XDIST_WORKER" not in os.environ:  # with xdist the controller writes every report
        with open(path, "a") as f:
            f.write(f"{report.nodeid}\t{report.when}\t{report.duration:.2f}\t{report.outcome}\n")


@pytest.fixture(scope="session", autouse=True)
def no_tf32() -> Iterator[None]:
    if not torch.cuda.is_available():
        yield
        return
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.fixture(scope="session")
def device() -> torch.device:
    from deepinfer_core.testing.conformance import backend_device

    return backend_device(BACKEND)


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``tiny_path(name)``: the folder of the tiny checkpoint ``name`` (seed 0), built once."""
    from deepinfer_core.testing.tiny_model import build_tiny_checkpoint

    built: dict[str, Path] = {}

    def get(name: str = "tiny") -> Path:
        if name not in built:
            built[name] = build_tiny_checkpoint(tmp_path_factory.mktemp(f"gpu_{name}"), name)
        return built[name]

    return get

"""Pytest setup shared by the core's tests (tests/) and the backends' (backends/<name>/tests/): the
command-line options, and tests/ on the import path for the shared fixtures and helpers there."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "tests"))


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("deepinfer")
    group.addoption(
        "--backend",
        action="store",
        default="cpu_ref",
        help="backend whose ops the conformance suite checks against cpu_ref (default: cpu_ref)",
    )


@pytest.fixture(scope="session")
def backend_name(request: pytest.FixtureRequest) -> str:
    """The backend chosen with ``--backend``."""
    return request.config.getoption("--backend")

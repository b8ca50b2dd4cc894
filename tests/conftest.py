"""Shared pytest setup. Command-line options come first, fixtures after; append new ones at the end."""

from __future__ import annotations

import pytest

# --- command-line options --------------------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("deepinfer")
    group.addoption(
        "--backend",
        action="store",
        default="cpu_ref",
        help="backend whose ops the conformance suite checks against cpu_ref (default: cpu_ref)",
    )


# --- fixtures --------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def backend_name(request: pytest.FixtureRequest) -> str:
    """The backend chosen with ``--backend``."""
    return request.config.getoption("--backend")

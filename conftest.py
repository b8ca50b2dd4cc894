"""Pytest setup shared by the core's tests (tests/) and the backends' (backends/<name>/tests/): the
command-line options, tests/ on the import path for the shared fixtures and helpers there, and the
grouping that keeps multi-process tests on one pytest-xdist worker."""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "tests"))


#: test folders whose tests start several processes (ranks) each: under ``pytest -n 2 --dist loadgroup`` they
#: run one at a time on one worker, so two of them never share the cores (their hung-rank timeouts assume
#: the ranks get to run)
MULTIPROCESS = ("tests/parallel/",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.startswith(MULTIPROCESS):
            item.add_marker(pytest.mark.xdist_group("multiprocess"))


@pytest.fixture(autouse=True, scope="module")
def collect_cycles_after_each_module() -> Iterator[None]:
    """Free what a test file's engines and models left in reference cycles before the next file runs: the
    collector's own full passes come too rarely for objects that hold gigabytes of tensors."""
    yield
    gc.collect()


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

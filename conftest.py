"""Pytest setup shared by the core's tests (tests/) and the backends' (backends/<name>/tests/): the
command-line options, tests/ on the import path for the shared fixtures and helpers there, and the
pytest-xdist grouping: multi-process tests on one worker, every other file's tests on one worker each."""

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


def group_of(nodeid: str) -> str:
    """The xdist group of a test: the multi-process tests together, every other test with its file's."""
    return "multiprocess" if nodeid.startswith(MULTIPROCESS) else nodeid.split("::")[0]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Under ``--dist loadgroup`` a group runs on one worker: a file's module fixtures (references, lowered
    kernels, built engines) are then made once, not once on each worker its tests were spread over. xdist's own
    loadgroup reads the group from a suffix its workers append to the node ids, which pytest 9.2's structured
    node ids drop (pytest-xdist issue 1386): every test became a group of its own. This scheduler groups by the
    node id itself."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return FileGroupScheduling(config, log)


def pytest_collection_finish(session: pytest.Session) -> None:
    # the imported heap (torch, transformers, every test module: hundreds of thousands of objects) lives as long
    # as the process: freeze it, so that the full collections after each engine test (llm_factory's) and the
    # collector's own walk only what the tests allocate (as ``deepinfer serve`` does after startup)
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True, scope="module")
def collect_cycles_after_each_module() -> Iterator[None]:
    """Free what a test file's engines and models left in reference cycles before the next file runs: the
    collector's own full passes come too rarely for objects that hold gigabytes of tensors. What survives
    (modules imported on first use, session fixtures, caches) is frozen with the rest of the long-lived heap."""
    yield
    gc.collect()
    gc.freeze()


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

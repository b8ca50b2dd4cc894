"""``cpu_threads``: the torch thread count an engine runs its CPU ops with (one for small models unless
asked otherwise: their ops are too small for a thread team, which spins against a busy host)."""

from __future__ import annotations

from types import SimpleNamespace

import engine_fixtures
import pytest
import torch

from deepinfer_core.worker.cpu_threads import SMALL_MODEL_HIDDEN_SIZE, apply_cpu_threads, cpu_thread_count

tiny_path = engine_fixtures.tiny_path
make_llm = engine_fixtures.make_llm

SMALL = SimpleNamespace(hidden_size=SMALL_MODEL_HIDDEN_SIZE)
LARGE = SimpleNamespace(hidden_size=4096)


@pytest.fixture(autouse=True)
def _threads_restored():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_count_asked_for_or_one_for_small_models():
    assert cpu_thread_count(None, SMALL) == 1
    assert cpu_thread_count(None, LARGE) is None  # torch's own count stays
    assert cpu_thread_count(3, SMALL) == 3 and cpu_thread_count(2, LARGE) == 2
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="cpu_threads must be an integer >= 1"):
            cpu_thread_count(bad, SMALL)


def test_set_only_for_a_cpu_device():
    torch.set_num_threads(2)
    apply_cpu_threads(None, SMALL, torch.device("cuda"))
    apply_cpu_threads(None, LARGE, torch.device("cpu"))
    assert torch.get_num_threads() == 2
    apply_cpu_threads(None, SMALL, torch.device("cpu"))
    assert torch.get_num_threads() == 1
    with pytest.raises(ValueError, match="cpu_threads"):  # checked whatever the device
        apply_cpu_threads(0, SMALL, torch.device("cuda"))


def test_the_engine_sets_it(make_llm, tiny_path):
    torch.set_num_threads(2)
    make_llm(tiny_path("tiny"), dtype="float64")
    assert torch.get_num_threads() == 1  # the default for the tiny model
    make_llm(tiny_path("tiny"), dtype="float64", cpu_threads=2)
    assert torch.get_num_threads() == 2
    with pytest.raises(ValueError, match="cpu_threads"):
        make_llm(tiny_path("tiny"), dtype="float64", cpu_threads=0)

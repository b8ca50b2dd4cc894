"""The memory-profiling forwards run for every architecture.

An accelerator sizes its pools after running the step's largest forwards (``profile_activation_bytes``:
a full token budget as a prompt's last chunk, a decode step of every sequence, the verification width when
speculating). The CPU platform measures nothing and skips them, so here a platform that runs them (and
reports no bytes) checks that each model accepts the batches they build: an n-gram (Engram) model's need
each span's history.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.config import SchedulerConfig
from deepinfer_core.default_model import default_model_path, v4_model_path
from deepinfer_core.engine.memory import profile_activation_bytes
from deepinfer_core.models import load_model
from deepinfer_core.platform import Platform


class RunningPlatform(Platform):
    """Runs what it is asked to measure and counts the calls."""

    def __init__(self, device: torch.device):
        super().__init__(device)
        self.ran = 0

    def peak_memory_of(self, fn) -> int:
        fn()
        self.ran += 1
        return 0


@pytest.mark.parametrize("path", [default_model_path, v4_model_path], ids=["v41", "v4"])
@pytest.mark.parametrize("query_len", [1, 4])
# 200: the budget is a long prompt's last chunk; 48: the whole prompt, from position 0, with no history
@pytest.mark.parametrize("max_model_len", [200, 48])
def test_the_profiling_forwards_run(path, query_len, max_model_len):
    model = load_model(path(), "cpu_ref", torch.float32, "cpu")
    platform = RunningPlatform(torch.device("cpu"))
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=48, max_model_len=max_model_len)
    extra = profile_activation_bytes(model, sched, 128, platform, query_len=query_len)
    assert platform.ran == 2
    assert extra >= 8 * sched.max_num_seqs * model.cfg.vocab_size * 4  # the sampler's buffers at least

"""Bounded replay, level 2 (numerics): DeepSeek-V4.1's forward with its late layers cut to a prompt's tail
gives the same teacher-forced logprobs and top-K under ``mask`` and ``compact``, in float64, at every
boundary the tiny model has within a few dozen tokens: prompt lengths around the window (8), the keep
(window + 0, 3 or 8 backtracking), the chunk sizes (5, 7, whole), the ratio-2 groups and the cache
blocks (8), then three decode steps.

The cache is NaN-filled, so a read of a window row the truncation never wrote would poison the logits:
both modes stay finite. The tiny checkpoint is built with its Engram layers at 1 and 3, before its last
KV source (4), as the release has them (1 and 14, before 20); the default tiny model's Engram at layer 5
is refused with the reason.
"""

from __future__ import annotations

from pathlib import Path

import engine_fixtures
import pytest
import torch

from deepinfer_core.model.errors import UnsupportedModelError
from deepinfer_core.models import load_model
from deepinfer_core.models.deepseek_v41.config import DeepseekV41Config
from deepinfer_core.models.deepseek_v41.replay import replay_layers
from deepinfer_core.testing.model_runner import SimpleRunner
from deepinfer_core.testing.tiny_v41 import build_tiny_v41, tiny_v41_config

WINDOW = 8
DECODE = [7, 8, 9]
TOP_K = 5


one_torch_thread = engine_fixtures.one_torch_thread  # one intra-op thread: the tiny model's ops are faster


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_v41(tmp_path_factory.mktemp("v41_replay") / "tiny", seed=1, engram_layer_ids=[1, 3])


@pytest.fixture(scope="module")
def model64(tiny):
    return load_model(tiny, dtype=torch.float64, numerics="unquantised")


def prompt(n: int) -> list[int]:
    return torch.randint(5, 3900, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def teacher_forced(model, mode: str | None, ids: list[int], keep: int, chunk: int) -> torch.Tensor:
    """log_softmax of every position's logits: the prompt in chunks of ``chunk``, then :data:`DECODE` fed one
    at a time; the late layers cut at ``len(ids) - keep`` under ``mode``."""
    model.bounded_replay = mode
    try:
        runner = SimpleRunner(model, 1, 64, block_size=8)  # NaN-filled
        floor = {0: max(0, len(ids) - keep)}
        out, pos = [], 0
        while pos < len(ids):
            n = min(chunk, len(ids) - pos)
            out.append(runner.step({0: ids[pos:pos + n]}, all_logits=True, replay_from=floor)[0])
            pos += n
        for token in DECODE:
            out.append(runner.step({0: [token]}, all_logits=True, replay_from=floor)[0])
    finally:
        model.bounded_replay = None
    return torch.log_softmax(torch.cat(out).double(), dim=-1)


def assert_same(mask: torch.Tensor, compact: torch.Tensor, what: str) -> None:
    assert torch.isfinite(mask).all() and torch.isfinite(compact).all(), f"{what}: a never-written row was read"
    diff = (mask - compact).abs().max().item()
    assert diff <= 1e-12, f"{what}: logprobs differ by {diff:.3g}"
    assert torch.equal(mask.topk(TOP_K).indices, compact.topk(TOP_K).indices), f"{what}: top-{TOP_K} differs"


#: prompt lengths at the boundaries: the window, each keep, the chunks, ratio-2 groups and blocks of 8
LENGTHS = [1, 7, 8, 9, 11, 12, 16, 17, 21, 25, 41]
DEFAULT_LENGTHS = (1, 8, 9, 16, 41)  # the rest (slow) shift these: window, keep == length, floor on/in a block


@pytest.mark.parametrize("length", [n if n in DEFAULT_LENGTHS else pytest.param(n, marks=pytest.mark.slow)
                                    for n in LENGTHS])
def test_mask_equals_compact_teacher_forced_float64(model64, length):
    ids = prompt(length)
    for keep in (WINDOW, WINDOW + 3, 2 * WINDOW):
        for chunk in (5, 7, length):
            what = f"length {length}, keep {keep}, chunk {chunk}"
            assert_same(teacher_forced(model64, "mask", ids, keep, chunk),
                        teacher_forced(model64, "compact", ids, keep, chunk), what)


def test_mask_equals_compact_under_deepseek_numerics(tiny):
    """The quantisation steps (activations E4M3, window KV E4M3, compressed KV and index keys FP4) act row by
    row, so they cut nothing differently in the two modes."""
    model = load_model(tiny, dtype=torch.float64, numerics="deepseek")
    for length, chunk in ((25, 7), (41, 5)):
        ids = prompt(length)
        assert_same(teacher_forced(model, "mask", ids, WINDOW + 3, chunk),
                    teacher_forced(model, "compact", ids, WINDOW + 3, chunk), f"deepseek numerics, length {length}")


def test_the_cut_changes_only_what_it_should(model64):
    """Positions before the floor keep the early layers' streams (their logits are not the full prefill's);
    a keep that covers the whole prompt is the full prefill exactly; a shorter one differs from it (the
    approximation bounded replay makes: not bit-identical, as vLLM and TRT-LLM state)."""
    ids = prompt(35)
    full = teacher_forced(model64, None, ids, 0, 7)
    whole = teacher_forced(model64, "compact", ids, len(ids), 7)
    assert (whole - full).abs().max() <= 1e-12
    cut = teacher_forced(model64, "compact", ids, WINDOW, 7)
    assert (cut[-len(DECODE) - 1:] - full[-len(DECODE) - 1:]).abs().max() > 1e-6


def test_late_engram_or_no_late_layer_is_refused(tmp_path):
    """The default tiny model carries Engram at layer 5, after its last KV source (4): refused, saying why."""
    late_engram = DeepseekV41Config.from_dict(tiny_v41_config())
    with pytest.raises(UnsupportedModelError, match=r"layers \[5\] carry Engram"):
        replay_layers(late_engram)
    ok = DeepseekV41Config.from_dict(tiny_v41_config(engram_layer_ids=[1, 3]))
    assert replay_layers(ok) == range(5, 8)
    last_is_source = DeepseekV41Config.from_dict(tiny_v41_config(engram_layer_ids=[1, 3], kv_source_layer_ids=[1, 7],
                                                                 index_source_layer_ids=[1, 7],
                                                                 candidate_source_layer_id=-1,
                                                                 compress_ratios=[0, 2, 2, 2, 2, 2, 2, 1, 0, 0, 0]))
    with pytest.raises(UnsupportedModelError, match="no layer follows the last KV source"):
        replay_layers(last_is_source)


def test_forward_refuses_a_model_that_cannot_be_cut(tmp_path):
    path = build_tiny_v41(tmp_path / "late_engram", seed=1, with_drafter=False)
    model = load_model(path, dtype=torch.float64, numerics="unquantised")
    with pytest.raises(UnsupportedModelError, match="bounded_replay=False"):
        teacher_forced(model, "compact", prompt(20), WINDOW, 20)

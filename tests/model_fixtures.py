"""Session-scoped tiny DeepSeek-V4 checkpoints and the helpers the model tests share.

A test module binds the fixtures it uses (``tiny_checkpoints = model_fixtures.tiny_checkpoints``)
and imports the helpers: the ``tests`` folder is on ``sys.path`` under pytest's default import mode.
Every checkpoint is built once per session (by transformers' own ``DeepseekV4ForCausalLM``), and so
are the engine and transformers models loaded from it, per dtype.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from deepinfer_core.model.metadata import SeqSpan, build_forward_batch
from deepinfer_core.models import load_model
from deepinfer_core.models.deepseek_v4 import DeepseekV4Model
from deepinfer_core.plugins import ALLOWLIST_ENV
from deepinfer_core.testing.model_runner import SimpleRunner
from deepinfer_core.testing.tiny_model import build_tiny_checkpoint, load_hf_model


def _key(name: str, overrides: dict[str, Any]) -> str:
    return name + "".join(f"-{k}={overrides[k]!r}" for k in sorted(overrides))


@contextmanager
def no_kernel_packs() -> Iterator[None]:
    """Resolve ops from the backend alone: installed kernel packs are not what these tests judge."""
    old = os.environ.get(ALLOWLIST_ENV)
    os.environ[ALLOWLIST_ENV] = ""
    try:
        yield
    finally:
        if old is None:
            del os.environ[ALLOWLIST_ENV]
        else:
            os.environ[ALLOWLIST_ENV] = old


# Config values transformers cannot build a model for (its ACT2FN has no "softmax"): the checkpoint
# is written with transformers' default and the value is then put into config.json.
_CONFIG_ONLY = {"scoring_func": "softmax"}


class TinyCheckpoints:
    """Builds each (tiny config, overrides) checkpoint once and caches the models loaded from it."""

    def __init__(self, factory: pytest.TempPathFactory):
        self.factory = factory
        self._paths: dict[str, Path] = {}
        self._engines: dict[tuple[str, torch.dtype], DeepseekV4Model] = {}
        self._hf: dict[tuple[str, torch.dtype], Any] = {}

    def path(self, name: str = "tiny", **overrides: Any) -> Path:
        """The checkpoint folder; overrides transformers cannot build (softmax) go to config.json only."""
        key = _key(name, overrides)
        if key not in self._paths:
            folder = self.factory.mktemp(f"ckpt_{name}")
            late = {k: v for k, v in overrides.items() if _CONFIG_ONLY.get(k) == v}
            early = {k: v for k, v in overrides.items() if k not in late}
            path = build_tiny_checkpoint(folder, name, **early)
            if late:
                config = json.loads((path / "config.json").read_text())
                config.update(late)
                (path / "config.json").write_text(json.dumps(config, indent=2))
            self._paths[key] = path
        return self._paths[key]

    def engine(
        self, name: str = "tiny", dtype: torch.dtype = torch.float64, **overrides: Any
    ) -> DeepseekV4Model:
        key = (_key(name, overrides), dtype)
        if key not in self._engines:
            path = self.path(name, **overrides)
            with no_kernel_packs():
                self._engines[key] = load_model(path, dtype=dtype)
        return self._engines[key]

    def hf(self, name: str = "tiny", dtype: torch.dtype = torch.float64, **overrides: Any):
        key = (_key(name, overrides), dtype)
        if key not in self._hf:
            self._hf[key] = load_hf_model(self.path(name, **overrides), dtype)
        return self._hf[key]


@pytest.fixture
def torch_single_thread() -> Iterator[None]:
    """One intra-op thread: these tensors are tiny, and on a loaded 2-core host two spinning threads
    make each step up to 20x slower."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoints:
    return TinyCheckpoints(tmp_path_factory)


def prompt(length: int, vocab_size: int, seed: int = 0) -> list[int]:
    """Deterministic token ids (special ids 0/1 excluded so nothing depends on them)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab_size, (length,), generator=gen).tolist()


def engine_logits(model: DeepseekV4Model, ids: list[int], chunk: int | None = None,
                  block_size: int = 16, runner_cls: type[SimpleRunner] = SimpleRunner,
                  fill: float = float("nan")) -> torch.Tensor:
    """Logits [len(ids), vocab] of every position, fed in one step (``chunk=None``) or in chunks."""
    runner = runner_cls(model, 1, max(len(ids), 1), block_size=block_size, fill=fill)
    step = chunk or len(ids)
    parts = [runner.step({0: ids[i : i + step]}, all_logits=True)[0] for i in range(0, len(ids), step)]
    return torch.cat(parts)


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """transformers' full-forward logits [len(ids), vocab] (no cache)."""
    return model(torch.tensor([ids]), use_cache=False).logits[0]


def max_rel_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| divided by max |expected| (the logits' scale)."""
    actual, expected = actual.double(), expected.double()
    return float((actual - expected).abs().max() / expected.abs().max())


def record_calls(model) -> set[str]:
    """Wrap every op of ``model.ops``; the returned set fills with the names called."""
    called: set[str] = set()

    def wrap(name, fn):
        def op(*args, **kwargs):
            called.add(name)
            return fn(*args, **kwargs)

        return op

    for name in model.ops.chosen:
        setattr(model.ops, name, wrap(name, getattr(model.ops, name)))
    return called


def run_forward_and_mtp(model, length: int = 40) -> tuple[set[str], set[str]]:
    """(ops the forward called, ops the drafter called) over ``length`` tokens, every window closing."""
    called = record_calls(model)
    ids = torch.randint(2, model.cfg.vocab_size, (length,), generator=torch.Generator().manual_seed(0)).tolist()
    runner = SimpleRunner(model, 1, length + 1, block_size=16)
    span = [SeqSpan(0, length, runner.table(0), runner.table(0), 0)]
    batch = build_forward_batch(ids, span, model.compressor_specs(), 16, model.cfg.sliding_window,
                                list(range(length)))
    _, streams = model.forward(batch, runner.cache)
    forward = set(called)
    called.clear()
    if model.has_mtp:
        nxt = torch.tensor(ids[1:] + [2])
        model.drafter.forward(batch, runner.cache, streams, nxt)
    return forward, set(called)

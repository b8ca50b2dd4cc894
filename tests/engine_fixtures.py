"""Shared pieces of the engine tests: tiny checkpoints, engines that prove their memory books, HF checks.

Import what a module needs (``from engine_fixtures import ...``): the ``tests`` folder is on
``sys.path`` under pytest's default import mode. Checkpoints are built once per session (the cache
below outlives each module's copy of the session fixture) and so are transformers reference models.

Every engine a test builds goes through ``make_llm``: each of its steps is followed by
``BlockManager.check_invariants()``, and when the test ends the fixture checks that no request is
left and every pool is entirely free again (``assert_drained``).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from deepinfer_core.default_model import v4_model_path
from deepinfer_core.engine.llm_engine import LLMEngine
from deepinfer_core.entrypoints.llm import LLM
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.testing.tiny_model import build_tiny_checkpoint, load_hf_model
from deepinfer_core.testing.tiny_v41 import build_tiny_v41

BLOCK_SIZE = 16
_PATHS: dict[tuple[str, str], Path] = {}
_HF: dict[tuple[str, torch.dtype], Any] = {}


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The tiny model's ops are far too small for intra-op threads: one thread is faster, and does not
    collapse when other processes share the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``tiny_path(name)``: the folder of the tiny checkpoint ``name`` (seed 0), built once per session."""
    base = str(tmp_path_factory.getbasetemp())

    def get(name: str = "tiny") -> Path:
        key = (base, name)
        if key not in _PATHS:
            folder = tmp_path_factory.mktemp(f"engine_{name}")
            # "v41": the tiny DeepSeek-V4.1 (testing.tiny_v41); the rest: tiny DeepSeek-V4 configs
            _PATHS[key] = build_tiny_v41(folder / "v41") if name == "v41" else build_tiny_checkpoint(folder, name)
        return _PATHS[key]

    return get


def hf_model(path: Path, dtype: torch.dtype = torch.float64):
    key = (str(path), dtype)
    if key not in _HF:
        _HF[key] = load_hf_model(path, dtype)
    return _HF[key]


def make_prompt(length: int, seed: int, vocab_size: int = 384) -> list[int]:
    """Deterministic token ids; 0 and 1 (BOS/EOS) left out so nothing hinges on them."""
    gen = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(2, vocab_size, (length,), generator=gen).tolist()


def greedy(max_tokens: int = 10, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def assert_drained(engine: LLMEngine) -> None:
    """Books consistent, nothing queued, and every block and state slot back in its pool."""
    bm = engine.block_manager
    bm.check_invariants()
    assert not engine.has_unfinished_requests(), "requests left in the scheduler"
    assert not engine.requests, f"requests left in the engine: {sorted(engine.requests)}"
    assert not bm.owners, "sequences still own memory"
    for pool in (bm.blocks, bm.window_blocks, bm.slots):
        assert pool.num_free == pool.size, f"{pool.name} pool leaked {pool.size - pool.num_free} blocks"
        assert not any(pool.ref), f"{pool.name} pool still has referenced blocks"


def check_every_step(engine: LLMEngine) -> LLMEngine:
    """Make ``engine.step`` prove the block books after every step (and count the steps)."""
    if getattr(engine, "_checked", False):
        return engine
    step = engine.step
    engine.num_steps = 0

    def checked_step():
        outputs = step()
        bm = engine.block_manager
        bm.check_invariants()
        for seq in engine.scheduler.running:
            # between steps a sequence holds the window blocks its next query sees, and the compressed
            # blocks of everything computed (a reused cached prefix may hold a few more, never past the
            # sequence): window memory stays bounded, compressed memory grows with the length
            c, bs = seq.num_computed_tokens, bm.block_size
            held = {i for i, b in enumerate(seq.window_block_table) if b >= 0}
            assert held == set(range(max(0, c - bm.window + 1) // bs, -(-c // bs))), "window blocks"
            assert -(-c // bs) <= len(seq.block_table) <= -(-len(seq) // bs), "compressed blocks"
        engine.num_steps += 1
        return outputs

    engine.step = checked_step
    engine._checked = True
    return engine


def llm_factory(check: Callable = check_every_step, **defaults: Any) -> Iterator[Callable[..., LLM]]:
    """Yields ``make(model, **engine_args)`` -> LLM on cpu_ref (block_size 16 and ``defaults`` unless
    given), its engine wrapped by ``check`` to be checked every step; then every engine made must be
    drained with all pools free."""
    made: list[LLM] = []

    def make(model: Path | str | None, **kw: Any) -> LLM:
        """``model`` None: the trained tiny V4 (what these tests were written for; the default is a V4.1)."""
        kw.setdefault("block_size", BLOCK_SIZE)
        llm = LLM(str(v4_model_path() if model is None else model), **{**defaults, **kw})
        check(llm.llm_engine)
        made.append(llm)
        return llm

    yield make
    try:
        for llm in made:
            assert_drained(llm.llm_engine)
    finally:
        # an engine is a web of reference cycles (the checks above close over it; so do the runner's pending
        # steps): left to the collector's rare full passes, a test file's engines pile up gigabytes of
        # weights and pools in one process
        made.clear()
        gc.collect()


@pytest.fixture
def make_llm() -> Iterator[Callable[..., LLM]]:
    """``make_llm(model, **engine_args)`` -> LLM on cpu_ref (block_size 16 unless given), checked every
    step; at teardown every engine made must be drained with all pools free."""
    yield from llm_factory()


def token_prompts(prompts: list[list[int]]) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": p} for p in prompts]


def run_tokens(llm: LLM, prompts: list[list[int]],
               params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    """Generate and return each request's token ids; checks the engine drained afterwards."""
    outs = llm.generate(token_prompts(prompts), params, use_tqdm=False)
    assert_drained(llm.llm_engine)
    for out in outs:
        assert out.finished and out.error is None, out.error
    return [o.outputs[0].token_ids for o in outs]


@torch.no_grad()
def hf_argmax(path: Path, prompt: list[int], generated: list[int]) -> list[int]:
    """transformers' full-forward argmax at positions len(prompt)-1 .. end-1 of prompt + generated."""
    ids = prompt + generated
    logits = hf_model(path)(torch.tensor([ids]), use_cache=False).logits[0]
    return logits[len(prompt) - 1 : len(ids) - 1].argmax(dim=-1).tolist()


@torch.no_grad()
def hf_log_softmax(path: Path, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits predicting each generated token: [len(generated), vocab]."""
    ids = prompt + generated
    logits = hf_model(path)(torch.tensor([ids]), use_cache=False).logits[0]
    return torch.log_softmax(logits[len(prompt) - 1 : len(ids) - 1].double(), dim=-1)

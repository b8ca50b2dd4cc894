"""Helpers of the GPU suite (plain functions; the fixtures live in ``conftest.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

BACKEND = "nvidia_sm100"
TINY_MODELS = ("tiny", "tiny_hc4", "tiny_hc1")
#: the V4-Flash widths the library adapters' predicates read
V4_FLASH_WIDTHS = SimpleNamespace(num_attention_heads=64, head_dim=512, hidden_size=4096, moe_intermediate_size=2048,
                                  q_lora_rank=1024, o_groups=8, o_lora_rank=1024, hc_mult=4)


def nvidia_unavailable_reason() -> str | None:
    """Why the GPU suite cannot run here, or ``None`` when it can."""
    if not torch.cuda.is_available():
        return "needs a CUDA device (torch.cuda.is_available() is False)"
    from deepinfer_core.plugins import PluginError, load_backend

    try:
        load_backend(BACKEND)
    except PluginError as exc:
        return f"backend {BACKEND} is not usable here: {exc}"
    return None


def gpu_marks() -> list:
    """``pytestmark`` of every GPU test module: marked ``gpu`` and skipped where it cannot run."""
    reason = nvidia_unavailable_reason()
    return [pytest.mark.gpu, pytest.mark.skipif(reason is not None, reason=reason or "")]


def make_prompt(length: int, seed: int, vocab_size: int = 384) -> list[int]:
    """Deterministic token ids, BOS/EOS (0, 1) left out."""
    gen = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(2, vocab_size, (length,), generator=gen).tolist()


def drive(model, prompts: list[list[int]], feed: list[list[int]] | None, steps: int, chunk: int, block_size: int):
    """Prefill ``prompts`` in chunks of ``chunk`` tokens, then ``steps`` decode steps, through a
    ``SimpleRunner`` of ``block_size`` blocks.

    ``feed[s][i]`` is the token sequence ``s`` receives at decode step ``i`` (``None``: greedy on this
    model's own logits). Returns (per sequence: [steps + 1] float64 logits on the CPU, fed tokens)."""
    from deepinfer_core.testing.model_runner import SimpleRunner

    n = len(prompts)
    runner = SimpleRunner(model, num_seqs=n, max_len=max(map(len, prompts)) + steps + 1, block_size=block_size)
    logits: list[list[torch.Tensor]] = [[] for _ in range(n)]
    for start in range(0, max(map(len, prompts)), chunk):
        chunks = {s: p[start : start + chunk] for s, p in enumerate(prompts) if start < len(p)}
        out = runner.step(chunks)
        for s in chunks:
            if start + chunk >= len(prompts[s]):
                logits[s].append(out[s][-1].double().cpu())
    tokens: list[list[int]] = [[] for _ in range(n)]
    for i in range(steps):
        step = {}
        for s in range(n):
            tok = feed[s][i] if feed is not None else int(logits[s][-1].argmax())
            tokens[s].append(tok)
            step[s] = [tok]
        out = runner.step(step)
        for s in range(n):
            logits[s].append(out[s][-1].double().cpu())
    return logits, tokens


def near_tie(logits: torch.Tensor, tol: float) -> bool:
    """Whether the two best of ``logits`` are within ``tol``."""
    top = logits.topk(2).values
    return bool(top[0] - top[1] <= tol)


def run_without_host_sync(fn):
    """``fn()`` after the device is idle, with CUDA's sync debug mode at "error": any wait for the device
    inside it raises. Returns what ``fn`` returns."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")

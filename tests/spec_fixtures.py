"""Shared pieces of the speculative decoding tests: reference runs and an oracle drafter.

The tiny checkpoints' MTP weights are random, so their drafts are nearly always rejected. To drive
acceptance, ``oracle_drafts`` replaces each proposal by the reference (non-speculative) continuation,
with the drafts that ``wrong(seq, num_outputs, j)`` picks changed to another token: every accepted
length and rejection point can then be placed where a test wants it.
"""

from __future__ import annotations

from collections.abc import Callable

from deepinfer_core.entrypoints.llm import LLM
from deepinfer_core.spec_decode.confidence import AcceptanceCalibrator, StepProfile

SPEC = "speculative_config"


def spec(k: int, schedule: str = "fixed") -> dict:
    return {SPEC: {"method": "mtp", "num_speculative_tokens": k, "schedule": schedule}}


def other_token(token: int, vocab_size: int) -> int:
    return token + 1 if token + 1 < vocab_size else 2


def oracle_drafts(llm: LLM, reference: dict[tuple[int, ...], list[int]],
                  wrong: Callable[[object, int, int], bool] = lambda seq, m, j: False) -> None:
    """Make ``llm``'s proposals the reference continuation of each prompt (``reference``: prompt ->
    output tokens, long enough), draft ``j`` (0-based) wrong where ``wrong(seq, m, j)``, ``m`` being the
    number of outputs so far."""
    engine = llm.llm_engine
    planner, vocab = engine.drafts, engine.model_config.vocab_size
    offer = planner.offer
    k = planner.config.num_speculative_tokens

    def patched(seq, drafts, confidences):
        ref, m = reference[tuple(seq.prompt_token_ids)], len(seq.output_token_ids)
        new = []
        for j in range(k):
            token = ref[m + j] if m + j < len(ref) else 2
            new.append(other_token(token, vocab) if wrong(seq, m, j) else token)
        offer(seq, new, [0.9] * k)

    planner.offer = patched


def price_by_graphs(llm: LLM, step_ms: tuple[float, ...], sizes=(1, 2, 4, 8)) -> list[list[int]]:
    """Make ``llm``'s confidence scheduler speculate every step, trust the drafter's confidences and price
    all-decode steps by graphs of every size in ``sizes`` whose 1 + j token spans cost ``step_ms[j]``.
    Returns the list to which each all-decode step's drafts per sequence are appended."""
    engine, spans = llm.llm_engine, []
    engine.drafts.gate.decide = lambda num_decoding, decode_only=True: True
    confidence = engine.drafts.confidence
    confidence.calibrator = AcceptanceCalibrator(min_tests=0)
    confidence.calibrator.observe = lambda confidences, num_accepted: None
    confidence.profile = StepProfile({(n, 1 + j): 1e-3 * t for n in sizes for j, t in enumerate(step_ms)})
    execute = engine.runner.execute_model

    def record(so):
        if all(s.sample and len(s.token_ids) == 1 + s.num_drafts for s in so.scheduled):
            spans.append([s.num_drafts for s in so.scheduled])
        return execute(so)

    engine.runner.execute_model = record
    return spans

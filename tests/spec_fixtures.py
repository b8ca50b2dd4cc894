"""Shared pieces of the speculative decoding tests: reference runs and an oracle drafter.

The tiny checkpoints' MTP weights are random, so their drafts are nearly always rejected. To drive
acceptance, ``oracle_drafts`` replaces each proposal by the reference (non-speculative) continuation,
with the drafts that ``wrong(seq, num_outputs, j)`` picks changed to another token: every accepted
length and rejection point can then be placed where a test wants it.
"""

from __future__ import annotations

from collections.abc import Callable

from deepinfer_core.entrypoints.llm import LLM

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

"""When a sequence stops: one pure check over its tokens (vLLM's ``sched/utils.check_stop`` shape)."""

from __future__ import annotations

import enum
from typing import Any


class FinishStatus(enum.StrEnum):
    """Why a sequence finished; the values are the OpenAI ``finish_reason`` strings."""

    STOPPED = "stop"  # a stop token, an end-of-sequence token, a stop string or a completed grammar
    LENGTH_CAPPED = "length"  # max_tokens or max_model_len
    ABORTED = "abort"
    ERROR = "error"  # the request failed alone (grammar dead end, unfittable, a failed step)


def check_stop(seq: Any, max_model_len: int) -> tuple[FinishStatus, int | None] | None:
    """``(status, stop_reason)`` when ``seq``'s last completed output token ends it, else ``None``.

    ``seq`` has ``prompt_token_ids``, ``completed_output_ids``, ``params`` and ``eos_token_ids`` (and
    optionally a ``grammar``). Token stops (``stop_token_ids``, end of sequence) count once ``min_tokens``
    outputs exist; the length limit counts always. Stop strings are the detokenizer's (they need text).
    """
    outputs = seq.completed_output_ids
    if not outputs:
        return None
    params, token, n_out = seq.params, outputs[-1], len(outputs)
    if n_out >= params.min_tokens:
        if token in params.stop_token_ids:
            return FinishStatus.STOPPED, token
        if not params.ignore_eos and token in seq.eos_token_ids:
            return FinishStatus.STOPPED, None
    grammar = getattr(seq, "grammar", None)
    if grammar is not None and grammar.is_terminated:
        return FinishStatus.STOPPED, None
    if (params.max_tokens is not None and n_out >= params.max_tokens) or (
            len(seq.prompt_token_ids) + n_out >= max_model_len):
        return FinishStatus.LENGTH_CAPPED, None
    return None

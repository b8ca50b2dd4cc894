"""SamplingParams and StructuredOutputsParams: vLLM's names and meanings, validated on construction."""

from __future__ import annotations

import enum
import json as _json
import math
from dataclasses import dataclass, field
from typing import Any

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """One constraint on the generated text (vLLM's ``StructuredOutputsParams``), enforced by xgrammar.

    Exactly one of ``json`` (a JSON schema, as a dict or a JSON string), ``regex``, ``choice`` (the
    output is one of these strings), ``grammar`` (EBNF, xgrammar's GBNF dialect) or
    ``json_object=True`` (any JSON object) must be given. ``disable_any_whitespace`` makes JSON output
    compact (no free whitespace between tokens).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "invalid StructuredOutputsParams: give exactly one of json, regex, choice, grammar, "
                f"json_object; got {given or 'none'}"
            )
        kind = given[0]
        ok = {
            "json": isinstance(self.json, (str, dict)),
            "regex": isinstance(self.regex, str),
            "choice": isinstance(self.choice, (list, tuple)) and len(self.choice) > 0
            and all(isinstance(c, str) for c in self.choice),
            "grammar": isinstance(self.grammar, str) and bool(self.grammar.strip()),
            "json_object": self.json_object is True,
        }[kind]
        if not ok:
            raise ValueError(f"invalid StructuredOutputsParams: {kind} has the wrong type or is empty, "
                             f"got {getattr(self, kind)!r}")
        if self.choice is not None:
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str, bool]:
        """What the compiled grammar depends on (the compile cache's key)."""
        kind = self.kind
        spec: Any = getattr(self, kind)
        if kind == "json" and isinstance(spec, dict):
            spec = _json.dumps(spec, sort_keys=True)
        elif kind == "choice":
            spec = _json.dumps(spec)
        elif kind == "json_object":
            spec = ""
        return kind, spec, self.disable_any_whitespace


class RequestOutputKind(enum.Enum):
    """When the engine reports a request (vLLM's names): after every step it took part in, each output
    holding everything so far, or only once, when it ends."""

    CUMULATIVE = 0
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    _errors: list[str] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        checks = [
            (isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}"),
            (math.isfinite(self.temperature) and self.temperature >= 0,
             f"temperature must be a finite number >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (isinstance(self.top_k, int) and self.top_k >= 0, f"top_k must be -1, 0 (off) or >= 1, got {self.top_k!r}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
             f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
             f"max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}"),
            (isinstance(self.min_tokens, int) and self.min_tokens >= 0,
             f"min_tokens must be >= 0, got {self.min_tokens!r}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"),
            (all(isinstance(s, str) and s for s in self.stop), f"stop must be non-empty strings, got {self.stop!r}"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}"),
            (self.seed is None or isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}"),
            (self.logprobs is None or (isinstance(self.logprobs, int) and self.logprobs >= 0),
             f"logprobs must be an integer >= 0, got {self.logprobs!r}"),
            (self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
             f"structured_outputs must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}"),
            (isinstance(self.output_kind, RequestOutputKind),
             f"output_kind must be a RequestOutputKind, got {self.output_kind!r}"),
        ]
        errors = [msg for ok, msg in checks if not ok]
        if errors:
            raise ValueError("invalid SamplingParams: " + "; ".join(errors))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

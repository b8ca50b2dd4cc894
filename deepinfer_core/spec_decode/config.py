"""SpeculativeConfig: what ``speculative_config={"method": "mtp", "num_speculative_tokens": k}`` asks for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

METHODS = ("mtp",)
SCHEDULES = ("fixed", "confidence")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's shape. ``schedule``: "fixed" verifies every draft; "confidence" admits (sequence, position)
    pairs by estimated survival while the estimated accepted tokens per second still grow (DSpark)."""

    method: str = "mtp"
    num_speculative_tokens: int = 1
    schedule: str = "fixed"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method {self.method!r} is not supported; choose one of {METHODS}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {k!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"speculative_config schedule {self.schedule!r} is unknown; choose one of {SCHEDULES}")

    @classmethod
    def from_arg(cls, value: SpeculativeConfig | dict[str, Any] | None) -> SpeculativeConfig | None:
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict like {{'method': 'mtp', "
                             f"'num_speculative_tokens': 2}}, got {value!r}")
        known = {"method", "num_speculative_tokens", "schedule"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config keys {unknown}; known: {sorted(known)}")
        return cls(**value)


def max_speculative_tokens(ring_rows: list[int]) -> int | None:
    """The most drafts one verification may hold: its tokens must land on distinct rows of every
    compressor ring, so that rejected rows can be put back without touching accepted ones."""
    return min(ring_rows) - 1 if ring_rows else None


def can_speculate(params: Any) -> bool:
    """Whether a request's tokens may come from verified drafts: what the rejection sampler applies is
    temperature, top-k, top-p and min-p; penalties, grammars and logprobs take the plain path."""
    return not (params.has_penalties or params.structured_outputs is not None or params.logprobs is not None)

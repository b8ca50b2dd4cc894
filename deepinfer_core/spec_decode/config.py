"""SpeculativeConfig: what ``speculative_config={"method": "mtp" | "dspark", "num_speculative_tokens": k}`` asks
for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

METHODS = ("mtp", "dspark")  # V4: one MTP layer run k times; V4.1: the DSpark block drafter
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


def spec_query_lens(config: SpeculativeConfig | None) -> tuple[int, ...]:
    """New tokens per sequence to capture decode graphs for: 1 without speculation; 1 and 1 + k with
    fixed k (a step with fewer drafts is filled up); every 1 + j with confidence scheduling, so that a
    step verifying j drafts a sequence at most replays a graph of that length and the scheduler prices it
    so (a large batch verifying fewer drafts pays for fewer tokens)."""
    if config is None:
        return (1,)
    k = config.num_speculative_tokens
    return tuple(range(1, k + 2)) if config.schedule == "confidence" else (1, 1 + k)

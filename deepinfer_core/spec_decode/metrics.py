"""Counters of speculative decoding, per sequence and engine-wide (vLLM's ``SpecDecodingStats`` names)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # verification steps (a sequence verifying >= 1 draft)
    num_draft_tokens: int = 0  # drafts verified
    num_accepted_tokens: int = 0  # drafts accepted
    num_proposed_tokens: int = 0  # drafts the drafter made (verified or not)
    accepted_per_position: list[int] = field(default_factory=list)  # drafts accepted at position 1, 2, ...
    verified_per_position: list[int] = field(default_factory=list)

    def observe(self, num_verified: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_verified
        self.num_accepted_tokens += num_accepted
        grow = num_verified - len(self.verified_per_position)
        if grow > 0:
            self.verified_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for j in range(num_verified):
            self.verified_per_position[j] += 1
            self.accepted_per_position[j] += j < num_accepted

    def add(self, other: SpecDecodeStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_proposed_tokens += other.num_proposed_tokens
        for mine, theirs in ((self.verified_per_position, other.verified_per_position),
                             (self.accepted_per_position, other.accepted_per_position)):
            mine += [0] * (len(theirs) - len(mine))
            for j, n in enumerate(theirs):
                mine[j] += n

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification step: 1 (the target's own) + accepted drafts per step."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens, "num_proposed_tokens": self.num_proposed_tokens,
            "mean_acceptance_length": self.mean_acceptance_length, "acceptance_rate": self.acceptance_rate,
            "accepted_per_position": list(self.accepted_per_position),
            "verified_per_position": list(self.verified_per_position),
        }

"""What a worker returns for one step: plain, picklable host data."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class ModelRunnerOutput:
    seq_ids: list[int] = field(default_factory=list)  # the sampled sequences, in step order
    sampled_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float] | None] = field(default_factory=list)  # for rows that asked
    dead_ends: list[bool] | None = None  # grammar rows: no token satisfied every mask
    # speculative decoding, per sampled sequence: every new token (accepted drafts, then the target's own),
    # and the drafts proposed for its next step with the drafter's confidence in each
    new_token_ids: list[list[int]] | None = None
    new_logprobs: list[list[dict[int, float]] | None] | None = None  # of each new token, for rows that asked
    draft_token_ids: list[list[int]] | None = None
    draft_confidences: list[list[float]] | None = None


EMPTY_OUTPUT = ModelRunnerOutput()


class AsyncModelRunnerOutput(Protocol):
    """A launched step; ``get_output`` waits for its samples to reach the host."""

    def get_output(self) -> ModelRunnerOutput: ...


class ReadyOutput:
    def __init__(self, output: ModelRunnerOutput):
        self.output = output

    def get_output(self) -> ModelRunnerOutput:
        return self.output

"""What the scheduler hands the workers for one step: plain, picklable data (no device tensors).
The engine also reads from it the sequences the step covers; those stay in the engine's process."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from deepinfer_core.sampling.params import SamplingParams

if TYPE_CHECKING:
    from deepinfer_core.engine.sequence import Sequence


@dataclass
class NewRequestData:
    """A sequence the workers have not seen: what its sampling state starts from."""

    seq_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # base seed of the sequence's sampling noise
    mm_items: list = field(default_factory=list)  # the prompt's images (engine/multimodal.py)


@dataclass
class ScheduledSeq:
    """One sequence's share of the step: tokens ``start .. start + len(token_ids)`` and where they go."""

    seq_id: int
    start: int
    token_ids: list[int]  # PLACEHOLDER where the previous step's sample, still on the device, goes
    block_table: list[int]
    window_block_table: list[int]
    state_slot: int
    write_from: int
    restore_boundary: int | None  # block whose boundary record seeds the compressor state first
    sample: bool  # the step reaches the end of the sequence: sample its next token
    num_drafts: int = 0  # speculative decoding: the last ``num_drafts`` token ids are drafts to verify
    next_token_id: int | None = None  # the token after the span when it is known (a prefill chunk's next one)
    replay_from: int = 0  # bounded replay: the sequence's floor (SeqSpan.replay_from)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    new_requests: list[NewRequestData] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)  # workers drop their state
    # host int32, per sampled sequence 1 + its num_drafts rows (row j: after its drafts before j); all ones: none
    grammar_bitmask: torch.Tensor | None = None
    speculate: bool = True  # speculative decoding: False runs the step as plain decode (no drafting)
    # the engine's side, never sent to a worker (dropped when pickled): each entry of ``scheduled`` as
    # (sequence, tokens it computes, drafts included), the sequences that sample, and those that can never
    # fit the pools (already finished, ``stop_reason`` says why)
    scheduled_seqs: list[tuple[Sequence, int]] = field(default_factory=list, repr=False, compare=False)
    sampled_seqs: list[Sequence] = field(default_factory=list, repr=False, compare=False)
    unfittable: list[Sequence] = field(default_factory=list, repr=False, compare=False)

    @property
    def num_sampled(self) -> int:
        return sum(s.sample for s in self.scheduled)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "scheduled_seqs": [], "sampled_seqs": [], "unfittable": []}

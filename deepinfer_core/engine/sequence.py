"""One generation stream: its tokens, its memory and where it stands."""

from __future__ import annotations

import enum
import itertools

import torch

from deepinfer_core.engine.detokenizer import IncrementalDetokenizer
from deepinfer_core.engine.stop import FinishStatus
from deepinfer_core.sampling.params import SamplingParams

PLACEHOLDER = -1  # an output token still on the device (async scheduling)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    _ids = itertools.count()

    def __init__(self, request_id: str, index: int, prompt_token_ids: list[int], params: SamplingParams,
                 generator: torch.Generator, eos_token_ids: list[int] = ()):
        self.seq_id = next(Sequence._ids)
        self.request_id, self.index = request_id, index
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []  # may end in ``num_inflight`` placeholders
        self.num_inflight = 0
        self.output_logprobs: list[dict[int, float]] = []
        self.params = params
        self.generator = generator
        self.status = SequenceStatus.WAITING
        self.eos_token_ids = list(eos_token_ids)
        self.finish_reason: FinishStatus | None = None
        self.stop_reason: int | str | None = None
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.window_block_table: list[int] = []
        self.state_slot: int | None = None
        self.block_hashes: list[bytes] = []  # chained hashes of the full blocks seen so far
        self.write_from = 0  # compressed blocks before this position are shared and never written
        self.num_cached_tokens = 0
        self.pending_restore: int | None = None  # block whose boundary record seeds the compressor state
        # bounded replay: the late layers' floor, fixed when the first prefill starts (None: not yet). A
        # preempted sequence keeps it: its recompute runs the late layers over the same positions as before
        self.replay_from: int | None = None
        self.detokenizer = IncrementalDetokenizer()  # the decoded output, grown a few tokens at a time
        self.text_pending = False  # output tokens not decoded yet (a final-only request decodes once, at its end)
        self.num_preemptions = 0
        self.grammar = None  # structured output: this sequence's GrammarState (sampling/structured.py)
        self.mm_items: list = []  # the prompt's images (engine/multimodal.py), in prompt order
        # speculative decoding: drafts for the tokens after the last one, the drafter's confidence in
        # each, how many the next step may verify (set before scheduling) and how many it does
        self.draft_token_ids: list[int] = []
        self.draft_confidences: list[float] = []
        self.draft_budget = 0
        self.num_scheduled_drafts = 0
        self.inflight_drafts = 0  # drafts of the newest launched step, unknown whether accepted until it ends
        self.spec_stats = None  # SpecDecodeStats of this sequence, when the engine speculates
        self.mtp_stale_until = 0  # drafts read MTP rows a plain step left unwritten below this length

    @property
    def text(self) -> str:
        return self.detokenizer.output_text

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def completed_output_ids(self) -> list[int]:
        """The output tokens known on the host (without the in-flight placeholders)."""
        return self.output_token_ids[: len(self.output_token_ids) - self.num_inflight]

    def token_slice(self, start: int, end: int) -> list[int]:
        """``token_ids[start:end]`` without building the whole list."""
        cut = len(self.prompt_token_ids)
        if start >= cut:
            return self.output_token_ids[start - cut : end - cut]
        return self.prompt_token_ids[start:end] + self.output_token_ids[: max(0, end - cut)]

    def __len__(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_unresolved_drafts(self) -> int:
        """Drafts of a step still in flight: positions after them are unknown by up to this many."""
        return self.inflight_drafts if self.num_inflight else 0

    def clear_drafts(self) -> None:
        self.draft_token_ids, self.draft_confidences = [], []
        self.draft_budget = self.num_scheduled_drafts = 0

    @property
    def num_uncomputed(self) -> int:
        return len(self) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

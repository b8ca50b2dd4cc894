"""Continuous batching under a token budget: decodes and prefill chunks mixed, preemption by recompute."""

from __future__ import annotations

from collections import deque

from deepinfer_core.config import SchedulerConfig
from deepinfer_core.engine.block_manager import BlockManager
from deepinfer_core.engine.scheduler_output import NewRequestData, ScheduledSeq, SchedulerOutput
from deepinfer_core.engine.sequence import Sequence, SequenceStatus
from deepinfer_core.sampling.random import base_seed


class Scheduler:
    """``drafting``: speculative decoding, whose drafter reads the token after a prefill chunk."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, drafting: bool = False):
        self.config = config
        self.block_manager = block_manager
        self.drafting = drafting
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0
        self._known: set[int] = set()  # sequences the workers hold state for
        self._retired: list[int] = []  # finished sequences the workers have not been told about

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _chunked(self, seq: Sequence) -> bool:
        """Whether ``seq`` may be computed in pieces: always with chunked prefill; without it only a
        preempted sequence whose prompt plus output outgrew the token budget (prompts longer than the
        budget are refused when added), which could never be scheduled in one step again."""
        return self.config.enable_chunked_prefill or len(seq) > self.config.max_num_batched_tokens

    def _chunk(self, seq: Sequence, budget: int) -> int:
        if self._chunked(seq):
            return min(seq.num_uncomputed, budget)
        return seq.num_uncomputed if seq.num_uncomputed <= budget else 0

    def _fit(self, seq: Sequence, num_new: int) -> int:
        """How many of ``num_new`` tokens the free memory can take now: all or nothing for an unchunked
        sequence; else the largest chunk that fits (the window pool may hold a short chunk only)."""
        bm = self.block_manager
        if bm.can_allocate(seq, num_new):
            return num_new
        if not self._chunked(seq):
            return 0
        lo, hi = 0, num_new - 1  # needs grow with the chunk: the largest fitting one by bisection
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if bm.can_allocate(seq, mid):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _unfittable(self, seq: Sequence, out: list[Sequence]) -> None:
        """Finish ``seq`` now (its memory must be free before anything else is judged to not fit)."""
        seq.stop_reason = "the KV cache pools cannot hold this sequence; raise the memory budget"
        self.finish(seq)
        self.retire(seq)
        out.append(seq)

    def schedule(self, speculate: bool = True) -> SchedulerOutput:
        """The next step: (sequence, tokens to compute) pairs in ``scheduled_seqs`` and what the workers
        need of them; ``unfittable``: sequences that can never fit the pools. ``speculate``: whether the
        step drafts (speculative decoding).

        An unfittable sequence is already finished, its memory released; its ``stop_reason`` says why
        and the caller reports it.
        """
        bm, budget = self.block_manager, self.config.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        unfittable: list[Sequence] = []
        preempted = False
        for seq in list(self.running):
            if seq not in self.running:
                continue  # preempted below by an earlier sequence
            num_new = self._chunk(seq, budget)
            if num_new == 0:
                continue
            num_new += self._drafts(seq, num_new, budget)
            # a step in flight may still accept its drafts: memory for the positions they might take too
            extra = seq.num_unresolved_drafts
            while (fit := self._fit(seq, num_new + extra) - extra) <= 0:
                victim = self.running[-1]
                if victim is seq and len(self.running) == 1 and not scheduled:
                    self._unfittable(seq, unfittable)
                    break
                self.preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                bm.allocate(seq, fit + extra)
                scheduled.append((seq, fit))
                budget -= fit
        # Memory just taken from a preempted sequence goes to the running ones, not to newcomers (nor
        # straight back to the victim, which would be recomputed only to be preempted again).
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            # bounded replay: the late layers run on the prompt's last ``replay_keep`` tokens and everything
            # after; a prefix hit stops at that floor, so the tail is recomputed
            keep = self.config.replay_keep
            if seq.replay_from is None:
                seq.replay_from = max(0, len(seq) - keep) if keep else 0
            hit = bm.admit(seq, limit=seq.replay_from if keep else None)
            if hit is not None:
                seq.pending_restore = hit.restore_block
                seq.num_cached_tokens = max(seq.num_cached_tokens, hit.cached_tokens)
            num_new = self._chunk(seq, budget)
            if num_new == 0:
                break
            fit = self._fit(seq, num_new)
            if fit == 0:
                if hit is not None:  # a waiting sequence holds no memory: give the reused blocks back
                    self._release_waiting(seq)
                if not self.running and not scheduled:  # all memory is free and still not enough
                    self._unfittable(seq, unfittable)
                    continue
                break
            self.waiting.popleft()
            bm.allocate(seq, fit)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append((seq, fit))
            budget -= fit
        return self._output(scheduled, unfittable, speculate)

    def _output(self, scheduled: list[tuple[Sequence, int]], unfittable: list[Sequence],
                speculate: bool) -> SchedulerOutput:
        items, new, to_sample = [], [], []
        for seq, num_new in scheduled:
            start = seq.num_computed_tokens
            if seq.seq_id not in self._known:
                self._known.add(seq.seq_id)
                new.append(NewRequestData(seq.seq_id, seq.prompt_token_ids, seq.params, base_seed(seq),
                                          seq.mm_items))
            num_drafts = seq.num_scheduled_drafts
            end = start + num_new - num_drafts
            sample = end == len(seq)
            token_ids = seq.token_slice(start, end) + seq.draft_token_ids[:num_drafts]
            next_token = None
            if self.drafting and not sample:  # the drafter reads the token after the chunk
                next_token = seq.token_slice(end, end + 1)[0]
            items.append(ScheduledSeq(seq.seq_id, start, token_ids, seq.block_table, seq.window_block_table,
                                      seq.state_slot, seq.write_from, seq.pending_restore, sample, num_drafts,
                                      next_token, seq.replay_from or 0))
            seq.pending_restore = None
            if sample:
                to_sample.append(seq)
        finished: list[int] = []
        if items:  # otherwise the workers hear of them with the next step that runs
            finished, self._retired = self._retired, []
        return SchedulerOutput(items, new, finished, speculate=speculate, scheduled_seqs=scheduled,
                               sampled_seqs=to_sample, unfittable=unfittable)

    def retire(self, seq: Sequence) -> None:
        """``seq`` is finished: the next step tells the workers to drop its state (if they hold any)."""
        if seq.seq_id in self._known:
            self._known.discard(seq.seq_id)
            self._retired.append(seq.seq_id)

    def _drafts(self, seq: Sequence, num_new: int, budget: int) -> int:
        """Drafts verified with a decoding sequence's token: up to its ``draft_budget``, within the token
        budget and only when all of them fit the free memory (never preempting for a draft)."""
        seq.num_scheduled_drafts = 0
        if num_new != 1 or seq.num_uncomputed != 1 or not seq.draft_budget:
            return 0
        n = min(seq.draft_budget, len(seq.draft_token_ids), budget - 1)
        while n > 0 and not self.block_manager.can_allocate(seq, 1 + n + seq.num_unresolved_drafts):
            n -= 1
        seq.num_scheduled_drafts = n
        return n

    def running_fits(self, leaving: set[int], strict: bool) -> bool:
        """Whether the next ``schedule()`` gives every running sequence (but those in ``leaving``, seq ids
        about to finish) its chunk without preempting anything; a decoding sequence with every draft its
        ``draft_budget`` allows, and the memory of the drafts a step in flight may still accept.

        ``strict`` also asks that nothing waits, every chunk is whole and only never-cached free blocks are
        taken: then a running sequence that finishes before this schedule is used changes nothing for
        the others (their chunks, the admissions and the prefix cache stay those of a schedule without it).
        """
        if strict and self.waiting:
            return False
        bm, budget = self.block_manager, self.config.max_num_batched_tokens
        blocks = window = slots = 0
        for seq in self.running:
            if seq.seq_id in leaving:
                continue
            num_new = self._chunk(seq, budget)
            if strict and num_new < seq.num_uncomputed:
                return False
            if num_new == 1 and seq.num_uncomputed == 1 and seq.draft_budget:  # every draft it may verify
                num_new += min(seq.draft_budget, len(seq.draft_token_ids), budget - 1)
            new_blocks, missing, slot = bm.needs(seq, num_new + seq.num_unresolved_drafts)
            blocks, window, slots, budget = blocks + new_blocks, window + len(missing), slots + slot, budget - num_new
        pools = (bm.blocks, bm.window_blocks, bm.slots)
        free = [len(pool.free) if strict else pool.num_free for pool in pools]
        return blocks <= free[0] and window <= free[1] and slots <= free[2]

    def _release_waiting(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.pending_restore = None

    def preempt(self, seq: Sequence) -> None:
        """Drop the sequence's memory; it is recomputed from its tokens when rescheduled."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.pending_restore = None
        seq.clear_drafts()
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)

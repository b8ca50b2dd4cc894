"""Continuous batching under a token budget: decodes and prefill chunks mixed, preemption by recompute."""

from __future__ import annotations

from collections import deque

from deepinfer_core.config import SchedulerConfig
from deepinfer_core.engine.block_manager import BlockManager
from deepinfer_core.engine.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        if self.config.enable_chunked_prefill:
            return min(seq.num_uncomputed, budget)
        return seq.num_uncomputed if seq.num_uncomputed <= budget else 0

    def schedule(self) -> tuple[list[tuple[Sequence, int]], list[Sequence]]:
        """Returns (sequence, tokens to compute) pairs and sequences that can never fit the pools."""
        bm, budget = self.block_manager, self.config.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        unfittable: list[Sequence] = []
        for seq in list(self.running):
            if seq not in self.running:
                continue  # preempted below by an earlier sequence
            num_new = self._chunk(seq, budget)
            if num_new == 0:
                continue
            while not bm.can_allocate(seq, num_new):
                victim = self.running[-1]
                if victim is seq and len(self.running) == 1 and not scheduled:
                    unfittable.append(seq)
                    self.running.remove(seq)
                    break
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                bm.allocate(seq, num_new)
                scheduled.append((seq, num_new))
                budget -= num_new
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            num_new = self._chunk(seq, budget)
            if num_new == 0:
                break
            if not bm.can_allocate(seq, num_new):
                if not self.running and not scheduled:
                    unfittable.append(self.waiting.popleft())
                    continue
                break
            self.waiting.popleft()
            bm.allocate(seq, num_new)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append((seq, num_new))
            budget -= num_new
        return scheduled, unfittable

    def preempt(self, seq: Sequence) -> None:
        """Drop the sequence's memory; it is recomputed from its tokens when rescheduled."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
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

"""Ref-counted books for the two paged pools and the per-sequence state slots.

Compressed blocks are kept for a sequence's whole life; window blocks only while the sliding window
(or a chunk being computed) still covers them. All three are handed out and returned here, and
``check_invariants`` proves nothing leaked or was freed twice.
"""

from __future__ import annotations

from collections import deque

from deepinfer_core.engine.sequence import Sequence


class Pool:
    def __init__(self, name: str, size: int):
        self.name, self.size = name, size
        self.free: deque[int] = deque(range(size))
        self.ref = [0] * size

    def allocate(self) -> int:
        block = self.free.popleft()
        assert self.ref[block] == 0, f"{self.name} block {block} handed out while referenced"
        self.ref[block] = 1
        return block

    def release(self, block: int) -> None:
        if self.ref[block] <= 0:
            raise AssertionError(f"double free of {self.name} block {block}")
        self.ref[block] -= 1
        if self.ref[block] == 0:
            self.free.append(block)

    @property
    def num_free(self) -> int:
        return len(self.free)


class BlockManager:
    def __init__(self, num_blocks: int, num_window_blocks: int, num_state_slots: int, block_size: int,
                 sliding_window: int):
        self.block_size, self.window = block_size, sliding_window
        self.blocks = Pool("compressed", num_blocks)
        self.window_blocks = Pool("window", num_window_blocks)
        self.slots = Pool("state", num_state_slots)
        self.owners: dict[int, Sequence] = {}

    def _needs(self, seq: Sequence, num_new: int) -> tuple[int, list[int], bool]:
        """(new compressed blocks, logical window blocks missing, needs a state slot) for a step."""
        end = seq.num_computed_tokens + num_new
        bs = self.block_size
        new_blocks = max(0, -(-end // bs) - len(seq.block_table))
        first_window = max(0, seq.num_computed_tokens - self.window + 1) // bs
        table = seq.window_block_table
        missing = [b for b in range(first_window, -(-end // bs)) if b >= len(table) or table[b] < 0]
        return new_blocks, missing, seq.state_slot is None

    def can_allocate(self, seq: Sequence, num_new: int) -> bool:
        blocks, window, slot = self._needs(seq, num_new)
        return (blocks <= self.blocks.num_free and len(window) <= self.window_blocks.num_free
                and (not slot or self.slots.num_free > 0))

    def allocate(self, seq: Sequence, num_new: int) -> None:
        """Give ``seq`` everything a step of ``num_new`` tokens writes; call ``can_allocate`` first."""
        blocks, window, slot = self._needs(seq, num_new)
        if slot:
            seq.state_slot = self.slots.allocate()
        seq.block_table.extend(self.blocks.allocate() for _ in range(blocks))
        for logical in window:
            while len(seq.window_block_table) <= logical:
                seq.window_block_table.append(-1)
            seq.window_block_table[logical] = self.window_blocks.allocate()
        self.owners[seq.seq_id] = seq

    def trim_window(self, seq: Sequence) -> None:
        """Release window blocks the next query can no longer see."""
        first_needed = max(0, seq.num_computed_tokens - self.window + 1) // self.block_size
        for logical in range(min(first_needed, len(seq.window_block_table))):
            block = seq.window_block_table[logical]
            if block >= 0:
                self.window_blocks.release(block)
                seq.window_block_table[logical] = -1

    def free(self, seq: Sequence) -> None:
        for block in seq.block_table:
            self.blocks.release(block)
        for block in seq.window_block_table:
            if block >= 0:
                self.window_blocks.release(block)
        if seq.state_slot is not None:
            self.slots.release(seq.state_slot)
        seq.block_table, seq.window_block_table, seq.state_slot = [], [], None
        self.owners.pop(seq.seq_id, None)

    def check_invariants(self) -> None:
        """Every referenced block is owned exactly as often as counted; free + used = total."""
        for pool, tables in (
            (self.blocks, [s.block_table for s in self.owners.values()]),
            (self.window_blocks, [s.window_block_table for s in self.owners.values()]),
            (self.slots, [[s.state_slot] if s.state_slot is not None else [] for s in self.owners.values()]),
        ):
            counts = [0] * pool.size
            for table in tables:
                for block in table:
                    if block >= 0:
                        counts[block] += 1
            assert counts == pool.ref, f"{pool.name} pool reference counts disagree with the tables"
            free = set(pool.free)
            assert len(free) == len(pool.free), f"{pool.name} pool lists a block as free twice"
            assert all(pool.ref[b] == 0 for b in free), f"{pool.name} pool lists a referenced block as free"
            assert len(free) + sum(1 for r in pool.ref if r > 0) == pool.size, f"{pool.name} pool leaked blocks"

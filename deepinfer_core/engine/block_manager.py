"""Ref-counted books for the two paged pools and the per-sequence state slots, with prefix caching.

Compressed blocks are kept for a sequence's whole life; window blocks only while the sliding window
(or a chunk being computed) still covers them. A full block gets a hash chained over the token ids
of every block before it; an unreferenced hashed block is not freed but parked in an LRU, from which a
later request with the same prefix takes it back, and which is evicted only when memory runs out.
Shared blocks are never written: a sequence only writes positions past its shared prefix, so no
copy-on-write is needed (``assert_private`` checks it).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from dataclasses import dataclass

from deepinfer_core.engine.multimodal import block_extra_keys
from deepinfer_core.engine.sequence import Sequence


class Pool:
    def __init__(self, name: str, size: int):
        self.name, self.size = name, size
        self.free: deque[int] = deque(range(size))
        self.ref = [0] * size
        self.hash_of: list[bytes | None] = [None] * size
        self.cached: dict[bytes, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()  # unreferenced hashed blocks, oldest first

    @property
    def num_free(self) -> int:
        return len(self.free) + len(self.lru)

    def allocate(self) -> int:
        if self.free:
            block = self.free.popleft()
        else:
            block, _ = self.lru.popitem(last=False)
            self._forget(block)
        assert self.ref[block] == 0, f"{self.name} block {block} handed out while referenced"
        self.ref[block] = 1
        return block

    def acquire(self, block: int) -> None:
        """Take one more reference to a cached block (a prefix hit)."""
        self.lru.pop(block, None)
        self.ref[block] += 1

    def release(self, block: int) -> None:
        if self.ref[block] <= 0:
            raise AssertionError(f"double free of {self.name} block {block}")
        self.ref[block] -= 1
        if self.ref[block] == 0:
            if self.hash_of[block] is not None:
                self.lru[block] = None
            else:
                self.free.append(block)

    def register(self, block: int, block_hash: bytes) -> None:
        if self.hash_of[block] is None and block_hash not in self.cached:
            self.hash_of[block] = block_hash
            self.cached[block_hash] = block

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash)

    def _forget(self, block: int) -> None:
        block_hash = self.hash_of[block]
        if block_hash is not None:
            del self.cached[block_hash]
            self.hash_of[block] = None

    def reset_cache(self) -> None:
        for block in list(self.lru):
            self._forget(block)
            self.free.append(block)
        self.lru.clear()
        for block in range(self.size):
            self._forget(block)


@dataclass
class PrefixHit:
    cached_tokens: int  # tokens whose computation is skipped
    replayed_tokens: int  # tokens recomputed although their compressed blocks were reused
    restore_block: int  # compressed block whose boundary record seeds the compressor state


class BlockManager:
    def __init__(self, num_blocks: int, num_window_blocks: int, num_state_slots: int, block_size: int,
                 sliding_window: int, enable_prefix_caching: bool = False, max_replay_tokens: int = 512,
                 cache_salt: str = ""):
        self.block_size, self.window = block_size, sliding_window
        self.blocks = Pool("compressed", num_blocks)
        self.window_blocks = Pool("window", num_window_blocks)
        self.slots = Pool("state", num_state_slots)
        self.owners: dict[int, Sequence] = {}
        self.enable_prefix_caching = enable_prefix_caching
        self.max_replay_tokens = max_replay_tokens
        self.root_hash = hashlib.blake2b(cache_salt.encode(), digest_size=16).digest()
        self.stats = {"queries": 0, "query_tokens": 0, "hit_tokens": 0, "replayed_tokens": 0}

    # --- hashing and prefix lookup ---------------------------------------------------------------

    def block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        hashes, tokens, bs = seq.block_hashes, seq.token_ids, self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            h = hashlib.blake2b(hashes[-1] if hashes else self.root_hash, digest_size=16)
            h.update(b"".join(t.to_bytes(4, "little") for t in tokens[i * bs:(i + 1) * bs]))
            h.update(block_extra_keys(seq.mm_items, i * bs, (i + 1) * bs))  # the images its positions read
            hashes.append(h.digest())
        return hashes[:num_blocks]

    def _window_blocks_for(self, boundary: int) -> range:
        """Logical window blocks a query at position ``boundary`` attends into (besides its own)."""
        return range(max(0, boundary - self.window + 1) // self.block_size, boundary // self.block_size)

    def admit(self, seq: Sequence, limit: int | None = None) -> PrefixHit | None:
        """Reuse the longest restorable cached prefix of a sequence that holds no memory yet, of at most
        ``limit`` tokens (bounded replay: its floor, from which every layer recomputes)."""
        if not self.enable_prefix_caching or seq.block_table or seq.num_computed_tokens:
            return None
        bs = self.block_size
        last = len(seq) - 1 if limit is None else min(len(seq) - 1, limit)
        hashes = self.block_hashes(seq, last // bs)  # at least one token is left to compute
        self.stats["queries"] += 1
        self.stats["query_tokens"] += len(seq)
        k = 0
        while k < len(hashes) and self.blocks.lookup(hashes[k]) is not None:
            k += 1
        j = k
        while j > 0 and not all(self.window_blocks.lookup(hashes[i]) is not None
                                for i in self._window_blocks_for(j * bs)):
            j -= 1
        if j == 0:
            return None
        shared = k if (k - j) * bs <= self.max_replay_tokens else j
        for i in range(shared):
            block = self.blocks.lookup(hashes[i])
            self.blocks.acquire(block)
            seq.block_table.append(block)
        seq.window_block_table = [-1] * j
        for i in self._window_blocks_for(j * bs):
            block = self.window_blocks.lookup(hashes[i])
            self.window_blocks.acquire(block)
            seq.window_block_table[i] = block
        seq.num_computed_tokens = j * bs
        seq.write_from = shared * bs
        self.owners[seq.seq_id] = seq
        hit = PrefixHit(j * bs, (shared - j) * bs, seq.block_table[j - 1])
        self.stats["hit_tokens"] += hit.cached_tokens
        self.stats["replayed_tokens"] += hit.replayed_tokens
        return hit

    def commit(self, seq: Sequence) -> None:
        """After a step: register the sequence's newly completed blocks, then release stale window blocks."""
        if self.enable_prefix_caching:
            full = seq.num_computed_tokens // self.block_size
            for i, h in enumerate(self.block_hashes(seq, full)):
                if i < len(seq.block_table):
                    self.blocks.register(seq.block_table[i], h)
                if i < len(seq.window_block_table) and seq.window_block_table[i] >= 0:
                    self.window_blocks.register(seq.window_block_table[i], h)
        self.trim_window(seq)

    def reset_prefix_cache(self) -> None:
        for pool in (self.blocks, self.window_blocks):
            pool.reset_cache()

    # --- allocation ------------------------------------------------------------------------------

    def needs(self, seq: Sequence, num_new: int) -> tuple[int, list[int], bool]:
        """(new compressed blocks, logical window blocks missing, needs a state slot) for a step."""
        end = seq.num_computed_tokens + num_new
        bs = self.block_size
        new_blocks = max(0, -(-end // bs) - len(seq.block_table))
        first_window = max(0, seq.num_computed_tokens - self.window + 1) // bs
        table = seq.window_block_table
        missing = [b for b in range(first_window, -(-end // bs)) if b >= len(table) or table[b] < 0]
        return new_blocks, missing, seq.state_slot is None

    def can_allocate(self, seq: Sequence, num_new: int) -> bool:
        blocks, window, slot = self.needs(seq, num_new)
        return (blocks <= self.blocks.num_free and len(window) <= self.window_blocks.num_free
                and (not slot or self.slots.num_free > 0))

    def allocate(self, seq: Sequence, num_new: int) -> None:
        """Give ``seq`` everything a step of ``num_new`` tokens writes; call ``can_allocate`` first."""
        blocks, window, slot = self.needs(seq, num_new)
        if slot:
            seq.state_slot = self.slots.allocate()
        seq.block_table.extend(self.blocks.allocate() for _ in range(blocks))
        for logical in window:
            while len(seq.window_block_table) <= logical:
                seq.window_block_table.append(-1)
            seq.window_block_table[logical] = self.window_blocks.allocate()
        self.owners[seq.seq_id] = seq
        self.assert_private(seq, num_new)

    def assert_private(self, seq: Sequence, num_new: int) -> None:
        """Every block this step writes belongs to ``seq`` alone."""
        bs, start = self.block_size, seq.num_computed_tokens
        for logical in range(start // bs, -(-(start + num_new) // bs)):
            assert self.window_blocks.ref[seq.window_block_table[logical]] == 1, "write into a shared window block"
            if logical * bs + bs > seq.write_from:
                assert self.blocks.ref[seq.block_table[logical]] == 1, "write into a shared compressed block"

    def trim_window(self, seq: Sequence) -> None:
        """Release window blocks the next query can no longer see."""
        first_needed = max(0, seq.num_computed_tokens - self.window + 1) // self.block_size
        for logical in range(min(first_needed, len(seq.window_block_table))):
            block = seq.window_block_table[logical]
            if block >= 0:
                self.window_blocks.release(block)
                seq.window_block_table[logical] = -1

    def release_tail(self, seq: Sequence, in_flight: int = 0) -> None:
        """Release blocks past the sequence's tokens (taken for drafts that were rejected): window blocks
        from the first one no computed token is in, compressed blocks past the last token. ``in_flight``:
        drafts a launched step writes after the computed tokens, whose blocks stay."""
        bs = self.block_size
        end = seq.num_computed_tokens + in_flight
        for logical in range(-(-end // bs), len(seq.window_block_table)):
            block = seq.window_block_table[logical]
            if block >= 0:
                self.window_blocks.release(block)
        del seq.window_block_table[-(-end // bs):]
        keep = -(-max(len(seq), end) // bs)
        for block in seq.block_table[keep:]:
            self.blocks.release(block)
        del seq.block_table[keep:]

    def free(self, seq: Sequence) -> None:
        for block in seq.block_table:
            self.blocks.release(block)
        for block in seq.window_block_table:
            if block >= 0:
                self.window_blocks.release(block)
        if seq.state_slot is not None:
            self.slots.release(seq.state_slot)
        seq.block_table, seq.window_block_table, seq.state_slot = [], [], None
        seq.write_from = 0
        self.owners.pop(seq.seq_id, None)

    def check_invariants(self) -> None:
        """Reference counts equal table references; free, cached-idle and referenced blocks partition each pool."""
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
            free, idle = set(pool.free), set(pool.lru)
            assert len(free) == len(pool.free), f"{pool.name} pool lists a block as free twice"
            assert not free & idle, f"{pool.name} pool lists a block both free and cached"
            # reference counts are never negative: any() of the counts is "some block is referenced"
            assert not any(map(pool.ref.__getitem__, free | idle)), f"{pool.name} pool lists a referenced block as free"
            assert all(pool.hash_of[b] is not None for b in idle), f"{pool.name} pool caches an unhashed block"
            assert all(pool.hash_of[b] == h for h, b in pool.cached.items()), f"{pool.name} hash map is stale"
            used = pool.size - pool.ref.count(0)
            assert len(free) + len(idle) + used == pool.size, f"{pool.name} pool leaked blocks"

    def all_free(self) -> bool:
        """No block or slot is referenced (cached idle blocks count as free)."""
        return all(sum(pool.ref) == 0 for pool in (self.blocks, self.window_blocks, self.slots))

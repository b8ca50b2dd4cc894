"""Prefix-cache affinity for the data-parallel front-end: a request whose prompt shares full KV blocks
with an earlier request goes to the rank that ran that one (whose prefix cache holds those blocks),
unless that rank has more than ``max_imbalance_tokens`` outstanding tokens above the least loaded rank;
otherwise to the least loaded rank. Blocks are known by the chained hash of their token ids, as the
ranks' prefix caches key them; the table keeps the most recent ``max_entries`` blocks."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """One hash per full block of ``token_ids``, each chained on the blocks before it."""
    hashes, prev = [], 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prev = hash((prev, tuple(token_ids[start:start + block_size])))
        hashes.append(prev)
    return hashes


class PrefixAffinityRouter:
    def __init__(self, num_ranks: int, block_size: int, max_imbalance_tokens: int, max_entries: int = 1 << 16):
        self.num_ranks, self.block_size = num_ranks, block_size
        self.max_imbalance_tokens, self.max_entries = max_imbalance_tokens, max_entries
        self._rank_of: OrderedDict[int, int] = OrderedDict()  # block hash -> the rank that last computed it
        self.num_affinity_hits = 0

    def choose(self, token_ids: Sequence[int], load: Sequence[int]) -> int:
        """The rank for a prompt, given every rank's outstanding tokens; remembers the choice."""
        hashes = block_hashes(token_ids, self.block_size)
        least = min(range(self.num_ranks), key=lambda r: (load[r], r))
        rank = least
        for h in reversed(hashes):  # the longest known prefix
            owner = self._rank_of.get(h)
            if owner is not None:
                if load[owner] - load[least] <= self.max_imbalance_tokens:
                    rank = owner
                    self.num_affinity_hits += owner != least
                break
        for h in hashes:
            self._rank_of[h] = rank
            self._rank_of.move_to_end(h)
        while len(self._rank_of) > self.max_entries:
            self._rank_of.popitem(last=False)
        return rank

"""Bounded replay, level 1 (metadata only, no weights): ``mask`` and ``compact`` give the late layers the
same visible window keys, store slots, compressed-key ranges and window pivots, for random prompt lengths,
chunk sizes and keeps, several sequences per step (:mod:`deepinfer_core.model.replay`).

Beyond their agreement, the semantics themselves: a tail query sees exactly the window positions
``max(p - W + 1, replay_from) .. p``, each written by a tail token of this or an earlier step (never a
row the truncation skipped); its compressed-key range is the full prefill's; and a decode step after the
prefill carries no cut at all, its window lying inside the tail.
"""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer_core.model.cache_layout import BranchSpec
from deepinfer_core.model.metadata import SeqSpan, build_forward_batch, compressed_candidates
from deepinfer_core.model.replay import REPLAY_MODES, late_batch, replay_keep, window_pivots

BLOCK = 8
SPECS = {BranchSpec(2, 64, False, kind="kv"), BranchSpec(1, 64, False, kind="kv", stateful=False)}


def _tables(rng: random.Random, num_seqs: int, blocks_each: int) -> list[list[int]]:
    """Each sequence's block table: distinct physical blocks in a shuffled order."""
    ids = list(range(num_seqs * blocks_each))
    rng.shuffle(ids)
    return [ids[i * blocks_each:(i + 1) * blocks_each] for i in range(num_seqs)]


def _visible_positions(batch, rows: torch.Tensor) -> list[list[int]]:
    """Per query row, the window positions its visible (non -1) window rows stand for."""
    window = batch.window_layout[0]
    out = []
    for r, p in zip(rows.tolist(), batch.positions.tolist()):
        out.append([p - window + 1 + j for j, v in enumerate(r) if v >= 0])
    return out


def _run(seed: int):
    """Prefill every sequence in random chunks (mixed in shared steps), then one decode step; yields each
    step's (spans, batch)."""
    rng = random.Random(seed)
    window = rng.choice([4, 8, 13])
    keep = replay_keep(window, rng.choice([0, 1, 3]), rng.choice([0, window]))
    num_seqs = rng.randint(1, 3)
    lens = [rng.randint(1, 70) for _ in range(num_seqs)]
    tables = _tables(rng, num_seqs, -(-80 // BLOCK))
    floor = [max(0, n - keep) for n in lens]
    done = [0] * num_seqs
    while any(d < n for d, n in zip(done, lens)):
        spans, ids = [], []
        for s in range(num_seqs):
            if done[s] < lens[s] and rng.random() < 0.8:
                n = min(rng.randint(1, 20), lens[s] - done[s])
                spans.append((s, SeqSpan(done[s], n, tables[s], tables[s], s, replay_from=floor[s])))
                ids += [5] * n
                done[s] += n
        if spans:
            yield window, floor, spans, build_forward_batch(ids, [sp for _, sp in spans], SPECS, BLOCK, window)
    decode = [(s, SeqSpan(lens[s], 1, tables[s], tables[s], s, replay_from=floor[s])) for s in range(num_seqs)]
    yield window, floor, decode, build_forward_batch([5] * num_seqs, [sp for _, sp in decode], SPECS, BLOCK, window)


@pytest.mark.parametrize("seed", range(40))
def test_mask_and_compact_cut_the_same_keys_and_slots(seed):
    written: set[int] = set()  # window rows the late layers have stored, over every step so far
    stored = {mode: [] for mode in REPLAY_MODES}
    for window, floor, spans, batch in _run(seed):
        seq_of = torch.tensor([s for s, sp in spans for _ in range(sp.num_new)])
        if batch.replay_floor is None:  # no cut: every late-layer query sees a full window inside the tail
            assert all(max(0, sp.context_len - window + 1) >= floor[s] for s, sp in spans)
            for p, vis in zip(batch.positions.tolist(), _visible_positions(batch, batch.window_rows())):
                assert vis == list(range(max(0, p - window + 1), p + 1))
            read = batch.window_rows()
            assert set(read[read >= 0].tolist()) <= written | set(batch.window_slots.tolist())
            written |= set(batch.window_slots.tolist())
            continue
        mask, compact = late_batch(batch, "mask"), late_batch(batch, "compact")
        tail = mask.keep
        assert torch.equal(compact.rows, torch.nonzero(tail).view(-1))
        assert torch.equal(tail, batch.positions >= torch.tensor(floor)[seq_of])
        # store slots: the tail's own, nothing (the trash) for the rest
        assert torch.equal(mask.batch.window_slots[tail], compact.batch.window_slots)
        assert torch.equal(compact.batch.window_slots, batch.window_slots[tail])
        assert bool((mask.batch.window_slots[~tail] == -1).all())
        # visible keys: the same rows; the non-tail queries of mask see nothing below the floor
        assert torch.equal(mask.batch.window_indices[tail], compact.batch.window_indices)
        # compressed-key ranges: the full prefill's (global KV is complete)
        for rate in (1, 2):
            full = compressed_candidates(batch, rate, BLOCK)
            assert torch.equal(compressed_candidates(mask.batch, rate, BLOCK)[tail],
                               compressed_candidates(compact.batch, rate, BLOCK))
            assert torch.equal(compressed_candidates(compact.batch, rate, BLOCK), full[tail])
        # window pivots: the first visible position is max(p - W + 1, floor), and every key from it is seen
        pivots = window_pivots(compact.batch)
        assert torch.equal(window_pivots(mask.batch)[tail], pivots)
        visible = _visible_positions(compact.batch, compact.batch.window_indices)
        for p, pivot, vis in zip(compact.batch.positions.tolist(), pivots.tolist(), visible):
            assert vis == list(range(pivot, p + 1))
        # and each visible row was written by a tail token: of an earlier step, or of this one
        step_slots = set(compact.batch.window_slots.tolist())
        rows = compact.batch.window_indices
        assert set(rows[rows >= 0].tolist()) <= written | step_slots
        written |= step_slots
        for mode, late in (("mask", mask), ("compact", compact)):
            stored[mode] += sorted(s for s in late.batch.window_slots.tolist() if s >= 0)
    assert stored["mask"] == stored["compact"]


def test_no_cut_without_replay_from_or_past_the_window():
    """A span whose window never reaches below its floor carries no metadata: the forward is the full one."""
    table = list(range(8))
    plain = build_forward_batch([5] * 20, [SeqSpan(0, 20, table, table, 0)], SPECS, BLOCK, 8)
    assert plain.replay_floor is None and plain.replay_rows is None
    past = build_forward_batch([5] * 3, [SeqSpan(20, 3, table, table, 0, replay_from=13)], SPECS, BLOCK, 8)
    assert past.replay_floor is None
    cut = build_forward_batch([5] * 3, [SeqSpan(20, 3, table, table, 0, replay_from=14)], SPECS, BLOCK, 8)
    assert cut.replay_floor.tolist() == [14] * 3 and cut.replay_rows.tolist() == [0, 1, 2]


def test_keep_is_the_window_plus_the_longest_backtracking():
    assert replay_keep(128) == 128
    assert replay_keep(128, num_speculative_tokens=5) == 133
    assert replay_keep(128, num_speculative_tokens=5, capture_window=128) == 256


def test_unknown_mode_is_refused():
    table = list(range(8))
    batch = build_forward_batch([5] * 20, [SeqSpan(0, 20, table, table, 0, replay_from=10)], SPECS, BLOCK, 8)
    with pytest.raises(ValueError, match="mask"):
        late_batch(batch, "skip")

"""A padded step laid out on the device (``derive_padded``) from the per-sequence facts the host knows,
with contexts moved on by a shift only the device knows, equals the host's layout of the moved spans:
steps of 1 to 5 tokens closing compression windows, crossing block ends and window-table blocks."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer_core.model.cache import CompressorSpec
from deepinfer_core.model.metadata import GraphPadding, PaddedFacts, SeqSpan, build_forward_batch, derive_padded

SPECS = {CompressorSpec(4, 8, True), CompressorSpec(16, 8, False)}
BLOCK, WINDOW = 16, 8


def random_spans(rng: random.Random, n: int, q: int, shift: int) -> list[SeqSpan]:
    spans, free, free_window = [], iter(range(1000)), iter(range(1000))
    for slot in range(n):
        ctx = rng.choice([0, 1, 3, 7, 13, 14, 15, 16, 31, 47, 60, rng.randrange(90)])
        last = ctx + shift + q - 1
        blocks = [next(free) for _ in range(last // BLOCK + 1)]
        window = [next(free_window) for _ in range(last // BLOCK + 1)]
        released = max(0, ctx - WINDOW + 1) // BLOCK
        window[:released] = [-1] * released
        spans.append(SeqSpan(ctx, q, blocks, window, slot, rng.choice([0, 0, ctx // 2])))
    return spans


@pytest.mark.parametrize("q", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("seed", range(4))
def test_derived_layout_equals_host_layout(q, seed):
    rng = random.Random(seed * 10 + q)
    n, size, shift = rng.randint(1, 4), 4, q - 1
    spans = random_spans(rng, n, q, shift)
    pad = GraphPadding(size, {4: 32, 16: 8}, 128, query_len=q)
    shifts = [rng.randint(0, shift) for _ in spans]
    ids = [rng.randrange(1, 50) for _ in range(n * q)]
    moved = [SeqSpan(s.context_len + d, q, s.block_table, s.window_block_table, s.state_slot, s.write_from)
             for s, d in zip(spans, shifts)]
    want = build_forward_batch(ids, moved, SPECS, BLOCK, WINDOW, pad=pad)

    static = build_forward_batch([], [], SPECS, BLOCK, WINDOW, pad=pad)
    static = static.with_storage(static.packed().clone())
    static.storage.fill_(-7)
    cols = (WINDOW + 2 * q) // BLOCK + 2
    facts = PaddedFacts.from_spans(spans, [0] * (n * q), pad, BLOCK, WINDOW, window_blocks=cols)
    device = facts.views(facts.packed().clone())
    device.ctx[:n] += torch.tensor(shifts)
    device.input_ids[: n * q] = torch.tensor(ids)
    derive_padded(static, device, SPECS, BLOCK, WINDOW)
    got, expect = static.tensors(), want.tensors()
    assert got.keys() == expect.keys()
    for name in expect:
        assert torch.equal(got[name], expect[name]), name


def test_window_rows_past_the_table_are_unresident():
    """A position whose block is past a fixed-width window table reads and writes nothing (-1), never the
    last column's block."""
    spans = [SeqSpan(40, 1, [0, 1, 2], [5, 6, 7], 0)]
    pad = GraphPadding(1, {}, None, 1)
    facts = PaddedFacts.from_spans(spans, [3], pad, BLOCK, WINDOW, window_blocks=1)  # from block 2: [7]
    facts.ctx[0] = 48  # block 3, past the table
    static = build_forward_batch([], [], set(), BLOCK, WINDOW, pad=pad)
    static = static.with_storage(static.packed().clone())
    derive_padded(static, facts.views(facts.packed()), set(), BLOCK, WINDOW)
    assert static.window_slots.tolist() == [-1]
    assert static.window_indices[0, -2].item() == 7 * BLOCK + 15  # position 47: block 2's last row


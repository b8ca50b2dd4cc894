"""Per-step attention metadata for a flat varlen batch: every cache index the layers need.

Built once per step on the host from the scheduler's view of each sequence (how many tokens are
cached, how many are new, its block tables and state slot), then shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer_core.model.cache import CompressorSpec


@dataclass
class SeqSpan:
    """One sequence's slice of a step."""

    context_len: int  # tokens already in the cache
    num_new: int  # tokens computed in this step
    block_table: list[int]  # compressed pool: logical block -> physical block
    window_block_table: list[int]  # window pool: logical block -> physical block (-1 = released)
    state_slot: int
    write_from: int = 0  # compressed entries of windows starting before this position are not written

    @property
    def seq_len(self) -> int:
        return self.context_len + self.num_new


@dataclass
class CompressorMeta:
    """Indices for one compressor kind (rate, overlap) in one step.

    The compressor's source rows are ``cat(ring[ring_read], fresh_rows, dummy_row)``; ``cur_idx`` and
    ``prev_idx`` index that buffer (``prev_idx`` only with overlapping windows; the dummy row stands
    for the empty half of window 0).
    """

    ring_read: torch.Tensor  # [R] flat ring rows read this step
    cur_idx: torch.Tensor  # [Nw, rate]
    prev_idx: torch.Tensor | None  # [Nw, rate]
    entry_slots: torch.Tensor  # [Nw] destination rows in the compressed pool
    entry_positions: torch.Tensor  # [Nw] first source position of each window (RoPE position)
    ring_write: torch.Tensor  # [Rw] flat ring rows written
    ring_write_src: torch.Tensor  # [Rw] fresh token rows written there
    bias_idx: torch.Tensor  # [T] position % rate (which position-bias row each token gets)
    candidates: torch.Tensor  # [T, E] compressed-pool rows each query may attend (-1 pad)
    boundary_src: torch.Tensor  # [Nb, rate] source rows of the last window before each block end crossed
    boundary_dst: torch.Tensor  # [Nb] compressed block whose boundary record they are saved into


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    window_slots: torch.Tensor  # [T] where each token's window KV is written
    window_indices: torch.Tensor  # [T, W] window-pool rows each query attends (-1 pad)
    logits_indices: torch.Tensor  # rows whose logits are wanted
    query_start_loc: list[int]
    compressors: dict[tuple[int, bool], CompressorMeta] = field(default_factory=dict)  # (rate, overlap)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def _pool_rows(table: torch.Tensor, positions: torch.Tensor, block_size: int, rate: int = 1) -> torch.Tensor:
    """Pool row of source position ``positions`` (or of the entry whose window starts there)."""
    per_block = block_size // rate
    entry = positions // rate
    phys = table[(positions // block_size).clamp(min=0, max=max(len(table) - 1, 0))]
    rows = phys * per_block + entry % per_block
    return torch.where((positions >= 0) & (phys >= 0), rows, torch.full_like(rows, -1))


def build_forward_batch(
    token_ids: list[int],
    spans: list[SeqSpan],
    compressor_specs: set[CompressorSpec],
    block_size: int,
    sliding_window: int,
    logits_indices: list[int] | None = None,
    device: torch.device | str = "cpu",
) -> ForwardBatch:
    """Flatten ``spans`` into one batch; ``token_ids`` holds every span's new tokens in order."""
    lo = torch.long
    starts = [0]
    for s in spans:
        starts.append(starts[-1] + s.num_new)
    if starts[-1] != len(token_ids):
        raise ValueError(f"spans cover {starts[-1]} tokens but {len(token_ids)} token ids were given")
    positions, wslots, windices = [], [], []
    tables = [torch.tensor(s.block_table or [-1], dtype=lo) for s in spans]
    wtables = [torch.tensor(s.window_block_table or [-1], dtype=lo) for s in spans]
    offsets = torch.arange(sliding_window, dtype=lo) - (sliding_window - 1)
    for s, wt in zip(spans, wtables):
        pos = torch.arange(s.context_len, s.seq_len, dtype=lo)
        positions.append(pos)
        wslots.append(_pool_rows(wt, pos, block_size))
        windices.append(_pool_rows(wt, pos.unsqueeze(1) + offsets, block_size))
    pos_all = torch.cat(positions) if positions else torch.zeros(0, dtype=lo)
    batch = ForwardBatch(
        input_ids=torch.tensor(token_ids, dtype=lo, device=device),
        positions=pos_all.to(device),
        window_slots=torch.cat(wslots).to(device) if wslots else torch.zeros(0, dtype=lo, device=device),
        window_indices=(torch.cat(windices) if windices else torch.zeros(0, sliding_window, dtype=lo)).to(device),
        logits_indices=torch.tensor(
            logits_indices if logits_indices is not None else [e - 1 for e in starts[1:]], dtype=lo, device=device
        ),
        query_start_loc=starts,
    )
    for rate, overlap in {(spec.rate, spec.overlap) for spec in compressor_specs}:
        batch.compressors[rate, overlap] = _compressor_meta(
            CompressorSpec(rate, 0, overlap), spans, tables, starts, pos_all, block_size, device
        )
    return batch


def _compressor_meta(
    spec: CompressorSpec,
    spans: list[SeqSpan],
    tables: list[torch.Tensor],
    starts: list[int],
    pos_all: torch.Tensor,
    block_size: int,
    device,
) -> CompressorMeta:
    lo, rate, rows = torch.long, spec.rate, spec.rows
    num_tokens = starts[-1]
    ring_read, cur, prev, slots, wpos, rw, rw_src, cands = [], [], [], [], [], [], [], []
    bsrc, bdst = [], []
    read_base = []  # per seq: compact index of its first ring row read, and first position read
    n_read = 0
    for s in spans:
        first = max(0, s.context_len - rows)
        read_pos = torch.arange(first, s.context_len, dtype=lo)
        ring_read.append(s.state_slot * rows + read_pos % rows)
        read_base.append((n_read, first))
        n_read += len(read_pos)
    fresh_base = n_read
    dummy = fresh_base + num_tokens

    for b, (s, table) in enumerate(zip(spans, tables)):
        base, first = read_base[b]

        def source(p: torch.Tensor, s=s, b=b, base=base, first=first) -> torch.Tensor:
            fresh = fresh_base + starts[b] + (p - s.context_len)
            old = base + (p - first)
            return torch.where(p >= s.context_len, fresh, torch.where(p >= 0, old, torch.full_like(p, dummy)))

        windows = torch.arange(s.context_len // rate, s.seq_len // rate, dtype=lo)
        within = torch.arange(rate, dtype=lo)
        cur.append(source(windows.unsqueeze(1) * rate + within))
        if spec.overlap:
            prev.append(source((windows.unsqueeze(1) - 1) * rate + within))
        entry_rows = _pool_rows(table, windows * rate, block_size, rate)
        slots.append(torch.where(windows * rate >= s.write_from, entry_rows, torch.full_like(entry_rows, -1)))
        wpos.append(windows * rate)
        if spec.overlap:
            ends = torch.arange(s.context_len // block_size + 1, s.seq_len // block_size + 1, dtype=lo) * block_size
            ends = ends[(ends > s.context_len) & (ends > s.write_from)]
            bsrc.append(source(ends.unsqueeze(1) - rate + within))
            bdst.append(table[ends // block_size - 1])
        new_pos = torch.arange(s.context_len, s.seq_len, dtype=lo)
        keep = new_pos >= s.seq_len - rows
        rw.append(s.state_slot * rows + new_pos[keep] % rows)
        rw_src.append(starts[b] + (new_pos[keep] - s.context_len))
        num_entries = (new_pos + 1) // rate
        max_e = int(s.seq_len // rate)
        entry = torch.arange(max_e, dtype=lo)
        rows_of_entries = _pool_rows(table, entry * rate, block_size, rate)
        cand = rows_of_entries.unsqueeze(0).expand(len(new_pos), -1)
        cands.append(torch.where(entry.unsqueeze(0) < num_entries.unsqueeze(1), cand, torch.full_like(cand, -1)))

    width = max([c.shape[1] for c in cands], default=0)
    cands = [torch.nn.functional.pad(c, (0, width - c.shape[1]), value=-1) for c in cands]

    def cat(parts, shape_tail=()):
        return torch.cat(parts).to(device) if parts else torch.zeros((0, *shape_tail), dtype=lo, device=device)

    return CompressorMeta(
        ring_read=cat(ring_read),
        cur_idx=cat(cur, (rate,)),
        prev_idx=cat(prev, (rate,)) if spec.overlap else None,
        entry_slots=cat(slots),
        entry_positions=cat(wpos),
        ring_write=cat(rw),
        ring_write_src=cat(rw_src),
        bias_idx=(pos_all % rate).to(device),
        candidates=cat(cands, (width,)),
        boundary_src=cat(bsrc, (rate,)),
        boundary_dst=cat(bdst),
    )

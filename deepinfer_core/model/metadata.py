"""Per-step attention metadata for a flat varlen batch: every cache index the layers need.

Built once per step on the host from the scheduler's view of each sequence (how many tokens are
cached, how many are new, its block tables and state slot), then shared by every layer. Nothing built on
the host grows with the context but the block tables (one id per block): the compressed entries each
query may attend are derived on the device, inside the forward (:func:`compressed_candidates`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np
import torch

from deepinfer_core.model.cache import CompressorSpec
from deepinfer_core.model.cache_layout import ring_rows


@dataclass
class SeqSpan:
    """One sequence's slice of a step."""

    context_len: int  # tokens already in the cache
    num_new: int  # tokens computed in this step
    block_table: list[int]  # compressed pool: logical block -> physical block
    window_block_table: list[int]  # window pool: logical block -> physical block (-1 = released)
    state_slot: int
    write_from: int = 0  # compressed entries of windows starting before this position are not written
    history: list[int] | None = None  # n-gram models: the token ids just before context_len (see ngram_index)
    # bounded replay (model/replay.py): the layers after the last KV source run only on positions from here,
    # and their window KV exists only from here (0: every position, the full prefill)
    replay_from: int = 0

    @property
    def seq_len(self) -> int:
        return self.context_len + self.num_new


def pad_tables(block_table: list[int], window_block_table: list[int], last: int, block_size: int
               ) -> tuple[list[int], list[int]]:
    """Both block tables padded with -1 up to position ``last``, so that a position past the blocks a
    sequence holds writes to the trash, never to another position's rows."""
    need = last // block_size + 1
    return ([*block_table, *[-1] * (need - len(block_table))],
            [*window_block_table, *[-1] * (need - len(window_block_table))])


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
    boundary_src: torch.Tensor  # [Nb, rate] source rows of the last window before each block end crossed
    boundary_dst: torch.Tensor  # [Nb] compressed block whose boundary record they are saved into


_META_FIELDS = tuple(f.name for f in fields(CompressorMeta))
#: the batch-level index tensors, in the order of ``ForwardBatch.tensors``
_TOP_FIELDS = ("input_ids", "positions", "window_slots", "window_indices", "logits_indices", "block_tables",
               "token_seq", "window_tables", "window_first", "ngram_tokens", "ngram_index", "replay_floor",
               "replay_rows")
#: n-gram history entries: a position before the sequence start, a dead token (an image token)
BEFORE_START, DEAD = -1, -2


@dataclass(frozen=True)
class GraphPadding:
    """The fixed layout of a captured graph: ``num_seqs`` sequences of ``query_len`` new tokens each (1 for
    decode, 1 + drafts for a verification), and ``max_entries[rate]`` compressed candidates per query,
    enough for sequences of ``context`` tokens (the graph's context bucket; None: as long as
    ``max_entries`` holds). ``ngram`` > 0 (an n-gram model): each sequence carries ``ngram - 1`` history
    tokens (:class:`PaddedFacts`), read through an index that is the same for every step of the layout."""

    num_seqs: int
    max_entries: dict[int, int]
    context: int | None = None
    query_len: int = 1
    ngram: int = 0

    def num_blocks(self, block_size: int) -> int:
        """Columns of the layout's block tables: the blocks its candidates can address."""
        if self.context is not None:
            return max(1, -(-self.context // block_size))
        return max([1] + [-(-n * rate // block_size) for rate, n in self.max_entries.items()])


@dataclass
class MultiModalEmbeds:
    """What the model reads at the image-span positions of a step instead of token embeddings: ``positions``
    [M] rows of the step's batch, ``embeds`` [M, D] their vectors (an image's span may be cut across
    steps: each step carries the rows of the positions it computes)."""

    positions: torch.Tensor
    embeds: torch.Tensor

    def to(self, device: torch.device | str) -> MultiModalEmbeds:
        return MultiModalEmbeds(self.positions.to(device), self.embeds.to(device))


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    window_slots: torch.Tensor  # [T] where each token's window KV is written
    window_indices: torch.Tensor | None  # [T, W] window-pool rows each query attends (-1 pad); see window_rows
    logits_indices: torch.Tensor  # rows whose logits are wanted
    query_start_loc: list[int]
    block_tables: torch.Tensor | None = None  # [S, B] compressed pool: logical block -> physical (-1 none)
    token_seq: torch.Tensor | None = None  # [T] the sequence (row of block_tables) of each token
    entry_widths: dict[int, int] = field(default_factory=dict)  # rate -> compressed candidates per query
    compressors: dict[tuple[int, bool], CompressorMeta] = field(default_factory=dict)  # (rate, overlap)
    padded_to: int | None = None  # set when the batch is laid out for a captured graph (GraphPadding)
    padded_context: int | None = None  # and the context bucket of that graph (GraphPadding.context)
    window_tables: torch.Tensor | None = None  # [S, Bw] window pool from logical block window_first[s]
    window_first: torch.Tensor | None = None  # [S]
    window_layout: tuple[int, int] | None = None  # (sliding_window, block_size) of the window tables
    storage: torch.Tensor | None = None  # the flat tensor every tensor of ``tensors()`` is a view of, packed
    # n-gram models (Engram): every token's last n token ids, [T, n], column s the id at position p - s, as
    # rows of cat(input_ids, ngram_tokens, [BEFORE_START, DEAD]) (see ngram_ids): tokens of this step are
    # read from input_ids on the device, where a previous step's sample may only arrive there
    ngram_tokens: torch.Tensor | None = None  # [H] the history tokens before each span's first new token
    ngram_index: torch.Tensor | None = None  # [T, n]
    # multimodal models: the step's image-span rows and their embeddings (None: text only); kept out of
    # ``tensors()`` (a float tensor, and only eager prefill steps carry one)
    mm: MultiModalEmbeds | None = None
    # bounded replay (model/replay.py), set only where it hides something this step: per token its sequence's
    # ``replay_from``; and the rows of the tokens at or past it (the tail the late layers run on)
    replay_floor: torch.Tensor | None = None  # [T]
    replay_rows: torch.Tensor | None = None  # [Tt]

    def ngram_ids(self) -> torch.Tensor:
        """[T, n] token ids (or BEFORE_START / DEAD) at positions p, p-1, ..., p-n+1 of every token."""
        # filled on the device: no host copy, so a CUDA graph may capture it
        tail = torch.full((2,), BEFORE_START, dtype=self.input_ids.dtype, device=self.input_ids.device)
        tail[1:].fill_(DEAD)
        return torch.cat([self.input_ids, self.ngram_tokens, tail])[self.ngram_index]

    def window_rows(self) -> torch.Tensor:
        """``window_indices``; where the batch was built without them (unpadded), derived on the batch's
        device from the window block tables once: a prefill chunk's [T, W] is not built on the host."""
        if self.window_indices is None:
            window, block_size = self.window_layout
            offsets = torch.arange(1 - window, 1, device=self.positions.device)
            self.window_indices = _pool_rows(self.window_tables, self.token_seq, self.positions.unsqueeze(1)
                                             + offsets, block_size, first=self.window_first,
                                             xp=_Xp(self.positions.device))
            self.storage = None
        return self.window_indices

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every index tensor of the batch by a stable name (compressor fields as ``"rate.overlap.field"``)."""
        out = {k: getattr(self, k) for k in _TOP_FIELDS if getattr(self, k) is not None}
        for (rate, overlap), meta in sorted(self.compressors.items()):
            out.update({f"{rate}.{int(overlap)}.{k}": v for k, v in vars(meta).items() if v is not None})
        return out

    def replace_tensors(self, new: dict[str, torch.Tensor]) -> ForwardBatch:
        """A copy of this batch with the tensors of ``new`` (named as in :meth:`tensors`) swapped in."""
        top = {k: v for k, v in new.items() if "." not in k}
        comps = {}
        for key, meta in self.compressors.items():
            prefix = f"{key[0]}.{int(key[1])}."
            fields = {k[len(prefix):]: v for k, v in new.items() if k.startswith(prefix)}
            comps[key] = CompressorMeta(**{**vars(meta), **fields})
        return ForwardBatch(**{**vars(self), **top, "compressors": comps, "storage": None})

    def packed(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """Every index tensor flattened into one int64 tensor (the order of :meth:`tensors`)."""
        if self.storage is not None:
            return self.storage if out is None else out.copy_(self.storage)
        return torch.cat([t.reshape(-1) for t in self.tensors().values()], out=out)

    def with_storage(self, flat: torch.Tensor) -> ForwardBatch:
        """A copy whose tensors are views into ``flat``, laid out as :meth:`packed` lays them out."""
        views, offset = {}, 0
        for name, t in self.tensors().items():
            views[name] = flat[offset:offset + t.numel()].view(t.shape)
            offset += t.numel()
        batch = self.replace_tensors(views)
        if offset == flat.numel():
            batch.storage = flat
        return batch

    def to(self, device: torch.device | str) -> ForwardBatch:
        batch = self.replace_tensors({k: v.to(device) for k, v in self.tensors().items()})
        if self.mm is not None:
            batch.mm = self.mm.to(device)
        return batch


def compressed_candidates(batch: ForwardBatch, rate: int, block_size: int,
                          tokens: slice = slice(None)) -> torch.Tensor:
    """[T, E] compressed-pool rows each query may attend, on the batch's device (E =
    ``batch.entry_widths[rate]``): entry e of the query's own sequence for every e < (position + 1) // rate,
    in entry order, then -1. Derived from the block tables, so no tensor of this size crosses from the host.
    ``tokens``: only those queries' rows (a long prefill chunk's lists are built a slice at a time)."""
    tables, width = batch.block_tables, batch.entry_widths[rate]
    entry = torch.arange(width, device=tables.device)
    blocks = (entry * rate // block_size).clamp(max=tables.shape[1] - 1)
    rows = tables[batch.token_seq[tokens].unsqueeze(1), blocks.unsqueeze(0)]  # [T, E] physical blocks
    unused = (rows < 0) | (entry >= ((batch.positions[tokens] + 1) // rate).unsqueeze(1))
    per_block = block_size // rate
    return rows.mul_(per_block).add_(entry % per_block).masked_fill_(unused, -1)  # one [T, E] index tensor


def _ragged(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For per-sequence counts: (sequence of each item, index of the item within its sequence). In numpy:
    torch's CPU ``repeat_interleave`` starts its thread pool for every call (milliseconds on a many-core
    host)."""
    n = counts.numpy()
    owner = np.repeat(np.arange(len(n)), n)
    first = np.cumsum(n) - n
    return torch.from_numpy(owner), torch.from_numpy(np.arange(len(owner)) - first[owner])


def _rows(tables: torch.Tensor, owner: torch.Tensor, positions: torch.Tensor, block_size: int,
          rate: int = 1, first: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`_pool_rows` on the host batch's torch tensors."""
    return torch.from_numpy(_pool_rows(tables.numpy(), owner.numpy(), positions.numpy(), block_size, rate,
                                     None if first is None else first.numpy()))


def _table(rows: list[list[int]]) -> torch.Tensor:
    """[len(rows), longest] int64, -1 padded (through numpy: a nested list is 8x slower into torch)."""
    out = np.full((len(rows), max([len(r) for r in rows] + [1])), -1, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return torch.from_numpy(out)


def _window_table(spans: list[SeqSpan], sliding_window: int, block_size: int,
                  extra: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The window pool's block tables from the first block the step's windows reach (the ones before it are
    released or not read), and that logical block per sequence; ``extra`` empty rows after them."""
    first = [max(0, s.context_len - sliding_window + 1) // block_size for s in spans] + [0] * extra
    table = _table([s.window_block_table[f:] for s, f in zip(spans, first)] + [[]] * extra)
    return table, torch.tensor(first, dtype=torch.long)


@dataclass
class _Layout:
    """The batch's per-sequence facts on the host (torch tensors; numpy arrays for the padded layout)."""

    ctx: torch.Tensor
    seq_len: torch.Tensor
    starts: torch.Tensor
    slots: torch.Tensor
    write_from: torch.Tensor
    tables: torch.Tensor
    owner: torch.Tensor  # [T] sequence of each token
    positions: torch.Tensor  # [T]


def build_forward_batch(
    token_ids: list[int],
    spans: list[SeqSpan],
    compressor_specs: set[CompressorSpec],
    block_size: int,
    sliding_window: int,
    logits_indices: list[int] | None = None,
    device: torch.device | str = "cpu",
    pad: GraphPadding | None = None,
    ngram: int = 0,
) -> ForwardBatch:
    """Flatten ``spans`` into one batch; ``token_ids`` holds every span's new tokens in order.

    With ``pad`` (decode steps only) every index tensor has the graph's fixed shape: padding sequences
    write to the trash (-1) and read nothing. ``ngram`` > 0 (an n-gram model): every span carries its
    ``history`` (the ``min(ngram - 1, context_len)`` tokens before its new ones) and the batch each
    token's n-gram (:meth:`ForwardBatch.ngram_ids`).
    """
    if pad is not None:
        if ngram != pad.ngram:
            raise ValueError(f"a padded batch of an {ngram}-gram model needs a layout of {ngram}-gram histories "
                             f"(GraphPadding.ngram is {pad.ngram})")
        if any(max(0, s.context_len - sliding_window + 1) < s.replay_from for s in spans):
            raise ValueError("a bounded-replay prefill runs eagerly: a padded (graph) batch cannot cut its "
                             "late layers to the tail")
        return _build_padded(token_ids, spans, compressor_specs, block_size, sliding_window, device, pad)
    lo = torch.long
    num_new = torch.tensor([s.num_new for s in spans], dtype=lo)
    starts = [0, *torch.cumsum(num_new, 0).tolist()]
    if starts[-1] != len(token_ids):
        raise ValueError(f"spans cover {starts[-1]} tokens but {len(token_ids)} token ids were given")
    ctx = torch.tensor([s.context_len for s in spans], dtype=lo)
    owner, offset = _ragged(num_new)
    lay = _Layout(ctx, ctx + num_new, torch.tensor(starts[:-1], dtype=lo),
                  torch.tensor([s.state_slot for s in spans], dtype=lo),
                  torch.tensor([s.write_from for s in spans], dtype=lo),
                  _table([s.block_table for s in spans]), owner, ctx[owner] + offset)
    wtables, wfirst = _window_table(spans, sliding_window, block_size)
    batch = ForwardBatch(
        input_ids=torch.tensor(token_ids, dtype=lo),
        positions=lay.positions,
        window_slots=_rows(wtables, owner, lay.positions, block_size, first=wfirst),
        window_indices=None,
        window_tables=wtables,
        window_first=wfirst,
        window_layout=(sliding_window, block_size),
        logits_indices=torch.tensor(
            logits_indices if logits_indices is not None else [e - 1 for e in starts[1:]], dtype=lo
        ),
        query_start_loc=starts,
        block_tables=lay.tables,
        token_seq=owner,
    )
    longest = int(lay.seq_len.max()) if len(spans) else 0
    for rate, overlap in {(spec.rate, spec.overlap) for spec in compressor_specs}:
        batch.compressors[rate, overlap] = _compressor_meta(rate, overlap, lay, block_size)
        batch.entry_widths[rate] = longest // rate
    if ngram:
        batch.ngram_tokens, batch.ngram_index = _ngram_index(spans, starts, ngram)
    floor = torch.tensor([s.replay_from for s in spans], dtype=lo)
    if bool(((lay.ctx - sliding_window + 1).clamp(min=0) < floor).any()):  # some late-layer query or key is cut off
        batch.replay_floor = floor[owner]
        batch.replay_rows = torch.nonzero(lay.positions >= batch.replay_floor).view(-1)
    return batch.to(device)


def _ngram_index(spans: list[SeqSpan], starts: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(history tokens, [T, n] rows of cat(input_ids, history tokens, [BEFORE_START, DEAD]))."""
    tokens: list[int] = []
    rows: list[list[tuple[str, int]]] = []
    for span, first in zip(spans, starts):
        history = list(span.history or [])
        want = min(n - 1, span.context_len)
        if len(history) != want:
            raise ValueError(f"a span at position {span.context_len} carries {len(history)} history tokens; an "
                             f"{n}-gram model needs the {want} before it")
        base = len(tokens)
        tokens.extend(history)
        for j in range(span.num_new):
            row = []
            for shift in range(n):
                k = j - shift  # this step's token k of the span, or the history's position context_len + k
                if k >= 0:
                    row.append(("new", first + k))
                elif span.context_len + k < 0:
                    row.append(("before", 0))
                else:
                    row.append(("history", base + len(history) + k))
            rows.append(row)
    total, held = (starts[-1] if starts else 0), len(tokens)

    def resolve(kind: str, i: int) -> int:
        if kind == "new":
            return i
        if kind == "before":
            return total + held
        return total + held + 1 if tokens[i] == DEAD else total + i

    index = torch.tensor([[resolve(*e) for e in row] for row in rows], dtype=torch.long).view(-1, n)
    return torch.tensor(tokens, dtype=torch.long).clamp(min=0), index


def _compressor_meta(rate: int, overlap: bool, lay: _Layout, block_size: int) -> CompressorMeta:
    rows = ring_rows(rate, overlap)
    within = torch.arange(rate)
    # ring rows read this step: each sequence's last ``rows`` cached positions
    first_read = (lay.ctx - rows).clamp(min=0)
    read_owner, read_idx = _ragged(lay.ctx - first_read)
    ring_read = lay.slots[read_owner] * rows + (first_read[read_owner] + read_idx) % rows
    read_base = torch.cumsum(lay.ctx - first_read, 0) - (lay.ctx - first_read)
    fresh_base, dummy = len(ring_read), len(ring_read) + len(lay.positions)

    def source(seq: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """Index into cat(ring[ring_read], fresh rows, dummy row) of position ``p`` of sequence ``seq``."""
        seq = seq.view(-1, *([1] * (p.dim() - 1))).expand_as(p)
        fresh = fresh_base + lay.starts[seq] + p - lay.ctx[seq]
        old = read_base[seq] + p - first_read[seq]
        return torch.where(p >= lay.ctx[seq], fresh, torch.where(p >= 0, old, torch.full_like(p, dummy)))

    # windows closing this step
    first_win = lay.ctx // rate
    win_owner, win_idx = _ragged(lay.seq_len // rate - first_win)
    windows = first_win[win_owner] + win_idx
    starts = windows * rate
    slots = _rows(lay.tables, win_owner, starts, block_size, rate)
    slots = torch.where(starts >= lay.write_from[win_owner], slots, torch.full_like(slots, -1))
    cur = source(win_owner, starts.unsqueeze(1) + within)
    prev = source(win_owner, starts.unsqueeze(1) - rate + within) if overlap else None
    # block ends crossed this step (boundary records, overlapping windows only)
    if overlap:
        lowest = torch.maximum(lay.ctx, lay.write_from) // block_size
        end_owner, end_idx = _ragged((lay.seq_len // block_size - lowest).clamp(min=0))
        ends = (lowest[end_owner] + end_idx + 1) * block_size
        boundary_src = source(end_owner, ends.unsqueeze(1) - rate + within)
        boundary_dst = lay.tables[end_owner, ends // block_size - 1]
    else:
        boundary_src, boundary_dst = torch.zeros(0, rate, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    # ring rows written: each sequence's last ``rows`` positions among this step's tokens
    keep = lay.positions >= lay.seq_len[lay.owner] - rows
    token_idx = torch.arange(len(lay.positions))
    return CompressorMeta(
        ring_read=ring_read,
        cur_idx=cur,
        prev_idx=prev,
        entry_slots=slots,
        entry_positions=starts,
        ring_write=lay.slots[lay.owner[keep]] * rows + lay.positions[keep] % rows,
        ring_write_src=token_idx[keep],
        bias_idx=lay.positions % rate,
        boundary_src=boundary_src,
        boundary_dst=boundary_dst,
    )


def _build_padded(token_ids: list[int], spans: list[SeqSpan], compressor_specs: set[CompressorSpec],
                  block_size: int, sliding_window: int, device, pad: GraphPadding) -> ForwardBatch:
    """``q = pad.query_len`` new tokens per sequence and a fixed count of every kind of index per sequence:
    ``rows`` ring reads, ``q`` ring writes, the windows and block ends ``q`` tokens can close (each written
    to -1 unless it closes now), a block table of ``pad.num_blocks`` columns (``max_entries`` candidates
    are derived from it on the device). Padding sequences have no blocks and state slot -1, so all they
    write lands in the trash. Every token's logits are computed, real sequences' first. Built in numpy:
    every graph step pays this on the host, and numpy's small-array ops cost a fraction of torch's.
    """
    n, size, q = len(spans), pad.num_seqs, pad.query_len
    if n > size or any(s.num_new != q for s in spans) or len(token_ids) != n * q:
        raise ValueError(f"a graph of {size} sequences runs steps of at most {size} sequences, "
                         f"{q} new token(s) each")
    _check_padded(spans, compressor_specs, pad, 0)
    facts = PaddedFacts.from_spans(spans, token_ids, pad, block_size, sliding_window)
    arrays, metas = _padded_arrays(_Xp(), facts, compressor_specs, q, block_size, sliding_window)
    batch = _packed_batch(arrays, metas,
                          query_start_loc=list(range(0, n * q + 1, q)),  # the real sequences' logits come first
                          padded_to=size, padded_context=pad.context,
                          entry_widths={rate: pad.max_entries[rate] for rate, _ in metas})
    return batch if torch.device(device).type == "cpu" else batch.to(device)


def _check_padded(spans: list[SeqSpan], compressor_specs: set[CompressorSpec], pad: GraphPadding, shift: int) -> None:
    """Raise unless ``pad`` holds ``spans`` moved on by up to ``shift`` positions."""
    q = pad.query_len
    for spec in compressor_specs:
        if q > ring_rows(spec.rate, spec.overlap):
            raise ValueError(f"{q} new tokens per sequence overrun the {spec.rate}-rate compressor's ring")
    longest = max([s.context_len + shift + q for s in spans] + [0])
    for rate, entries in pad.max_entries.items():
        if longest // rate > entries:
            raise ValueError(f"a sequence of {longest} tokens attends {longest // rate} entries of rate {rate}; "
                             f"this graph layout holds {entries}")


@dataclass
class PaddedFacts:
    """What a padded layout is derived from, per sequence of ``size`` (padding ones last): the tokens
    cached before the step, its new tokens, block tables (the window pool's from logical block ``wfirst``)
    and state slot. numpy arrays on the host; torch tensors (:meth:`views`) on a device, where the layout
    is derived by :func:`derive_padded`."""

    ctx: np.ndarray | torch.Tensor  # [S]
    input_ids: np.ndarray | torch.Tensor  # [S * q]
    tables: np.ndarray | torch.Tensor  # [S, B]
    wtables: np.ndarray | torch.Tensor  # [S, Bw]
    wfirst: np.ndarray | torch.Tensor  # [S]
    slots: np.ndarray | torch.Tensor  # [S]
    write_from: np.ndarray | torch.Tensor  # [S]
    # n-gram layouts only: the ids at positions ctx - n + 1 .. ctx - 1 (BEFORE_START before the sequence,
    # DEAD at image tokens), the values themselves, so that the index into them is fixed per layout
    history: np.ndarray | torch.Tensor | None = None  # [S, n - 1]

    @classmethod
    def from_spans(cls, spans: list[SeqSpan], token_ids: list[int], pad: GraphPadding, block_size: int,
                   sliding_window: int, window_blocks: int | None = None) -> PaddedFacts:
        """The facts of ``spans`` laid out for ``pad``; ``window_blocks``: a window table of that many columns
        (else as many as the longest row needs)."""
        extra = pad.num_seqs - len(spans)
        width = pad.num_blocks(block_size)  # blocks past the candidates' reach are not needed on the device
        tables = np.full((pad.num_seqs, width), -1, dtype=np.int64)
        for i, s in enumerate(spans):
            row = s.block_table[:width]
            tables[i, :len(row)] = row
        wfirst = [max(0, s.context_len - sliding_window + 1) // block_size for s in spans]
        rows = [s.window_block_table[f:] for s, f in zip(spans, wfirst)] + [[]] * extra
        if window_blocks is None:
            wtables = _table(rows).numpy()
        else:
            wtables = np.full((pad.num_seqs, window_blocks), -1, dtype=np.int64)
            for i, row in enumerate(rows):
                wtables[i, :min(len(row), window_blocks)] = row[:window_blocks]

        def per_seq(values: list[int], fill: int) -> np.ndarray:
            return np.array(values + [fill] * extra, dtype=np.int64)

        ids = np.array(list(token_ids) + [0] * (extra * pad.query_len), dtype=np.int64)
        history = None
        if pad.ngram:
            history = np.full((pad.num_seqs, pad.ngram - 1), BEFORE_START, dtype=np.int64)
            for i, s in enumerate(spans):
                want = min(pad.ngram - 1, s.context_len)
                if len(s.history or []) != want:
                    raise ValueError(f"a span at position {s.context_len} carries {len(s.history or [])} history "
                                     f"tokens; an {pad.ngram}-gram model needs the {want} before it")
                if want:
                    history[i, pad.ngram - 1 - want:] = s.history
        return cls(per_seq([s.context_len for s in spans], 0), ids, tables, wtables, per_seq(wfirst, 0),
                   per_seq([s.state_slot for s in spans], -1), per_seq([s.write_from for s in spans], 0), history)

    def packed(self, *more: np.ndarray) -> torch.Tensor:
        """Every array flattened into one int64 tensor (field order), then ``more``'s."""
        arrays = [getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None] + list(more)
        return torch.from_numpy(np.concatenate([a.reshape(-1) for a in arrays]))

    def views(self, flat: torch.Tensor) -> PaddedFacts:
        """These facts' shapes as views of ``flat`` (laid out as :meth:`packed` lays them out)."""
        parts, offset = {}, 0
        for f in fields(self):
            if getattr(self, f.name) is None:
                parts[f.name] = None
                continue
            shape = getattr(self, f.name).shape
            n = int(np.prod(shape))
            parts[f.name] = flat[offset:offset + n].view(shape)
            offset += n
        return PaddedFacts(**parts)


class _Xp:
    """The array calls of :func:`_padded_arrays` that numpy (``device`` None) and torch spell differently."""

    def __init__(self, device: torch.device | None = None):
        self.device = device

    def arange(self, n: int):
        return np.arange(n) if self.device is None else torch.arange(n, device=self.device)

    def repeat(self, x, n: int):
        return np.repeat(x, n) if self.device is None else torch.repeat_interleave(x, n)

    def clip(self, x, lo=None, hi=None):
        return np.clip(x, lo, hi) if self.device is None else torch.clamp(x, lo, hi)

    def maximum(self, a, b):
        return np.maximum(a, b) if self.device is None else torch.maximum(a, b)

    def where(self, cond, a, b):
        return np.where(cond, a, b) if self.device is None else torch.where(cond, a, b)

    def zeros(self, *shape: int):
        if self.device is None:
            return np.zeros(shape, dtype=np.int64)
        return torch.zeros(shape, dtype=torch.long, device=self.device)


def _padded_arrays(xp: _Xp, f: PaddedFacts, compressor_specs: set[CompressorSpec], q: int, block_size: int,
                   sliding_window: int) -> tuple[dict, dict]:
    """The padded layout's top-level arrays and compressor fields (by :class:`CompressorMeta` field) from
    ``f``, in numpy or torch (``xp``)."""
    size = f.ctx.shape[0]
    seq = xp.arange(size)
    owner = xp.repeat(seq, q)
    positions = f.ctx[owner] + xp.arange(size * q) % q
    lay = _Layout(f.ctx, f.ctx + q, seq * q, f.slots, f.write_from, f.tables, owner, positions)
    window = positions[:, None] + xp.arange(sliding_window)[None, :] - (sliding_window - 1)
    arrays = {
        "input_ids": f.input_ids,
        "positions": positions,
        "window_slots": _pool_rows(f.wtables, owner, positions, block_size, first=f.wfirst, xp=xp),
        "window_indices": _pool_rows(f.wtables, owner, window, block_size, first=f.wfirst, xp=xp),
        "logits_indices": xp.arange(size * q),
        "block_tables": f.tables,
        "token_seq": owner,
    }
    if f.history is not None:  # column s of token j: this step's token j - s, else history slot n - 1 + j - s
        n = f.history.shape[1] + 1
        back = xp.arange(q)[:, None] - xp.arange(n)[None, :]  # [q, n]
        new = (seq * q)[:, None, None] + back[None]
        old = size * q + (seq * (n - 1))[:, None, None] + (n - 1) + back[None]
        arrays["ngram_tokens"] = f.history.reshape(-1)
        arrays["ngram_index"] = xp.where(back[None] >= 0, new, old).reshape(size * q, n)
    metas = {key: _padded_compressor_meta(*key, lay, block_size, xp)
             for key in sorted({(spec.rate, spec.overlap) for spec in compressor_specs})}
    return arrays, metas


def derive_padded(static: ForwardBatch, facts: PaddedFacts, compressor_specs: set[CompressorSpec],
                  block_size: int, sliding_window: int) -> None:
    """Lay out ``facts`` (device tensors) into ``static``'s packed buffer on the device, as
    :func:`build_forward_batch` with a padding would on the host: the host need not know ``facts.ctx``
    or ``facts.input_ids`` (a step launched before the one before it ends)."""
    q = facts.input_ids.shape[0] // facts.ctx.shape[0]
    arrays, metas = _padded_arrays(_Xp(facts.ctx.device), facts, compressor_specs, q, block_size, sliding_window)
    torch.cat([p.reshape(-1) for p in _flat_parts(arrays, metas)], out=static.storage)


def _flat_parts(top: dict, metas: dict) -> list:
    """The arrays of a padded layout in the order of :meth:`ForwardBatch.packed`."""
    parts = [top[k] for k in _TOP_FIELDS if top.get(k) is not None]
    for key in sorted(metas):
        parts += [v for v in (metas[key][f] for f in _META_FIELDS) if v is not None]
    return parts


def _packed_batch(top: dict[str, np.ndarray], metas: dict[tuple[int, bool], dict[str, np.ndarray | None]],
                  **rest) -> ForwardBatch:
    """A batch of the arrays ``top`` and ``metas`` (by :class:`CompressorMeta` field) copied once into one
    int64 buffer, ``storage``: its tensors are views of it laid out as :meth:`ForwardBatch.packed` lays
    them out, so packing and loading it are single copies."""
    parts = _flat_parts(top, metas)
    storage = torch.from_numpy(np.concatenate([p.reshape(-1) for p in parts]).astype(np.int64, copy=False))
    views = iter([v if p.ndim == 1 else v.view(p.shape) for v, p in zip(storage.split([p.size for p in parts]), parts)])
    tensors = {k: next(views) if top.get(k) is not None else None for k in _TOP_FIELDS}
    comps = {key: CompressorMeta(**{f: None if metas[key][f] is None else next(views) for f in _META_FIELDS})
             for key in sorted(metas)}
    return ForwardBatch(**tensors, compressors=comps, storage=storage, **rest)


def _pool_rows(tables: np.ndarray, owner: np.ndarray, positions: np.ndarray, block_size: int, rate: int = 1,
             first: np.ndarray | None = None, xp: _Xp | None = None) -> np.ndarray:
    """Pool row of source ``positions`` of sequence ``owner`` (or of the entry whose window starts there);
    -1 where the position is negative or its block is not resident (or past the table). With ``first``,
    column 0 of a sequence's table is its logical block ``first[seq]``. numpy arrays, or torch tensors
    with ``xp``."""
    xp = xp or _Xp()
    per_block = block_size // rate
    owner = owner.reshape(-1, *([1] * (positions.ndim - 1)))  # broadcast against positions by the indexing
    blocks = positions // block_size
    if first is not None:
        blocks = blocks - first[owner]
    width = tables.shape[1]
    phys = tables[owner, xp.clip(blocks, 0, width - 1)]
    rows = phys * per_block + (positions // rate) % per_block
    return xp.where((positions >= 0) & (blocks >= 0) & (blocks < width) & (phys >= 0), rows, -1)


def _padded_compressor_meta(rate: int, overlap: bool, lay: _Layout, block_size: int, xp: _Xp) -> dict:
    """The fields of the padded layout's :class:`CompressorMeta` (numpy or torch, as ``lay`` holds)."""
    size = lay.ctx.shape[0]
    q = lay.positions.shape[0] // size
    rows = ring_rows(rate, overlap)
    within, seq = xp.arange(rate), xp.arange(size)
    read_pos = lay.ctx[:, None] - rows + xp.arange(rows)  # [S, rows]; negative ones are never used
    dummy = size * rows + size * q

    def source(s, p):
        """Index into cat(ring[ring_read], fresh rows, dummy row) of position ``p`` of sequence ``s``; a
        position past the step's tokens reads the sequence's last one (only windows that do not close)."""
        ctx = lay.ctx[s][:, None]
        old = s[:, None] * rows + p - ctx + rows
        fresh = size * rows + s[:, None] * q + xp.clip(p - ctx, None, q - 1)
        return xp.where(p >= ctx, fresh, xp.where(p >= 0, old, dummy))

    # the windows q tokens can close: the last ``per_seq`` ending at or before the sequence's end
    per_seq = (q - 1) // rate + 1
    wseq = xp.repeat(seq, per_seq)
    win = (lay.seq_len // rate)[wseq] - per_seq + xp.arange(size * per_seq) % per_seq
    closes = ((win + 1) * rate > lay.ctx[wseq]) & (win >= 0) & (win * rate >= lay.write_from[wseq])
    start = xp.where(closes, win * rate, xp.clip(lay.seq_len[wseq] - rate, 0))
    slots = _pool_rows(lay.tables, wseq, start, block_size, rate, xp=xp)
    meta = {
        "ring_read": (lay.slots[:, None] * rows + read_pos % rows).reshape(-1),
        "cur_idx": source(wseq, start[:, None] + within),
        "prev_idx": source(wseq, start[:, None] - rate + within) if overlap else None,
        "entry_slots": xp.where(closes, slots, -1),
        "entry_positions": start,
        "ring_write": lay.slots[lay.owner] * rows + lay.positions % rows,
        "ring_write_src": xp.arange(size * q),
        "bias_idx": lay.positions % rate,
        "boundary_src": xp.zeros(0, rate),
        "boundary_dst": xp.zeros(0),
    }
    if overlap:  # the block ends q tokens can cross
        per_seq = (q - 1) // block_size + 1
        bseq = xp.repeat(seq, per_seq)
        ends = ((lay.seq_len // block_size)[bseq] - per_seq + 1 + xp.arange(size * per_seq) % per_seq) * block_size
        crossed = (ends > xp.maximum(lay.ctx, lay.write_from)[bseq]) & (ends > 0)
        ends = xp.where(crossed, ends, lay.seq_len[bseq])
        dst = lay.tables[bseq, xp.clip(ends // block_size - 1, 0, lay.tables.shape[1] - 1)]
        meta["boundary_src"] = source(bseq, ends[:, None] - rate + within)
        meta["boundary_dst"] = xp.where(crossed, dst, -1)
    return meta

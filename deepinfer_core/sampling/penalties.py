"""PenaltyTable: the penalised sequences' prompt masks and output-token counts on the device, one row each.

Row 0 stays empty: it stands for every sequence without penalties. A step's rows are then one gather, and
its new outputs one scatter, however many sequences it has (a tensor per sequence cost a copy each per
step, which on a GPU is a launch each, paced by the host).
"""

from __future__ import annotations

from typing import Any

import torch


class PenaltyTable:
    def __init__(self, vocab_size: int, device: torch.device, capacity: int = 8):
        self.vocab_size, self.device = vocab_size, device
        self.prompt_mask = torch.zeros((capacity, vocab_size), dtype=torch.bool, device=device)
        self.counts = torch.zeros((capacity, vocab_size), dtype=torch.long, device=device)
        self.rows: dict[int, int] = {}  # seq_id -> row
        self.num_counted: dict[int, int] = {}  # seq_id -> outputs the row's counts hold
        self._free = list(range(capacity - 1, 0, -1))

    def row(self, seq: Any) -> int:
        """``seq``'s row (0 where it has no penalties), its prompt mask written when it first comes."""
        if not seq.params.has_penalties:
            return 0
        row = self.rows.get(seq.seq_id)
        if row is None:
            if not self._free:
                self._grow()
            row = self.rows[seq.seq_id] = self._free.pop()
            self.num_counted[seq.seq_id] = 0
            ids = torch.tensor(seq.prompt_token_ids, dtype=torch.long).to(self.device, non_blocking=True)
            self.prompt_mask[row].zero_().index_fill_(0, ids, True)
            self.counts[row].zero_()
        return row

    def free(self, seq_id: int) -> None:
        row = self.rows.pop(seq_id, None)
        self.num_counted.pop(seq_id, None)
        if row is not None:
            self._free.append(row)

    def gather(self, seqs: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt masks and output counts of ``seqs`` ([len(seqs), vocab]), the counts first brought
        up to date with the outputs the host has and the device has not counted (one copy, one scatter)."""
        rows = [self.row(seq) for seq in seqs]
        new_rows, new_ids = [], []
        for seq, row in zip(seqs, rows):
            if row:
                new = seq.output_token_ids[self.num_counted[seq.seq_id]:]
                new_rows += [row] * len(new)
                new_ids += new
                self.num_counted[seq.seq_id] += len(new)
        packed = torch.tensor([rows + new_rows, [0] * len(rows) + new_ids], dtype=torch.long)
        packed = packed.to(self.device, non_blocking=True)
        index = packed[0, : len(rows)]
        if new_rows:
            self.add(packed[0, len(rows):], packed[1, len(rows):].unsqueeze(1))
        return self.prompt_mask.index_select(0, index), self.counts.index_select(0, index)

    def add(self, rows: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """Count ``ids`` ([n, q], device) into ``rows`` ([n], device), each by ``weights`` (default 1)."""
        flat = (rows.unsqueeze(1) * self.vocab_size + ids).reshape(-1)
        weights = torch.ones_like(flat) if weights is None else weights.reshape(-1)
        self.counts.view(-1).scatter_add_(0, flat, weights)

    def mark_counted(self, seq_id: int, n: int) -> None:
        """The sequence's last ``n`` outputs, now on the host, were already counted on the device."""
        if seq_id in self.num_counted:
            self.num_counted[seq_id] += n

    def _grow(self) -> None:
        capacity = self.counts.shape[0]
        self.prompt_mask = torch.cat([self.prompt_mask, torch.zeros_like(self.prompt_mask)])
        self.counts = torch.cat([self.counts, torch.zeros_like(self.counts)])
        self._free = list(range(2 * capacity - 1, capacity - 1, -1))

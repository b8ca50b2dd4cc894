"""Lay routed (token, expert) pairs out as expert tiles on the device, for the grouped expert GEMMs.

:func:`plan` sorts the pairs by expert and gives each expert ``ceil(count / block_m)`` tiles of
``block_m`` rows, in a table sized by an upper bound known from the shapes alone
(``ceil(P / block_m) + min(E, P)`` tiles for ``P`` pairs), so nothing is read back to the host and the
whole MoE layer can sit inside an ACL graph. Unused tiles have expert ``-1`` (the kernels skip them);
padding rows point at a zero row and add into a dropped output row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TilePlan:
    tile_expert: torch.Tensor  # int32 [tiles]: the expert of each tile, -1 unused
    row_pair: torch.Tensor  # long [tiles * block_m]: the flat (token, slot) pair of each row, P padding
    tokens: int
    pairs: int
    top_k: int

    @property
    def rows(self) -> int:
        return self.row_pair.numel()

    @property
    def row_token(self) -> torch.Tensor:
        """long [rows]: each row's token, ``tokens`` (one past the last) for padding rows."""
        return torch.where(self.row_pair < self.pairs, self.row_pair // self.top_k, self.tokens)


def max_tiles(pairs: int, experts: int, block_m: int) -> int:
    return -(-pairs // block_m) + min(experts, pairs)


def plan(topk_ids: torch.Tensor, experts: int, block_m: int) -> TilePlan:
    """Tiles for ``topk_ids [T, k]`` over ``experts`` local experts (ids outside ``[0, experts)``
    skipped, as the native bodies skip them)."""
    t, k = topk_ids.shape
    pairs, device = t * k, topk_ids.device
    ids = topk_ids.reshape(-1)
    key = torch.where((ids >= 0) & (ids < experts), ids, experts)  # skipped pairs last, in a bin of their own
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(experts + 1, dtype=torch.long, device=device).scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:experts]
    tiles_of = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles_of, 0)
    n_tiles = max_tiles(pairs, experts, block_m)
    tile_expert = torch.searchsorted(tile_end, torch.arange(n_tiles, device=device), right=True)
    tile_expert = torch.where(tile_expert < experts, tile_expert, -1).to(torch.int32)

    sorted_key = key[order]
    expert = sorted_key.clamp(max=max(experts - 1, 0))
    rank = torch.arange(pairs, device=device) - (torch.cumsum(counts, 0) - counts)[expert]
    rows = n_tiles * block_m
    row = torch.where(sorted_key < experts, (tile_end - tiles_of)[expert] * block_m + rank, rows)
    row_pair = torch.full((rows + 1,), pairs, dtype=torch.long, device=device)
    row_pair.scatter_(0, row, order)
    return TilePlan(tile_expert, row_pair[:rows], t, pairs, k)


def gather_rows(x: torch.Tensor, p: TilePlan) -> torch.Tensor:
    """``x [T, D]`` -> ``[rows, D]``: each row its token's activations, padding rows zero."""
    padded = torch.cat([x, x.new_zeros(1, x.shape[-1])])
    return padded[p.row_token].contiguous()


def row_weights(topk_weights: torch.Tensor, p: TilePlan) -> torch.Tensor:
    """``[rows]``: each row's routing weight, padding rows zero."""
    flat = topk_weights.reshape(-1)
    return torch.cat([flat, flat.new_zeros(1)])[p.row_pair]


def combine(y: torch.Tensor, p: TilePlan, dtype: torch.dtype) -> torch.Tensor:
    """Sum the rows ``y [rows, D]`` into their tokens in float32 -> ``[T, D]`` in ``dtype``."""
    out = torch.zeros(p.tokens + 1, y.shape[-1], dtype=torch.float32, device=y.device)
    out.index_add_(0, p.row_token, y.float())
    return out[: p.tokens].to(dtype)

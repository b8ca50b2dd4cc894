"""Drive the engine's model without the engine: contiguous blocks per sequence, for golden tests."""

from __future__ import annotations

import dataclasses

import torch

from deepinfer_core.model.cache import ModelCache
from deepinfer_core.model.kv_cache_spec import KVCacheSpec
from deepinfer_core.model.metadata import SeqSpan, build_forward_batch
from deepinfer_core.models.interface import Model


class SimpleRunner:
    """Each sequence owns ``max_blocks`` consecutive blocks and one state slot; nothing is freed."""

    def __init__(self, model: Model, num_seqs: int, max_len: int, block_size: int = 16,
                 fill: float = float("nan"), kv_layout: str | None = None):
        self.model, self.block_size = model, block_size
        self.max_blocks = -(-max_len // block_size)
        spec = KVCacheSpec.default(model.cfg, block_size, model.dtype, model.numerics)
        if kv_layout is not None:  # another entry layout than the numerics store by default
            spec = dataclasses.replace(spec, layout=kv_layout)
        self.cache = ModelCache(
            model.cfg, num_seqs * self.max_blocks, num_seqs * self.max_blocks, num_seqs, block_size,
            model.dtype, model.device, fill=fill, spec=spec,
        )
        self.lens = [0] * num_seqs
        self.tokens: list[list[int]] = [[] for _ in range(num_seqs)]  # what each sequence has been fed
        self.ngram = getattr(model, "ngram_size", 0)

    def table(self, seq: int) -> list[int]:
        return list(range(seq * self.max_blocks, (seq + 1) * self.max_blocks))

    def step(self, chunks: dict[int, list[int]], all_logits: bool = False,
             replay_from: dict[int, int] | None = None) -> dict[int, torch.Tensor]:
        """Feed ``chunks[seq]`` new tokens to each listed sequence; return logits per sequence.
        ``replay_from[seq]``: the sequence's bounded-replay floor (:mod:`deepinfer_core.model.replay`)."""
        return self.forward(chunks, all_logits, replay_from)[0]

    def forward(self, chunks: dict[int, list[int]], all_logits: bool = False,
                replay_from: dict[int, int] | None = None):
        """:meth:`step`'s logits per sequence, and the step's batch and the model's output streams [T, n, D]
        (what the MTP block reads)."""
        spans, ids, rows, owners = [], [], [], []
        for seq, toks in chunks.items():
            history = self.tokens[seq][max(0, self.lens[seq] - self.ngram + 1):] if self.ngram else None
            spans.append(SeqSpan(self.lens[seq], len(toks), self.table(seq), self.table(seq), seq, history=history,
                                 replay_from=(replay_from or {}).get(seq, 0)))
            start = len(ids)
            ids.extend(toks)
            rows.extend(range(start, len(ids)) if all_logits else [len(ids) - 1])
            owners.extend([seq] * (len(toks) if all_logits else 1))
        batch = build_forward_batch(
            ids, spans, self.model.compressor_specs(), self.block_size, self.model.cfg.sliding_window,
            logits_indices=rows, device=self.model.device, ngram=self.ngram,
        )
        logits, streams = self.model.forward(batch, self.cache)
        for seq, toks in chunks.items():
            self.lens[seq] += len(toks)
            self.tokens[seq].extend(toks)
        out: dict[int, list[torch.Tensor]] = {}
        for owner, row in zip(owners, logits):
            out.setdefault(owner, []).append(row)
        return {seq: torch.stack(v) for seq, v in out.items()}, batch, streams

"""Turns the last-position logits of a batch into next tokens (and logprobs) through backend ops.

Random sampling is an exponential race (``random_sample``) whose Exp(1) noise is counter-based: the
noise of a sequence's output position ``p`` comes from a generator seeded with
``noise_seed(base, p)``, where ``base`` is the sequence's seed (the engine derives it from the
request's ``seed`` and the sample index, or draws it from the engine seed for unseeded requests).
Nothing carries over from one step to the next, so the draw at a position is the same whatever the
batch, the number of earlier sampling calls, preemption and recomputation, or an engine restart.
"""

from __future__ import annotations

import torch

from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.ops import OpTable

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def noise_seed(base_seed: int, position: int) -> int:
    """The 64-bit generator seed of the sampling noise at output ``position`` of a sequence."""
    return _splitmix64(_splitmix64(base_seed & _MASK64) ^ position)


def sampling_noise(seq: Sequence, vocab_size: int) -> torch.Tensor:
    """Exp(1) noise [V] (float64) for ``seq``'s next output position."""
    base = seq.generator.initial_seed() if seq.generator is not None else 0
    gen = torch.Generator().manual_seed(noise_seed(base, len(seq.output_token_ids)))
    return torch.empty(vocab_size, dtype=torch.float64).exponential_(generator=gen)


class Sampler:
    def __init__(self, ops: OpTable, vocab_size: int, eos_token_ids: list[int], structured=None):
        self.ops, self.vocab_size, self.eos = ops, vocab_size, eos_token_ids
        self.structured = structured  # a StructuredOutputManager (only needed for grammar rows)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[dict[int, float] | None]]:
        ops, device = self.ops, logits.device
        grammars = [getattr(s, "grammar", None) for s in seqs]
        if any(g is not None for g in grammars):
            # as vLLM does, the grammar mask comes first: logprobs are those of the constrained logits
            logits = ops.apply_token_bitmask(logits, self.structured.bitmask(grammars).to(device))
        # logprobs are otherwise the model's own distribution (vLLM's raw logprobs): taken before
        # min_tokens masking, penalties and temperature
        want_logprobs = any(s.params.logprobs is not None for s in seqs)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        logits = self._mask_early_stops(logits.clone(), seqs)
        if any(g is not None for g in grammars):
            stuck = torch.isneginf(logits).all(dim=-1).tolist()
            for g, dead in zip(grammars, stuck):
                if g is not None:
                    g.dead_end = dead
        if any(s.params.has_penalties for s in seqs):
            logits = self._penalise(logits, seqs)
        greedy = torch.tensor([s.params.greedy for s in seqs], device=device)
        temps = torch.tensor([s.params.temperature if s.params.temperature > 0 else 1.0 for s in seqs],
                             dtype=logits.dtype, device=device)
        scaled = logits / temps.unsqueeze(1)
        filtered = ops.top_k_top_p_min_p(
            scaled,
            torch.tensor([s.params.top_k for s in seqs], dtype=torch.long, device=device),
            torch.tensor([s.params.top_p for s in seqs], dtype=logits.dtype, device=device),
            torch.tensor([s.params.min_p for s in seqs], dtype=logits.dtype, device=device),
        )
        probs = torch.softmax(filtered, dim=-1)
        vocab = logits.shape[-1]
        noise = torch.stack([
            torch.ones(vocab, dtype=torch.float64) if s.params.greedy else sampling_noise(s, vocab) for s in seqs
        ]).to(device=device, dtype=probs.dtype)
        sampled = ops.random_sample(probs, noise)
        tokens = torch.where(greedy, logits.argmax(dim=-1), sampled).tolist()
        logprobs: list[dict[int, float] | None] = []
        for row, (seq, tok) in enumerate(zip(seqs, tokens)):
            n = seq.params.logprobs
            if n is None or raw_logprobs is None:
                logprobs.append(None)
                continue
            top = torch.topk(raw_logprobs[row], min(n, self.vocab_size)) if n > 0 else None
            entry = {tok: float(raw_logprobs[row, tok])}
            if top is not None:
                entry.update({int(i): float(v) for v, i in zip(top.values, top.indices)})
            logprobs.append(entry)
        return tokens, logprobs

    def _mask_early_stops(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        for row, seq in enumerate(seqs):
            if len(seq.output_token_ids) < seq.params.min_tokens:
                banned = list(seq.params.stop_token_ids) + ([] if seq.params.ignore_eos else self.eos)
                if banned:
                    logits[row, banned] = float("-inf")
        return logits

    def _penalise(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        vocab, device = logits.shape[-1], logits.device
        prompt_mask = torch.zeros(len(seqs), vocab, dtype=torch.bool)
        counts = torch.zeros(len(seqs), vocab, dtype=torch.long)
        for row, seq in enumerate(seqs):
            prompt_mask[row, seq.prompt_token_ids] = True
            if seq.output_token_ids:
                out = torch.tensor(seq.output_token_ids)
                counts[row].index_add_(0, out, torch.ones(len(out), dtype=torch.long))
        p = [s.params for s in seqs]

        def col(values):
            return torch.tensor(values, dtype=logits.dtype, device=device)

        return self.ops.apply_penalties(
            logits, prompt_mask.to(device), counts.to(device),
            col([x.repetition_penalty for x in p]), col([x.presence_penalty for x in p]),
            col([x.frequency_penalty for x in p]),
        )

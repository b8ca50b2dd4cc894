"""Turns the last-position logits of a batch into next tokens (and logprobs) on the logits' device.

An all-greedy batch without penalties, grammar, ``min_tokens`` masks or logprobs is one argmax. Random
rows are sampled by an exponential race (``random_sample``: argmax of probs / noise) whose Exp(1)
noise is counter-based and made on the device (:mod:`deepinfer_core.sampling.random`): element ``v`` of
the noise of a sequence's output position ``p`` is ``-log u`` with ``u`` made of the top 52 bits of
output ``v + 1`` of the splitmix64 stream seeded with ``noise_seed(base, p)``, where ``base`` is the
sequence's seed (the engine derives it from the request's ``seed`` and the sample index, or draws it
from the engine seed for unseeded requests).
The hash is exact 64-bit integer arithmetic in int64 tensor ops, so the uniforms of a position are the
same on every device (the noise is then the device's ``log``) and whatever the batch, the number of
earlier steps, preemption and recomputation, or an engine restart.

The per-row parameters travel to the device in one copy per step. Tokens come back as a device tensor
(``SamplerOutput``); the model runner copies them to the host (``to_host``, through the platform).
Penalty state (prompt mask, output counts) is kept per sequence across steps on the device and grows by
the tokens sampled since the last step (vLLM's persistent batch), instead of being rebuilt every step. A
plain decode step's samples are counted there as soon as they are drawn (``count_samples``), so the next
step needs none of them on the host; a verification's accepted drafts are counted from the outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from deepinfer_core.ops import OpTable
from deepinfer_core.platform import Event, Platform
from deepinfer_core.sampling.argmax import argmax
from deepinfer_core.sampling.penalties import PenaltyTable
from deepinfer_core.sampling.random import as_int64, base_seed, exponential_noise, noise_seed


@dataclass
class SamplerOutput:
    """One step's samples, on the device until ``to_host`` (vLLM's layout for logprobs: column 0 is the
    sampled token, then the top ``max(logprobs)`` tokens of the row)."""

    sampled_token_ids: torch.Tensor  # Long [B]
    logprob_token_ids: torch.Tensor | None = None  # Long [B, 1 + k]
    logprobs: torch.Tensor | None = None  # [B, 1 + k]
    ready: Event | None = None  # recorded after the copies ``to_host`` started
    dead_ends: list[bool] | None = None  # per row: no token satisfied the grammar and the other masks

    def to_host(self, platform: Platform | None = None) -> SamplerOutput:
        """Start copying to the host without waiting (the event, if any, says when it is there)."""
        platform = platform or Platform(self.sampled_token_ids.device)
        host, event = platform.to_host([self.sampled_token_ids, self.logprob_token_ids, self.logprobs])
        return SamplerOutput(*host, ready=event, dead_ends=self.dead_ends)

    def tolists(self, seqs: list[Any]) -> tuple[list[int], list[dict[int, float] | None]]:
        """Tokens and, for the rows that asked, {token: logprob} of the sample and the row's top n."""
        if self.ready is not None:
            self.ready.synchronize()
        tokens = self.sampled_token_ids.tolist()
        if self.logprobs is None:
            return tokens, [None] * len(seqs)
        ids, values = self.logprob_token_ids.tolist(), self.logprobs.tolist()
        out: list[dict[int, float] | None] = []
        for seq, row_ids, row_values in zip(seqs, ids, values):
            n = seq.params.logprobs
            out.append(None if n is None else dict(zip(row_ids[: n + 1], row_values[: n + 1])))
        return tokens, out


class Sampler:
    """Samples rows of logits for sequences; ``seqs`` are any objects with ``seq_id``, ``params``,
    ``generator``, ``prompt_token_ids`` and ``output_token_ids`` (and optionally ``grammar``)."""

    def __init__(self, ops: OpTable, vocab_size: int, eos_token_ids: list[int], structured=None):
        self.ops, self.vocab_size, self.eos = ops, vocab_size, eos_token_ids
        self.structured = structured  # a StructuredOutputManager (only needed for grammar rows)
        self.penalties: PenaltyTable | None = None  # made on the logits' device when a penalised row comes

    def free(self, seq_id: int) -> None:
        """Forget a finished sequence's persistent state."""
        if self.penalties is not None:
            self.penalties.free(seq_id)

    def _table(self, device: torch.device) -> PenaltyTable:
        if self.penalties is None:
            self.penalties = PenaltyTable(self.vocab_size, device)
        return self.penalties

    def __call__(self, logits: torch.Tensor, seqs: list[Any], bitmask: torch.Tensor | None = None) -> SamplerOutput:
        """``bitmask``: the packed grammar mask of the rows (all ones where there is no grammar); built
        here from the sequences' ``grammar`` states when not given."""
        grammars = [getattr(s, "grammar", None) for s in seqs]
        if bitmask is None and any(g is not None for g in grammars):
            bitmask = self.structured.bitmask(grammars)
        if bitmask is not None:
            # as vLLM does, the grammar mask comes first: logprobs are those of the constrained logits
            logits = self.ops.apply_token_bitmask(logits, bitmask.to(logits.device))
        # logprobs are otherwise the model's own distribution (vLLM's raw logprobs): taken before
        # min_tokens masking, penalties and temperature
        want_logprobs = [s.params.logprobs for s in seqs if s.params.logprobs is not None]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        logits = self._mask_early_stops(logits, seqs)
        dead_ends = torch.isneginf(logits).all(dim=-1).tolist() if bitmask is not None else None
        for g, dead in zip(grammars, dead_ends or ()):
            if g is not None:
                g.dead_end = dead
        if any(s.params.has_penalties for s in seqs):
            logits = self._penalise(logits, seqs)
        tokens = argmax(logits)
        random_rows = [row for row, s in enumerate(seqs) if not s.params.greedy]
        if random_rows:
            sampled, rows = self._sample(logits, [seqs[r] for r in random_rows], random_rows)
            tokens = sampled if len(random_rows) == len(seqs) else tokens.index_copy(0, rows, sampled)
        out = SamplerOutput(tokens, dead_ends=dead_ends)
        if raw_logprobs is not None:
            top = torch.topk(raw_logprobs, min(max(want_logprobs), self.vocab_size), dim=-1)
            ids = torch.cat([tokens.unsqueeze(1), top.indices], dim=1)
            out.logprob_token_ids, out.logprobs = ids, raw_logprobs.gather(1, ids)
        return out

    def _sample(self, logits: torch.Tensor, seqs: list[Any],
                rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(sampled tokens, their rows in ``logits``) for the random rows ``rows``; one copy to the device."""
        p = [s.params for s in seqs]
        ints = torch.tensor([rows, [as_int64(noise_seed(base_seed(s), len(s.output_token_ids))) for s in seqs],
                             [x.top_k for x in p]], dtype=torch.int64)
        floats = torch.tensor([[x.temperature for x in p], [x.top_p for x in p], [x.min_p for x in p]],
                              dtype=torch.float64)
        packed = torch.cat([ints, floats.view(torch.int64)]).to(logits.device, non_blocking=True)
        idx, seeds, top_k = packed[0], packed[1], packed[2]
        temperature, top_p, min_p = packed[3:].view(torch.float64).to(logits.dtype)
        if len(rows) < logits.shape[0]:
            logits = logits.index_select(0, idx)
        scaled = logits / temperature.unsqueeze(1)
        if any(x.top_k > 0 or x.top_p < 1 or x.min_p > 0 for x in p):
            scaled = self.ops.top_k_top_p_min_p(scaled, top_k, top_p, min_p)
        probs = torch.softmax(scaled, dim=-1)
        noise = exponential_noise(seeds, logits.shape[-1]).to(probs.dtype)
        return self.ops.random_sample(probs, noise), idx

    def _mask_early_stops(self, logits: torch.Tensor, seqs: list[Any]) -> torch.Tensor:
        rows, cols = [], []
        for row, seq in enumerate(seqs):
            if len(seq.output_token_ids) < seq.params.min_tokens:
                banned = list(seq.params.stop_token_ids) + ([] if seq.params.ignore_eos else self.eos)
                rows += [row] * len(banned)
                cols += banned
        if not rows:
            return logits
        index = torch.tensor([rows, cols], dtype=torch.long).to(logits.device, non_blocking=True)
        return logits.index_put((index[0], index[1]), torch.tensor(float("-inf"), dtype=logits.dtype,
                                                                   device=logits.device))

    def _penalise(self, logits: torch.Tensor, seqs: list[Any]) -> torch.Tensor:
        """Penalties from each penalised sequence's persistent prompt mask and output counts."""
        prompt_mask, counts = self._table(logits.device).gather(seqs)
        return self.ops.apply_penalties(logits, prompt_mask, counts, *self._penalty_values(seqs, logits))

    def penalise_verification(self, logits: torch.Tensor, seqs: list[Any], drafts: torch.Tensor) -> torch.Tensor:
        """The penalties of verification rows: ``logits`` [S, Q, V], row ``j`` of sequence ``i`` the
        position after its drafts ``drafts[i, :j]`` ([S, >= Q - 1], device), which count as its outputs
        there (as they are, where accepted). Every row is penalised by the outputs' counts, then the
        drafts' own tokens again with the counts that row sees (a [S * Q, Q - 1] matrix, not a
        vocabulary-wide one per row)."""
        num, q, _ = logits.shape
        prompt_mask, counts = self._table(logits.device).gather(seqs)
        values = self._penalty_values(seqs, logits)
        out = torch.stack([self.ops.apply_penalties(logits[:, j], prompt_mask, counts, *values) for j in range(q)], 1)
        if q == 1:
            return out
        d = drafts[:, : q - 1]
        same = (d.unsqueeze(2) == d.unsqueeze(1)).long()  # [S, p', p]: draft p' is draft p's token
        before = torch.cat([same.new_zeros((num, 1, q - 1)), same.cumsum(1)], 1)  # row j: drafts p' < j
        seen = (counts.gather(1, d).unsqueeze(1) + before).view(num * q, q - 1)
        mask = prompt_mask.gather(1, d).repeat_interleave(q, dim=0)
        cols = d.unsqueeze(1).expand(num, q, q - 1)
        narrow = self.ops.apply_penalties(logits.gather(2, cols).view(num * q, q - 1), mask, seen,
                                          *(v.repeat_interleave(q) for v in values))
        return out.scatter_(2, cols, narrow.view(num, q, q - 1))

    def count_samples(self, seqs: list[Any], tokens: torch.Tensor) -> None:
        """Count the samples ``tokens`` (on the device), each the next output of its sequence, into the
        penalised sequences' states there: the next step may be penalised by them before they reach the
        host (async scheduling). A sequence's later outputs are counted from the host as before."""
        self.count_outputs(seqs, tokens.unsqueeze(1))
        for seq in seqs:
            self.mark_counted(seq, 1)

    def count_outputs(self, seqs: list[Any], tokens: torch.Tensor, num_accepted: torch.Tensor | None = None) -> None:
        """Count the penalised sequences' new outputs into their states on the device: row ``i``'s first
        ``num_accepted[i] + 1`` of ``tokens[i]`` ([len(seqs), q] on the device; all of them where
        ``num_accepted`` is None), before they reach the host, which marks them counted
        (:meth:`mark_counted`) as it records them."""
        picked = [(i, seq) for i, seq in enumerate(seqs) if seq.params.has_penalties]
        if not picked:
            return
        table = self._table(tokens.device)
        index = torch.tensor([[i for i, _ in picked], [table.row(seq) for _, seq in picked]], dtype=torch.long)
        index = index.to(tokens.device, non_blocking=True)
        keep = torch.ones_like(tokens)
        if num_accepted is not None:
            keep = (torch.arange(tokens.shape[1], device=tokens.device) <= num_accepted.unsqueeze(1)).long()
        ids = tokens.clamp(min=0)  # past the accepted ones, padding of weight 0
        table.add(index[1], ids.index_select(0, index[0]), keep.index_select(0, index[0]))

    def mark_counted(self, seq: Any, n: int) -> None:
        """The sequence's last ``n`` outputs, now on the host, were counted by :meth:`count_outputs`."""
        if self.penalties is not None:
            self.penalties.mark_counted(seq.seq_id, n)

    @staticmethod
    def _penalty_values(seqs: list[Any], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(repetition, presence, frequency) per sequence on the logits' device (one copy)."""
        p = [s.params for s in seqs]
        values = torch.tensor([[x.repetition_penalty for x in p], [x.presence_penalty for x in p],
                               [x.frequency_penalty for x in p]], dtype=torch.float64)
        repetition, presence, frequency = values.to(logits.device, non_blocking=True).to(logits.dtype)
        return repetition, presence, frequency

"""Verification of drafts against the target's logits: greedy (exact match against the target's argmax)
or lossless rejection sampling, the accepted counts, the output tokens, and the cache rows the rejected
drafts wrote put back.

:class:`Verifier` runs after the target forward of a speculative step, on the device: its ops are what a
captured graph replays in a chained step (``verify_rows``), so it never reads a device value on the host.
A step of greedy verifications of one length takes ``verify_uniform`` (no host layout of the rows);
other steps the general ``verify``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from deepinfer_core.engine.scheduler_output import ScheduledSeq
from deepinfer_core.sampling.random import base_seed
from deepinfer_core.spec_decode.rejection_sampler import (
    greedy_verify,
    rejection_sample,
    stream_seeds,
    verify_noise,
    verify_noise_at,
)
from deepinfer_core.spec_decode.rollback import CacheUndo

if TYPE_CHECKING:
    from deepinfer_core.worker.model_runner import CachedRequestState


@dataclass
class Verification:
    """A verification in the batch: which scheduled span, its first logits row, its drafts."""

    index: int
    first_row: int
    state: CachedRequestState
    drafts: list[int]


class Verifier:
    """Verifies with ``sampler`` (penalties, grammar masks, output counts, top-k/p/min-p ops), its
    parameters reaching the device through ``platform``."""

    def __init__(self, sampler: Any, platform: Any):
        self.sampler, self.platform = sampler, platform
        self._layouts: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # see uniform_layout

    def verify(self, logits: torch.Tensor, verifies: list[Verification], undo: CacheUndo, draft_mask: torch.Tensor,
               fillers: torch.Tensor | None, starts: list[int], scheduled: list[ScheduledSeq],
               span: int | None = None, masks: tuple[torch.Tensor, dict[int, int]] | None = None):
        """Verify every verification's drafts (a ``VerifyOutput`` on the device, and the logprobs of its rows
        where asked); rows written by rejected drafts and by ``fillers`` (bool [T], on the host) are put
        back. ``span``: the tokens of every scheduled span (fillers included), where all are one length.
        ``masks``: the grammar bitmask and each scheduled index's first row in it."""
        device, vocab = logits.device, logits.shape[-1]
        s = len(verifies)
        penalised = any(v.state.params.has_penalties for v in verifies)
        want_logprobs = any(v.state.params.logprobs is not None for v in verifies)
        if (span and s == len(scheduled) and not (penalised or want_logprobs or masks)
                and all(v.state.params.greedy for v in verifies)
                and all(v.first_row == i * span for i, v in enumerate(verifies))):
            return self.verify_uniform(logits, verifies, undo, span, len(draft_mask)), None
        num = np.array([len(v.drafts) for v in verifies], dtype=np.int64)
        k = int(num.max())
        cols = np.arange(k + 1)
        first = np.array([v.first_row for v in verifies], dtype=np.int64)
        gather = first[:, None] + np.minimum(cols, num[:, None])  # past a span's drafts: its last row again
        drafts = np.zeros((s, k), dtype=np.int64)
        drafts[cols[:k] < num[:, None]] = [t for v in verifies for t in v.drafts]
        # each draft token's verification and its offset (1-based) there; -1: not a draft
        owner = np.full(len(draft_mask), -1, dtype=np.int64)
        offset = np.zeros(len(draft_mask), dtype=np.int64)
        first_token = np.array([starts[v.index] + len(scheduled[v.index].token_ids) for v in verifies]) - num
        within = np.arange(int(num.sum())) - np.repeat(np.cumsum(num) - num, num)
        tokens = np.repeat(first_token, num) + within
        owner[tokens], offset[tokens] = np.repeat(np.arange(s), num), within + 1
        greedy = np.array([v.state.params.greedy for v in verifies], dtype=np.int64)
        sizes = (gather.size, drafts.size, s, len(owner), len(owner), s)
        host = np.concatenate([gather.reshape(-1), drafts.reshape(-1), num, owner, offset, greedy])
        gather_d, drafts_d, num_d, owner, offset, greedy_d = self.platform.upload(torch.from_numpy(host)).split(sizes)
        drafts_d = drafts_d.view(s, k)
        rows = logits[gather_d]  # [S * (K + 1), V]
        if masks is not None:  # first, as the plain sampler: logprobs are those of the constrained logits
            bitmask, first_mask = masks
            index = [first_mask[v.index] + min(c, len(v.drafts)) for v in verifies for c in range(k + 1)]
            rows = self.sampler.ops.apply_token_bitmask(rows, bitmask[index].to(device))
        raw = rows
        if penalised:
            rows = self.sampler.penalise_verification(rows.view(s, k + 1, vocab), [v.state for v in verifies],
                                                      drafts_d).view(s * (k + 1), vocab)
        if greedy.all():
            out = greedy_verify(rows.view(s, k + 1, vocab), drafts_d, num_d)
        else:
            params = [v.state.params for v in verifies for _ in range(k + 1)]
            probs = self.target_probs(rows, params).view(s, k + 1, vocab)
            uniforms, noise = verify_noise([base_seed(v.state) for v in verifies],
                                           [len(v.state.output_token_ids) for v in verifies], k + 1, vocab, device)
            out = rejection_sample(probs, drafts_d, num_d, uniforms, noise, greedy=greedy_d.bool())
        if penalised:  # the next step may be penalised by them before they reach the host
            self.sampler.count_outputs([v.state for v in verifies], out.output_token_ids, out.num_accepted)
        rejected = (owner >= 0) & (offset > out.num_accepted[owner.clamp(min=0)])
        if fillers is not None:
            rejected |= fillers.to(device)
        undo.restore(rejected)
        return out, (self.logprobs(raw, out.output_token_ids, verifies) if want_logprobs else None)

    @staticmethod
    def logprobs(rows: torch.Tensor, tokens: torch.Tensor, verifies: list[Verification]) -> list[torch.Tensor]:
        """The plain sampler's logprobs of every verification row (the model's own distribution, before
        penalties and temperature): [rows, 1 + n] ids, the row's output token then its top n, and their
        logprobs, n the most any verification asked for."""
        n = max(v.state.params.logprobs or 0 for v in verifies)
        raw = torch.log_softmax(rows, dim=-1)
        top = torch.topk(raw, min(n, raw.shape[-1]), dim=-1).indices
        ids = torch.cat([tokens.reshape(-1, 1).clamp(min=0), top], dim=1)
        return [ids, raw.gather(1, ids)]

    def verify_uniform(self, logits: torch.Tensor, verifies: list[Verification], undo: CacheUndo, span: int,
                       num_tokens: int):
        """:meth:`verify` of a step of greedy verifications only, each ``span`` tokens long (fillers after
        its drafts included), whose logits rows are its tokens'. Token ``t`` is its span's draft
        ``t % span``, rejected past the accepted count (a filler is past every draft)."""
        s = len(verifies)
        drafts = np.zeros((s, span), dtype=np.int64)  # the drafts, then the draft counts in the last column
        for i, v in enumerate(verifies):
            drafts[i, : len(v.drafts)] = v.drafts
            drafts[i, -1] = len(v.drafts)
        host = self.platform.upload(torch.from_numpy(drafts))
        return self.verify_rows(logits, host[:, :-1], host[:, -1], undo, span, num_tokens)

    def verify_rows(self, logits: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor, undo: CacheUndo,
                    span: int, num_tokens: int, sampled: tuple | None = None,
                    penalised: list[CachedRequestState] | None = None):
        """Verification of ``drafts`` [s, span - 1] (device; ``num_drafts`` [s] of each are real) in the first
        ``s`` spans of ``span`` logits rows each, greedy or (``sampled``, from :meth:`sampling`) lossless,
        penalised where ``penalised`` (the spans' states) is given; the rows rejected tokens wrote are put
        back."""
        s = drafts.shape[0]
        rows = logits[: s * span]
        if penalised is not None:
            rows = self.sampler.penalise_verification(rows.reshape(s, span, -1), penalised, drafts).view(s * span, -1)
        if sampled is None:
            out = greedy_verify(rows.reshape(s, span, -1), drafts, num_drafts)
        else:
            params, hashed, first, greedy = sampled
            probs = self.target_probs(rows, [p for p in params for _ in range(span)])
            uniforms, noise = verify_noise_at(hashed, first, span, rows.shape[-1])
            out = rejection_sample(probs.view(s, span, -1), drafts, num_drafts, uniforms, noise, greedy=greedy)
        if penalised is not None:
            self.sampler.count_outputs(penalised, out.output_token_ids, out.num_accepted)
        offset, owner = self.uniform_layout(num_tokens, span, logits.device)
        accepted = torch.cat([out.num_accepted, out.num_accepted.new_zeros(len(owner) // span - s + 1)])
        undo.restore(offset > accepted[owner])
        return out

    def uniform_layout(self, num_tokens: int, span: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(offset of each token within its span, its span) for ``num_tokens`` tokens in spans of ``span``;
        tokens past the last whole span belong to an extra one."""
        key = (num_tokens, span)
        cached = self._layouts.get(key)
        if cached is None:
            tokens = torch.arange(num_tokens, device=device)
            cached = self._layouts[key] = (tokens % span, tokens // span)
        return cached

    def sampling(self, states: list[CachedRequestState], shift: torch.Tensor) -> tuple:
        """What :meth:`verify_rows` samples a chained step's verifications with: per sequence its parameters,
        its hashed seeds and greedy flag (one copy) and its first row's output position, which is the
        host's count moved on by the step before's accepted drafts (``shift``, device) and its new token."""
        host = torch.cat([stream_seeds([base_seed(st) for st in states]),
                          torch.tensor([[len(st.output_token_ids) + 1, st.params.greedy] for st in states])], 1)
        device = self.platform.upload(host)
        return [st.params for st in states], device[:, :2], device[:, 2] + shift, device[:, 3].bool()

    def target_probs(self, logits: torch.Tensor, params: list) -> torch.Tensor:
        """The target's sampling distribution of each row (temperature, top-k, top-p, min-p); greedy rows
        keep their argmax (temperature 1). The parameters reach the device in one copy, which does not wait
        for the device where the platform can copy so."""
        filtered = any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params)
        host = torch.tensor([[p.temperature if not p.greedy else 1.0, p.top_p, p.min_p, p.top_k] for p in params],
                            dtype=torch.float64)
        device = self.platform.upload(host)
        temperature, top_p, min_p, top_k = device.to(logits.dtype).unbind(1)
        scaled = logits / temperature.unsqueeze(1)
        if filtered:
            scaled = self.sampler.ops.top_k_top_p_min_p(scaled, device[:, 3].long(), top_p, min_p)
        return torch.softmax(scaled, dim=-1)

"""Lossless verification of drafts against the target's distributions (vLLM's ``RejectionSampler``).

Per sequence, rows ``0..n`` of the target are its distributions after the last accepted token and after
each of its ``n`` drafts. Draft ``j`` is accepted with probability ``min(1, p_j(d) / q_j(d))``; at the first
rejection the token is sampled from the normalised residual ``max(p_j - q_j, 0)``; when all pass, a bonus
token is sampled from ``p_n``. The output then has exactly the target's distribution. At temperature 0
this is exact match against the target's argmax. A draft taken greedily from the drafter is a point mass
(``q = one_hot(d)``): accept with probability ``p(d)``, resample from ``p`` without ``d``.

Randomness is counter-based like the sampler's (``sampling/sampler.py``): the residual or bonus sample at
output position ``m`` uses that position's Exp(1) noise, and the acceptance test of the draft at output
position ``m`` a uniform from a second stream of the same seed, so a seeded request reproduces.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_core.sampling.argmax import argmax
from deepinfer_core.sampling.random import MASK64 as _MASK64
from deepinfer_core.sampling.random import as_int64 as _signed
from deepinfer_core.sampling.random import exponential_noise, noise_seed, splitmix64_tensor
from deepinfer_core.sampling.random import splitmix64 as _splitmix64

_ACCEPT_TAG = 0x5D3C_A11E_D0_5EED  # separates the acceptance uniforms from the sampling noise


def accept_seed(base_seed: int, position: int) -> int:
    """Seed of the acceptance uniform of the draft at output ``position``."""
    return noise_seed(_splitmix64(base_seed ^ _ACCEPT_TAG), position)


@dataclass
class VerifyOutput:
    output_token_ids: torch.Tensor  # Long [S, K + 1]: accepted drafts, then the resampled or bonus token
    num_accepted: torch.Tensor  # Long [S]: drafts accepted (output row ``num_accepted`` is the new token)


def rejection_sample(target_probs: torch.Tensor, draft_token_ids: torch.Tensor, num_drafts: torch.Tensor,
                     uniforms: torch.Tensor, noise: torch.Tensor, draft_probs: torch.Tensor | None = None,
                     greedy: torch.Tensor | None = None) -> VerifyOutput:
    """Verify padded drafts.

    ``target_probs`` [S, K+1, V] (for greedy rows any scores whose argmax is the target's token),
    ``draft_token_ids`` [S, K] (past ``num_drafts`` [S] ignored), ``uniforms`` [S, K] in (0, 1), ``noise``
    [S, K+1, V] Exp(1), ``draft_probs`` [S, K, V] (None: greedy drafts, one-hot), ``greedy`` bool [S].
    """
    s, k1, _ = target_probs.shape
    k = k1 - 1
    pos = torch.arange(k, device=target_probs.device)
    valid = pos.unsqueeze(0) < num_drafts.unsqueeze(1)  # [S, K]
    drafts = draft_token_ids.clamp(min=0)
    p_d = target_probs[:, :k].gather(2, drafts.unsqueeze(2)).squeeze(2)
    if draft_probs is None:
        q_d = torch.ones_like(p_d)
        q = torch.zeros_like(target_probs[:, :k]).scatter_(2, drafts.unsqueeze(2), 1.0)
    else:
        q_d = draft_probs.gather(2, drafts.unsqueeze(2)).squeeze(2)
        q = draft_probs
    accept = uniforms.to(p_d.dtype) * q_d < p_d
    argmax = target_probs.argmax(dim=-1)  # [S, K+1]
    if greedy is not None:
        accept = torch.where(greedy.unsqueeze(1), drafts == argmax[:, :k], accept)
    accept &= valid
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)
    # row j's replacement token: from the residual where j had a draft, else (bonus) from p_j itself
    q_full = torch.cat([q * valid.unsqueeze(2).to(q.dtype), torch.zeros_like(target_probs[:, :1])], dim=1)
    residual = (target_probs - q_full).clamp_(min=0)
    sampled = (residual / noise.to(residual.dtype)).argmax(dim=-1)  # [S, K+1]
    if greedy is not None:
        sampled = torch.where(greedy.unsqueeze(1), argmax, sampled)
    return _output(drafts, num_accepted, sampled)


def greedy_verify(target_logits: torch.Tensor, draft_token_ids: torch.Tensor,
                  num_drafts: torch.Tensor) -> VerifyOutput:
    """``rejection_sample`` when every sequence is greedy: exact match against the argmax of
    ``target_logits`` [S, K+1, V], no probabilities or noise."""
    k = target_logits.shape[1] - 1
    best = argmax(target_logits)  # [S, K+1]
    drafts = draft_token_ids.clamp(min=0)
    valid = torch.arange(k, device=drafts.device).unsqueeze(0) < num_drafts.unsqueeze(1)
    num_accepted = ((drafts == best[:, :k]) & valid).long().cumprod(dim=1).sum(dim=1)
    return _output(drafts, num_accepted, best)


def _output(drafts: torch.Tensor, num_accepted: torch.Tensor, replacements: torch.Tensor) -> VerifyOutput:
    """Each row's accepted drafts, then its replacement token ``replacements[:, num_accepted]``, then -1."""
    out = torch.cat([drafts, drafts[:, :1]], dim=1)
    rows = torch.arange(out.shape[1], device=out.device).unsqueeze(0)
    out = torch.where(rows == num_accepted.unsqueeze(1), replacements, out)
    out = torch.where(rows > num_accepted.unsqueeze(1), torch.full_like(out, -1), out)
    return VerifyOutput(out, num_accepted)


def stream_seeds(base_seeds: list[int]) -> torch.Tensor:
    """Int64 [S, 2] (host): per sequence, the hashed bases of its sampling noise and of its acceptance
    uniforms; the seed at output position ``p`` is ``splitmix64(base ^ p)`` (``noise_seed``,
    ``accept_seed``)."""
    return torch.tensor([[_signed(_splitmix64(b & _MASK64)), _signed(_splitmix64(_splitmix64(b ^ _ACCEPT_TAG)))]
                         for b in base_seeds], dtype=torch.int64).view(-1, 2)


def verify_noise(base_seeds: list[int], first_positions: list[int], num_rows: int, vocab_size: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(uniforms [S, K], Exp(1) noise [S, K+1, V]) for sequences whose row 0 is output position
    ``first_positions[s]`` (K = ``num_rows - 1``)."""
    host = torch.cat([stream_seeds(base_seeds), torch.tensor(first_positions, dtype=torch.int64).view(-1, 1)], 1)
    packed = host.to(device, non_blocking=True)
    return verify_noise_at(packed[:, :2], packed[:, 2], num_rows, vocab_size)


def verify_noise_at(hashed: torch.Tensor, first_positions: torch.Tensor, num_rows: int,
                    vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`verify_noise` from ``stream_seeds`` and the first positions (int64 [S]) on the device, which
    may know the positions alone (a step launched before the one that moves them on ends)."""
    rows = first_positions.unsqueeze(1) + torch.arange(num_rows, device=first_positions.device)  # [S, K + 1]
    s = rows.shape[0]
    noise = exponential_noise(splitmix64_tensor(hashed[:, :1] ^ rows).view(-1), vocab_size).view(s, num_rows,
                                                                                                  vocab_size)
    if num_rows > 1:
        useeds = splitmix64_tensor(hashed[:, 1:] ^ rows[:, :-1]).view(-1)
        uniforms = exponential_noise(useeds, 1).view(s, num_rows - 1).neg_().exp_()
    else:
        uniforms = torch.zeros(s, 0, dtype=torch.float64, device=first_positions.device)
    return uniforms, noise

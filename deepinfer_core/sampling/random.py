"""Counter-based randomness of sampling: the same numbers on every device, in any batch.

A sequence's sampling noise at output position ``p`` is seeded with ``noise_seed(base, p)``, ``base``
being the sequence's seed (:func:`base_seed`); element ``v`` of the noise is ``-log u`` with ``u`` made
of the top 52 bits of output ``v + 1`` of the splitmix64 stream of that seed (:func:`exponential_noise`).
The hash is exact 64-bit integer arithmetic, on the host (:func:`splitmix64`, Python ints) or in int64
tensor ops on any device (:func:`splitmix64_tensor`), so the uniforms of a position do not depend on the
device, the batch, the number of earlier steps, preemption and recomputation, or an engine restart.
Speculative verification derives its acceptance uniforms from the same streams
(``spec_decode.rejection_sampler``).
"""

from __future__ import annotations

from typing import Any

import torch

#: the uint64 range, as a mask on Python ints
MASK64 = (1 << 64) - 1
_GAMMA, _M1, _M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def splitmix64(x: int) -> int:
    """One splitmix64 step of the uint64 ``x`` (a Python int), as a uint64."""
    x = (x + _GAMMA) & MASK64
    x = ((x ^ (x >> 30)) * _M1) & MASK64
    x = ((x ^ (x >> 27)) * _M2) & MASK64
    return x ^ (x >> 31)


def as_int64(x: int) -> int:
    """The int64 holding the bit pattern of the uint64 ``x``."""
    return x - (1 << 64) if x >= 1 << 63 else x


def noise_seed(base_seed: int, position: int) -> int:
    """The 64-bit seed of the sampling noise at output ``position`` of a sequence."""
    return splitmix64(splitmix64(base_seed & MASK64) ^ position)


def splitmix64_tensor(x: torch.Tensor) -> torch.Tensor:
    """:func:`splitmix64` of each int64 bit pattern in ``x``, on ``x``'s device (wrapping as in
    :func:`exponential_noise`)."""
    z = x + as_int64(_GAMMA)
    for bits, multiplier in ((30, _M1), (27, _M2), (31, None)):
        z = z ^ torch.bitwise_right_shift(z, bits).bitwise_and_((1 << (64 - bits)) - 1)
        if multiplier is not None:
            z = z * as_int64(multiplier)
    return z


def exponential_noise(seeds: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) noise [B, V] (float64) on ``seeds``' device from per-row int64 ``seeds`` [B].

    Row ``b`` holds outputs 1..V of the splitmix64 stream seeded with ``seeds[b]``: int64 products and
    sums wrap modulo 2**64 exactly as the unsigned ones do, and masking the sign copies that ``>>``
    brings in makes the shifts logical. One scratch buffer serves every shift (no per-op allocation).
    """
    steps = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=seeds.device) * as_int64(_GAMMA)
    z = seeds.to(torch.int64).unsqueeze(1) + steps
    shifted = torch.empty_like(z)
    for bits, multiplier in ((30, _M1), (27, _M2), (31, None)):
        torch.bitwise_right_shift(z, bits, out=shifted)
        z ^= shifted.bitwise_and_((1 << (64 - bits)) - 1)
        if multiplier is not None:
            z *= as_int64(multiplier)
    # the top 52 bits as a signed number, offset into [0, 2**52) and centred: every step is exact in
    # float64 and u lies in (0, 1), so the noise is finite and > 0
    u = torch.bitwise_right_shift(z, 12, out=shifted).to(torch.float64).add_(2.0**51 + 0.5).mul_(2.0**-52)
    return u.log_().neg_()


def base_seed(seq: Any) -> int:
    """The seed a sequence's sampling noise is derived from: its ``seed`` or its generator's."""
    seed = getattr(seq, "seed", None)
    if seed is not None:
        return seed
    return seq.generator.initial_seed() if seq.generator is not None else 0


def sampling_noise(seq: Any, vocab_size: int) -> torch.Tensor:
    """Exp(1) noise [V] (float64, on the CPU) for ``seq``'s next output position."""
    seed = as_int64(noise_seed(base_seed(seq), len(seq.output_token_ids)))
    return exponential_noise(torch.tensor([seed]), vocab_size)[0]

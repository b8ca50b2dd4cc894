"""The grouped-MoE problem the tuning scripts (``tune_moe_fp8.py``, ``tune_moe_fp4.py``) time: their shared
options, random bf16 experts with a block-quantised copy, and random top-k routing."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator

import torch


def moe_arguments(description: str, tokens: str, out: str) -> argparse.ArgumentParser:
    """The options of a tuning script: token counts, V4-Flash's MoE shape by default, timing and output."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default=tokens)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=out)
    return ap


def random_experts(a: argparse.Namespace, quantize: Callable, g: torch.Generator, device: torch.device):
    """bf16 experts w13 [E, 2I, D] and w2 [E, D, I] at unit-variance outputs, and ``quantize``'s (values,
    scales) of each, stacked over the experts: (w13, w2, q13, s13, q2, s2)."""
    e, d, inter = a.experts, a.hidden, a.inter
    w13 = torch.randn(e, 2 * inter, d, device=device, generator=g, dtype=torch.bfloat16) * d**-0.5
    w2 = torch.randn(e, d, inter, device=device, generator=g, dtype=torch.bfloat16) * inter**-0.5
    q13, s13 = (torch.stack(t) for t in zip(*(quantize(w) for w in w13)))
    q2, s2 = (torch.stack(t) for t in zip(*(quantize(w) for w in w2)))
    return w13, w2, q13, s13, q2, s2


def token_batches(a: argparse.Namespace, g: torch.Generator, device: torch.device) -> Iterator[tuple]:
    """For each count of ``--tokens``: (count, x [m, D] bf16, top-k expert ids [m, k], routing weights)."""
    for m in (int(t) for t in a.tokens.split(",")):
        x = torch.randn(m, a.hidden, device=device, generator=g, dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(a.experts, device=device, generator=g)[:a.top_k] for _ in range(m)])
        weights = torch.rand(m, a.top_k, device=device, generator=g) + 0.2
        yield m, x, ids, weights

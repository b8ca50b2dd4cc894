"""Confidence scheduling of verification (DSpark's algorithm 1).

Each decoding sequence offers its drafts as (sequence, position) pairs. A pair's survival is the
probability that it and every draft before it are accepted: the product of per-position acceptance
estimates, each the drafter's confidence in that draft calibrated online against measured acceptance
(:class:`AcceptanceCalibrator`). A step-time curve prices each extra token: the seconds of the captured
graph a decode step would replay, by batch size and query length (:class:`StepProfile`, timed when the
graphs are captured), or else a curve by batch token count learnt from the steps the engine runs, one
per batch size bucket (:class:`StepTimeModel`). Pairs are taken by descending survival and the prefix
with the most estimated accepted tokens per second is admitted, so a large batch verifies fewer drafts
and a lone sequence verifies more. A graph's query length is fixed: there, a step costs what its longest
span costs (every span is filled up to it). With confidence scheduling a graph is captured for every 1 + j tokens, so a
step that verifies at most j drafts a sequence is priced, and run, as the 1 + j graph.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass, field


class AcceptanceCalibrator:
    """P(draft accepted | the drafts before it accepted) by confidence bin, from a prior that trusts the
    confidence (``prior`` pseudo-observations at the bin's centre) and the verifications seen since. A
    bin tested fewer than ``min_tests`` times estimates 1: drafts that are never verified are never
    calibrated, and a drafter whose confidences understate its acceptance (or a model whose acceptance
    is forced) would never be verified."""

    def __init__(self, num_bins: int = 10, prior: float = 4.0, min_tests: int = 8):
        self.num_bins, self.prior, self.min_tests = num_bins, prior, min_tests
        self.tested = [0] * num_bins
        self.accepted = [0] * num_bins

    def _bin(self, confidence: float) -> int:
        return min(self.num_bins - 1, max(0, int(confidence * self.num_bins)))

    def estimate(self, confidence: float) -> float:
        return self._estimate(self._bin(confidence))

    def _estimate(self, b: int) -> float:
        if self.tested[b] < self.min_tests:
            return 1.0
        centre = (b + 0.5) / self.num_bins
        return (self.accepted[b] + self.prior * centre) / (self.tested[b] + self.prior)

    def table(self) -> list[float]:
        """Every bin's estimate (for a planning pass: bin ``min(num_bins - 1, int(confidence * num_bins))``)."""
        return [self._estimate(b) for b in range(self.num_bins)]

    def observe(self, confidences: list[float], num_accepted: int) -> None:
        """One verification of drafts with ``confidences``; only drafts whose prefix passed were tested."""
        top = self.num_bins - 1
        for j, c in enumerate(confidences[: num_accepted + 1]):
            b = int(c * self.num_bins)  # _bin, inlined: once per verified draft of every step
            b = 0 if b < 0 else top if b > top else b
            self.tested[b] += 1
            if j < num_accepted:
                self.accepted[b] += 1


def _bucket(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(n)))


class _Curve:
    """Seconds against token count: a running mean per power-of-two bucket, linear between buckets' mean
    points and extrapolated from the last two."""

    def __init__(self, decay: float):
        self.decay = decay
        self.points: dict[int, tuple[float, float]] = {}  # bucket -> (mean tokens, mean seconds)
        self._sorted: list[tuple[float, float]] | None = None

    def observe(self, num_tokens: int, seconds: float) -> None:
        self._sorted = None
        bucket, old = _bucket(num_tokens), self.points.get(_bucket(num_tokens))
        if old is None:
            self.points[bucket] = (float(num_tokens), seconds)
        else:
            d = self.decay
            self.points[bucket] = (d * old[0] + (1 - d) * num_tokens, d * old[1] + (1 - d) * seconds)

    def seconds(self, num_tokens: int) -> float:
        if self._sorted is None:
            self._sorted = sorted(self.points.values())
        pts = self._sorted
        if len(pts) == 1 or num_tokens <= pts[0][0]:
            return pts[0][1]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            if num_tokens <= x1:
                return y0 + (y1 - y0) * (num_tokens - x0) / max(x1 - x0, 1e-9)
        (x0, y0), (x1, y1) = pts[-2], pts[-1]
        slope = max(0.0, (y1 - y0) / max(x1 - x0, 1e-9))
        return y1 + slope * (num_tokens - x1)


class StepTimeModel:
    """Seconds of one step against its token count, learnt from the steps run: one curve over all steps,
    and one per power-of-two bucket of the step's decoding sequences, which prices a step once it has
    two token buckets measured (across batch sizes, tokens grow with the sequences, whose own cost the
    curve over all steps would charge to each draft). Until something is measured every size costs the
    same (verify everything)."""

    def __init__(self, decay: float = 0.8):
        self.decay = decay
        self.all = _Curve(decay)
        self.by_seqs: dict[int, _Curve] = {}

    @property
    def points(self) -> dict[int, tuple[float, float]]:
        return self.all.points

    def observe(self, num_tokens: int, seconds: float, num_seqs: int | None = None) -> None:
        if num_tokens < 1 or not seconds > 0:
            return
        self.all.observe(num_tokens, seconds)
        if num_seqs:
            self.by_seqs.setdefault(_bucket(num_seqs), _Curve(self.decay)).observe(num_tokens, seconds)

    def seconds(self, num_tokens: int, num_seqs: int | None = None) -> float:
        return self.curve(num_seqs)(num_tokens)

    def curve(self, num_seqs: int | None = None) -> Callable[[int], float]:
        """Seconds against token count for steps of ``num_seqs`` decoding sequences."""
        curve = self.by_seqs.get(_bucket(num_seqs)) if num_seqs else None
        if curve is not None and len(curve.points) >= 2:
            return curve.seconds
        return self.all.seconds if self.all.points else (lambda num_tokens: 1.0)


@dataclass(frozen=True)
class StepProfile:
    """Seconds of one replay of each captured decode graph, by (batch size, query length)."""

    seconds: dict[tuple[int, int], float] = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "_sizes", sorted({s for s, _ in self.seconds}))
        object.__setattr__(self, "_lengths", sorted({q for _, q in self.seconds}))

    def lookup(self, num_seqs: int, longest: int) -> float | None:
        """The seconds of the graph a step of ``num_seqs`` sequences, the longest ``longest`` tokens, pads
        to; None where none holds it."""
        i, j = bisect.bisect_left(self._sizes, num_seqs), bisect.bisect_left(self._lengths, longest)
        if i == len(self._sizes) or j == len(self._lengths):
            return None
        return self.seconds.get((self._sizes[i], self._lengths[j]))


@dataclass
class Candidate:
    """A decoding sequence's offer: its drafts' confidences, at most ``room`` of them usable."""

    key: int
    confidences: list[float]
    room: int


class ConfidenceScheduler:
    def __init__(self, calibrator: AcceptanceCalibrator | None = None, step_time: StepTimeModel | None = None,
                 profile: StepProfile | None = None):
        self.calibrator = calibrator or AcceptanceCalibrator()
        self.step_time = step_time or StepTimeModel()
        self.profile = profile

    def survival(self, confidences: list[float]) -> list[float]:
        out, s = [], 1.0
        for c in confidences:
            s *= self.calibrator.estimate(c)
            out.append(s)
        return out

    def plan(self, candidates: list[Candidate], base_tokens: int, base_accepted: float,
             max_tokens: int | None = None, num_seqs: int | None = None, batch: int | None = None) -> dict[int, int]:
        """Drafts to verify per candidate key. ``base_tokens``: the step's tokens without drafts;
        ``base_accepted``: the tokens it yields for sure (one per sampled sequence); ``num_seqs``: the
        step's sequences where it is all decodes (a graph's shape), else None; ``batch``: its decoding
        sequences (those of the candidates where not given), for the step-time curve of that size."""
        pairs, deepest = [], -1  # (-survival, position, key): survival as in :meth:`survival`, inlined (hot)
        table, top = self.calibrator.table(), self.calibrator.num_bins - 1
        for cand in candidates:
            s, key = 1.0, cand.key
            for j, c in enumerate(cand.confidences[: cand.room]):
                s *= table[max(0, min(top, int(c * (top + 1))))]
                pairs.append((-s, j, key))
            deepest = max(deepest, min(cand.room, len(cand.confidences)) - 1)
        pairs.sort()
        counts = {c.key: 0 for c in candidates}
        tokens, expected, longest = max(1, base_tokens), max(base_accepted, 1e-9), 1
        seconds, graph = self._pricer(num_seqs, len(candidates) if batch is None else batch)
        # where every span length has its graph, a step costs what its longest span costs, whatever its tokens
        by_graph = all(graph(j + 2) is not None for j in range(deepest + 1))
        cap = len(pairs) if max_tokens is None else max(0, max_tokens - tokens)
        step_seconds = seconds(tokens, longest)
        best, chosen, best_len = expected / step_seconds, [], 0
        for neg_s, j, key in pairs:
            if len(chosen) == cap:
                break
            if counts[key] != j:  # a later position only after the one before it
                continue
            counts[key], tokens, expected = j + 1, tokens + 1, expected - neg_s
            chosen.append(key)
            if not by_graph or j + 2 > longest:
                longest = max(longest, j + 2)
                step_seconds = seconds(tokens, longest)
            rate = expected / step_seconds
            if rate > best:
                best, best_len = rate, len(chosen)
        admitted = {c.key: 0 for c in candidates}
        for key in chosen[:best_len]:
            admitted[key] += 1
        return admitted

    def _pricer(self, num_seqs: int | None, batch: int
                ) -> tuple[Callable[[int, int], float], Callable[[int], float | None]]:
        """Seconds of a step by (tokens, longest span): its graph's where one holds it (``num_seqs``: a
        step of decodes only), else the learnt curve of its batch size; and the graph's seconds alone by
        longest span (None: no graph holds it)."""
        curve = self.step_time.curve(batch)
        graphs: dict[int, float | None] = {}

        def graph(longest: int) -> float | None:
            if self.profile is None or not num_seqs:
                return None
            if longest not in graphs:
                graphs[longest] = self.profile.lookup(num_seqs, longest)
            return graphs[longest]

        def seconds(num_tokens: int, longest: int) -> float:
            g = graph(longest)
            return curve(num_tokens) if g is None else g

        return seconds, graph

    def observe_step(self, num_tokens: int, seconds: float, num_seqs: int | None = None) -> None:
        self.step_time.observe(num_tokens, seconds, num_seqs)

    def observe_verification(self, confidences: list[float], num_accepted: int) -> None:
        self.calibrator.observe(confidences, num_accepted)

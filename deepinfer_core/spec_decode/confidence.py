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
step that verifies at most j drafts a sequence is priced, and run, as the 1 + j graph; and since drafts
below the longest span cost nothing more, such a step verifies every usable draft up to the best span
(:meth:`ConfidenceScheduler.best_span`: one pass over the drafts, no ranking of the pairs).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np


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
        self._table: np.ndarray | None = None

    def _bin(self, confidence: float) -> int:
        return min(self.num_bins - 1, max(0, int(confidence * self.num_bins)))

    def estimate(self, confidence: float) -> float:
        return self._estimate(self._bin(confidence))

    def _estimate(self, b: int) -> float:
        if self.tested[b] < self.min_tests:
            return 1.0
        centre = (b + 0.5) / self.num_bins
        return (self.accepted[b] + self.prior * centre) / (self.tested[b] + self.prior)

    def table(self) -> np.ndarray:
        """Every bin's estimate (for a planning pass: bin ``min(num_bins - 1, int(confidence * num_bins))``)."""
        if self._table is None:
            self._table = np.array([self._estimate(b) for b in range(self.num_bins)])
        return self._table

    def observe(self, confidences: list[float], num_accepted: int) -> None:
        """One verification of drafts with ``confidences``; only drafts whose prefix passed were tested."""
        top, self._table = self.num_bins - 1, None
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
    points and extrapolated from the last two; 1 s for any count before anything is measured."""

    def __init__(self, decay: float):
        self.decay = decay
        self.points: dict[int, tuple[float, float]] = {}  # bucket -> (mean tokens, mean seconds)
        self._xy: tuple[np.ndarray, np.ndarray, float] | None = None  # the sorted points and the last slope

    def observe(self, num_tokens: int, seconds: float) -> None:
        self._xy = None
        bucket, old = _bucket(num_tokens), self.points.get(_bucket(num_tokens))
        if old is None:
            self.points[bucket] = (float(num_tokens), seconds)
        else:
            d = self.decay
            self.points[bucket] = (d * old[0] + (1 - d) * num_tokens, d * old[1] + (1 - d) * seconds)

    def seconds(self, num_tokens: float | np.ndarray) -> float | np.ndarray:
        """Seconds at ``num_tokens``, a count or an array of them."""
        x = np.asarray(num_tokens, dtype=np.float64)
        if not self.points:
            y = np.ones_like(x)
        else:
            if self._xy is None:
                xs, ys = (np.array(v) for v in zip(*sorted(self.points.values())))
                slope = max(0.0, (ys[-1] - ys[-2]) / max(xs[-1] - xs[-2], 1e-9)) if len(xs) > 1 else 0.0
                self._xy = xs, ys, slope
            xs, ys, slope = self._xy
            y = np.interp(x, xs, ys) + slope * np.maximum(x - xs[-1], 0.0)
        return y if y.ndim else float(y)


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

    def curve(self, num_seqs: int | None = None) -> Callable[[float | np.ndarray], float | np.ndarray]:
        """Seconds against token count (a count or an array of them) for steps of ``num_seqs`` decoding
        sequences."""
        curve = self.by_seqs.get(_bucket(num_seqs)) if num_seqs else None
        if curve is not None and len(curve.points) >= 2:
            return curve.seconds
        return self.all.seconds


@dataclass(frozen=True)
class StepProfile:
    """Seconds of one replay of each captured decode graph, by (batch size, query length)."""

    seconds: dict[tuple[int, int], float] = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "_sizes", sorted({s for s, _ in self.seconds}))
        object.__setattr__(self, "_lengths", sorted({q for _, q in self.seconds}))
        object.__setattr__(self, "_rows", {})

    def lookup(self, num_seqs: int, longest: int) -> float | None:
        """The seconds of the graph a step of ``num_seqs`` sequences, the longest ``longest`` tokens, pads
        to; None where none holds it."""
        i, j = bisect.bisect_left(self._sizes, num_seqs), bisect.bisect_left(self._lengths, longest)
        if i == len(self._sizes) or j == len(self._lengths):
            return None
        return self.seconds.get((self._sizes[i], self._lengths[j]))

    def by_length(self, num_seqs: int) -> np.ndarray:
        """:meth:`lookup` of ``num_seqs`` sequences by longest span (the index), NaN where no graph holds
        it; the last entry is longer than any graph's."""
        row = self._rows.get(num_seqs)
        if row is None:
            longest = self._lengths[-1] if self._lengths else 0
            row = np.array([np.nan if (s := self.lookup(num_seqs, q)) is None else s for q in range(longest + 2)])
            self._rows[num_seqs] = row
        return row


_NO_GRAPH = np.array([np.nan])


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
        offers = [c.confidences[: c.room] for c in candidates]
        lengths = np.fromiter(map(len, offers), dtype=np.int64, count=len(offers))
        total = int(lengths.sum())
        tokens0, expected0 = max(1, base_tokens), max(base_accepted, 1e-9)
        cap = total if max_tokens is None else min(total, max(0, max_tokens - tokens0))
        if not cap:
            return {c.key: 0 for c in candidates}
        # every pair (candidate row, draft position) and its survival, as in :meth:`survival`
        row = np.repeat(np.arange(len(offers)), lengths)
        pos = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        top = self.calibrator.num_bins - 1
        conf = np.fromiter(itertools.chain.from_iterable(offers), dtype=np.float64, count=total)
        grid = np.ones((len(offers), int(lengths.max())))
        bins = (conf * (top + 1)).astype(np.int64)
        grid[row, pos] = self.calibrator.table()[np.minimum(np.maximum(bins, 0, out=bins), top, out=bins)]
        survival = np.cumprod(grid, axis=1)[row, pos]
        keys = np.fromiter((c.key for c in candidates), dtype=np.int64, count=len(candidates))
        # by descending survival (a later position never before its own earlier one: survival only falls
        # along a sequence's drafts, and ties go by position), the first ``cap`` pairs
        order = np.lexsort((keys[row], pos, -survival))[:cap]
        tokens = tokens0 + np.arange(1, cap + 1)
        expected = expected0 + np.cumsum(survival[order])
        longest = 2 + np.maximum.accumulate(pos[order])
        # each prefix's step: its graph's seconds by longest span where one holds it, else the learnt curve
        curve = self.step_time.curve(len(candidates) if batch is None else batch)
        graphs = self.profile.by_length(num_seqs) if self.profile is not None and num_seqs else _NO_GRAPH
        seconds = graphs[np.minimum(longest, len(graphs) - 1)]
        eager = np.isnan(seconds)
        if eager.any():
            seconds[eager] = curve(tokens[eager])
        rates = expected / seconds
        best, first = int(np.argmax(rates)), graphs[min(1, len(graphs) - 1)]
        best_len = best + 1 if rates[best] > expected0 / (curve(tokens0) if np.isnan(first) else first) else 0
        counts = np.bincount(row[order[:best_len]], minlength=len(candidates))
        return {c.key: int(n) for c, n in zip(candidates, counts)}

    def best_span(self, confidences: list[list[float]], rooms: list[int], max_tokens: int | None = None) -> int | None:
        """The span of an all-decode step of these sequences that a graph runs: each sequence verifies its
        first ``min(room, len(confidences), span)`` drafts. A graph pads every span to the step's longest,
        so below it a draft adds its survival at no cost: of :meth:`plan`'s admissions with a given longest
        span the best takes every usable draft up to it, and the k + 1 spans are all there is to compare.
        None where no graph holds some span or a step of every draft would pass ``max_tokens``
        (:meth:`plan` prices those)."""
        num_seqs = len(rooms)
        rooms = [min(room, len(conf)) for conf, room in zip(confidences, rooms)]
        k = max(rooms, default=0)
        if not k:
            return 0
        graphs = self.profile.by_length(num_seqs) if self.profile is not None else _NO_GRAPH
        if len(graphs) < k + 2 or (max_tokens is not None and num_seqs * (1 + k) > max_tokens):
            return None
        seconds = graphs[1:k + 2].tolist()
        if any(math.isnan(s) for s in seconds):
            return None
        table, bins = self.calibrator.table().tolist(), self.calibrator.num_bins
        table.append(table[-1])  # a confidence of 1 falls in the last bin
        gained = [0.0] * k  # expected accepted tokens of the drafts at each position
        for conf, room in zip(confidences, rooms):
            survival = 1.0
            for j in range(room):
                survival *= table[int(conf[j] * bins)]
                gained[j] += survival
        expected, best, best_rate = float(num_seqs), 0, num_seqs / seconds[0]
        for j in range(k):
            expected += gained[j]
            if expected / seconds[j + 1] > best_rate:
                best, best_rate = j + 1, expected / seconds[j + 1]
        return best

    def observe_step(self, num_tokens: int, seconds: float, num_seqs: int | None = None) -> None:
        self.step_time.observe(num_tokens, seconds, num_seqs)

    def observe_verification(self, confidences: list[float], num_accepted: int) -> None:
        self.calibrator.observe(confidences, num_accepted)

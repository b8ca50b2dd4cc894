"""SpeculationGate: whether a confidence-scheduled engine speculates at all in a step.

The confidence scheduler chooses how many drafts each step verifies, but drafting itself (the MTP
catch-up and draft steps, the undo log, the host's wait for the accepted counts) costs the same however
few it verifies. Where that fixed cost outweighs what verification gains (a large batch, a model with
few layers) the step is better off as a plain decode: no drafts, no MTP, the plain async pipeline.

The gate measures, per batch-size bucket (powers of two of decoding sequences), each mode's cost:
sequence-steps per second at the bucket's size, from the time of consecutive steps of that mode and
their sequences (:class:`_StepTime`: a graph's step takes as long for any batch of its bucket, but where
the host paces the steps their time grows with their sequences, and a closed batch's speculative tail
runs below the bucket's top while its plain steps all ran at it); and speculation's yield: output
tokens per sequence and step of the sequences the step did not end, over many steps (``yield_decay``:
a step's yield at batch 1 is anything from 1 to 1 + k, and a few of them decide nothing). A mode's
rate (output tokens per second) is the two multiplied (plain decode yields one token). It runs the
faster mode, measuring the other one for ``probe_steps`` steps now and then.
Probing costs the time the slower mode's steps take beyond what the faster one would take for their
tokens; the steps of the faster mode until the next probe are as many as keep that cost below
``probe_cost_share`` of the time (between ``probe_every`` and ``max_probe_every``). The first interval
after a bucket's exploration, and one after a probe that changed the faster mode, are ``probe_every``
long: one look at a mode's cost may be off (steps of a cold cache, another process on the device), and
the next probe re-measures it; the exploration's cost, as a probe's that waited for fresh rows (below),
only defers the next such probe. The first
``settle_steps`` of a run of one mode are left out (a switch drains the pipeline, and the first
speculative steps after plain ones have no drafts yet), and so is its last step where the run ends a
pipeline (:func:`step_begin`).

Only all-decode steps are measured. A step with prefill chunks (decided in the bucket of the batch it
leaves decoding), and the first ``probe_steps`` steps of a bucket not measured yet (the batch passing
through it, as when requests finish one by one), take the mode of the nearest bucket measured
(speculation where none is, and for prefill chunks where the bucket has no fresh yield yet: a prefill
chunk speculated writes the MTP block's rows of the prompt, without which drafts accept less for a
window); a bucket the batch stays in is measured (speculation first).

Plain steps leave the MTP block's window rows of their positions unwritten, so drafts accept less until
a sequence has gone a window past its last plain step. The yield is therefore measured only on steps
the engine says were ``fresh``, while any speculative step measures the cost. A probe of speculation
re-measures its cost and keeps the last yield; it waits for fresh steps (up to ``max_stale_steps`` more)
only every ``fresh_probe_every``-th probe once that deferral has passed, or while no yield is known.
Where speculation loses even at ``max_tokens_per_step`` (1 + k) tokens per sequence, a probe ends one
sample past its settling steps.
A bucket whose speculative steps are all stale (reached only after plain steps, with runs shorter than a
window) would never learn a yield and speculate blindly: after ``probe_steps - settle_steps`` stale
samples and no fresh one, their yield, a lower bound, stands in until a fresh one is measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def bucket(num_seqs: int) -> int:
    return 1 << max(0, num_seqs - 1).bit_length()


def step_begin(started: float, last_finish: float | None, pipelined: bool) -> float | None:
    """When a finished step's own time began: at its launch where the step before had finished by then (a
    synchronous or idle engine), at the step before's finish where it was launched earlier and a later
    step was launched before it finished (steps in flight together overlap); None for the last step of a
    pipeline (launched before the step before finished, nothing after it): from its launch its time holds
    the step before's too, from the step before's finish only the host's wait (a fraction of a step where
    the host's own work paces the pipeline)."""
    if last_finish is None or started >= last_finish:
        return started
    return last_finish if pipelined else None


@dataclass
class _Ratio:
    """num / den of decayed sums: older samples fade by ``decay`` a sample."""

    decay: float
    num: float = 0.0
    den: float = 0.0

    def add(self, num: float, den: float) -> float:
        self.num, self.den = self.decay * self.num + num, self.decay * self.den + den
        return self.num / self.den


@dataclass
class _StepTime:
    """A step's seconds as a function of its sequences, t(n) = t̄ + slope (n - n̄): t̄ and n̄ the means of the
    samples, older ones fading by ``decay`` a sample, and the slope fitted over a longer memory
    (``slope_decay``: how a step's time grows with its sequences is the machine's, a run's drain passes
    through a bucket's sizes in many steps). The slope is fitted only where those samples' sizes spread
    (``min_spread`` of their mean), and kept between a constant time (a graph's padded batch) and one
    proportional to the sequences; otherwise the time is taken as constant."""

    decay: float
    slope_decay: float = 0.97
    min_spread: float = 0.1
    level: list[float] = field(default_factory=lambda: [0.0] * 3)  # decayed count, sum n, sum t
    fit: list[float] = field(default_factory=lambda: [0.0] * 5)  # the same over the longer memory, sum n², n t

    def add(self, n: int, t: float) -> None:
        self.level = [self.decay * v + x for v, x in zip(self.level, (1, n, t))]
        self.fit = [self.slope_decay * v + x for v, x in zip(self.fit, (1, n, t, n * n, n * t))]

    def seconds(self, n: int) -> float:
        w, sn, st = self.level
        mean_n, mean_t = sn / w, st / w
        fw, fn, ft, fnn, fnt = self.fit
        fit_n, fit_t = fn / fw, ft / fw
        var = fnn / fw - fit_n ** 2
        if var <= (self.min_spread * fit_n) ** 2:
            return mean_t
        slope = min(max((fnt / fw - fit_n * fit_t) / var, 0.0), mean_t / mean_n)
        return mean_t + slope * (n - mean_n)


@dataclass
class _Bucket:
    seq_rate: dict[bool, float] = field(default_factory=dict)  # speculate -> sequence-steps per second at the size
    spec_yield: float | None = None  # output tokens per sequence of a fresh speculative step
    stale_yield: float | None = None  # the same of the stale ones (drafts from rows plain steps left)
    stale_samples: int = 0
    stale_after: int = 6  # stale samples after which stale_yield stands in for an unknown spec_yield
    steps: int = 0  # steps decided in this bucket
    best: bool | None = None  # the faster mode when the current interval began
    interval: int = 0  # steps of the faster mode between probes
    next_probe: int = 0  # the step at which the next probe begins
    probes: int = 0  # probes of speculation begun
    mode_steps: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})  # since the interval began
    probe_samples: int = 0  # samples of the slower mode taken in the current probe (fresh ones of speculation)
    fresh_due: int = 0  # the step before which a probe of speculation does not wait for fresh rows
    sums: dict[str, _Ratio] = field(default_factory=dict)  # the ratios behind the yields
    times: dict[bool, _StepTime] = field(default_factory=dict)  # speculate -> the step times behind seq_rate

    def rate(self, speculated: bool) -> float | None:
        """Output tokens per second, where known."""
        steps = self.seq_rate.get(speculated)
        if not speculated or steps is None:
            return steps
        yields = self.spec_yield
        if yields is None and self.stale_samples >= self.stale_after:
            yields = self.stale_yield
        return None if yields is None else steps * yields


class SpeculationGate:
    def __init__(self, probe_every: int = 64, probe_steps: int = 8, settle_steps: int = 2, decay: float = 0.7,
                 max_probe_every: int = 1024, max_tokens_per_step: int | None = None, max_stale_steps: int = 128,
                 fresh_probe_every: int = 4, probe_cost_share: float = 0.01, yield_decay: float = 0.95):
        if probe_steps <= settle_steps:
            raise ValueError("a probe must outlast the steps left out after a switch")
        if max_probe_every < probe_every:
            raise ValueError("max_probe_every must be at least probe_every")
        self.probe_every, self.probe_steps, self.settle_steps = probe_every, probe_steps, settle_steps
        self.max_probe_every, self.decay, self.yield_decay = max_probe_every, decay, yield_decay
        self.max_tokens_per_step, self.max_stale_steps = max_tokens_per_step, max_stale_steps
        self.fresh_probe_every, self.probe_cost_share = fresh_probe_every, probe_cost_share
        self.buckets: dict[int, _Bucket] = {}
        self.counts = {True: 0, False: 0}  # steps run per mode
        self._run: tuple[bool, int] | None = None  # (mode, bucket) of the current run of steps
        self._run_length = 0
        self._last_finish: float | None = None

    def decide(self, num_decoding: int, decode_only: bool = True) -> bool:
        """Whether the next step of ``num_decoding`` decoding sequences speculates; ``decode_only`` False:
        the step also has prefill chunks."""
        key = bucket(num_decoding)
        b = self._bucket(key)
        measured = self._best(b) is not None
        near = None if measured else self._nearest(key)
        if not decode_only or (not measured and b.steps < self.probe_steps and near is not None):
            if decode_only:
                b.steps += 1
            source = b if measured else near
            # the prompts' MTP rows written where nothing is measured, or where the batch will decode with no
            # fresh yield known yet (its first probe of speculation would wait a window for fresh rows)
            unknown_yield = not decode_only and b.spec_yield is None
            mode = source is None or unknown_yield or self._best(source)
        else:
            b.steps += 1
            spec = self._spec_rate(b)
            if True not in b.seq_rate or (spec is None and False in b.seq_rate):
                mode = True  # its cost unknown, or its yield where its best case might beat plain decode
            elif False not in b.seq_rate:
                mode = False
            else:
                mode = self._choose(b, spec)
            b.mode_steps[mode] += 1
        self.counts[mode] += 1
        return mode

    def _bucket(self, key: int) -> _Bucket:
        if key not in self.buckets:
            self.buckets[key] = _Bucket(stale_after=self.probe_steps - self.settle_steps)
        return self.buckets[key]

    def _best(self, b: _Bucket) -> bool | None:
        """Whether speculation is the faster mode in ``b``; None: not both measured."""
        spec, plain = self._spec_rate(b), b.rate(False)
        return None if spec is None or plain is None else spec >= plain

    def _nearest(self, size: int) -> _Bucket | None:
        """The measured bucket nearest bucket ``size`` (the smaller of two as near), other than itself."""
        known = [k for k, v in self.buckets.items() if k != size and self._best(v) is not None]
        if not known:
            return None
        return self.buckets[min(known, key=lambda k: (abs(k.bit_length() - size.bit_length()), k))]

    def _ceiling(self, b: _Bucket) -> float | None:
        """Speculation's rate were every draft accepted."""
        steps = b.seq_rate.get(True)
        return None if steps is None or not self.max_tokens_per_step else steps * self.max_tokens_per_step

    def _loses_anyway(self, b: _Bucket) -> bool:
        ceiling, plain = self._ceiling(b), b.rate(False)
        return ceiling is not None and plain is not None and ceiling < plain

    def _spec_rate(self, b: _Bucket) -> float | None:
        """Speculation's rate: its yield at its cost; its best case where that already loses; None: unknown."""
        rate = b.rate(True)
        if rate is None and self._loses_anyway(b):
            return self._ceiling(b)
        return rate

    def _choose(self, b: _Bucket, spec: float) -> bool:
        best = spec >= b.rate(False)
        if b.best is None or (b.steps >= b.next_probe + self._probe_length(b) and self._probed(b)):
            first, changed = b.best is None, b.best is not None and b.best != best  # an interval begins
            amortised = self._interval(b, best, spec)
            b.fresh_due = max(b.fresh_due, b.steps + amortised)
            b.interval = self.probe_every if first or changed else amortised
            b.best, b.next_probe, b.probe_samples = best, b.steps + b.interval, 0
            b.mode_steps = {True: 0, False: 0}
            b.probes += not best
        return (not b.best) if b.steps >= b.next_probe else b.best

    def _interval(self, b: _Bucket, best: bool, spec: float) -> int:
        """Steps of the faster mode whose time makes the slower mode's steps since the last interval began
        cost ``probe_cost_share`` of it: each cost its time less the faster mode's time for its tokens."""
        rate = {True: spec, False: b.rate(False)}
        step = {m: 1 / b.seq_rate[m] for m in (True, False)}  # seconds per sequence-step
        excess = b.mode_steps[not best] * step[not best] * (1 - rate[not best] / rate[best])
        steps = excess / (self.probe_cost_share * step[best])
        return round(min(max(steps, self.probe_every), self.max_probe_every))

    def _probe_length(self, b: _Bucket) -> int:
        """Steps a probe runs at least: one sample past the settling steps where speculation's cost alone
        rules it out (its best case lost before the probe and still does), else ``probe_steps``."""
        return self.settle_steps + 1 if b.best is False and self._loses_anyway(b) else self.probe_steps

    def _probed(self, b: _Bucket) -> bool:
        """Whether the probe running has measured the slower mode enough."""
        if b.best is True or self._loses_anyway(b):
            return True  # plain decode, or speculation's cost alone decides
        if b.spec_yield is not None and (b.probes % self.fresh_probe_every or b.steps < b.fresh_due):
            return True  # its cost re-measured, its last yield kept
        done = b.probe_samples >= self.probe_steps - self.settle_steps
        return done or b.steps >= b.next_probe + self.probe_steps + self.max_stale_steps

    def observe(self, speculated: bool, num_decoding: int, num_tokens: int, started: float, now: float,
                fresh: bool = True, pipelined: bool = True, num_yielding: int | None = None) -> None:
        """A finished all-decode step: its mode, sequences and output tokens, when it was launched and when
        it finished, (speculative) whether every sequence drafted from MTP rows it had written, and
        whether a later step was launched before it finished. Its time begins at :func:`step_begin`; the
        last step of a pipeline (before a switch of mode, a prefill or an idle engine) is not timed.
        ``num_yielding``: the sequences whose tokens ``num_tokens`` counts, where not all of them (a
        sequence that ends in the step, at ``max_tokens`` or a stop, or had ended before it, yields less
        than its drafts were worth and is left out of the yield)."""
        run = (speculated, bucket(num_decoding))
        if run != self._run:
            self._run, self._run_length = run, 0
        self._run_length += 1
        last, self._last_finish = self._last_finish, now
        begin = step_begin(started, last, pipelined)
        if self._run_length <= self.settle_steps or begin is None or now <= begin or not num_decoding:
            return
        b = self._bucket(run[1])
        times = b.times.setdefault(speculated, _StepTime(self.decay))
        times.add(num_decoding, now - begin)
        b.seq_rate[speculated] = run[1] / times.seconds(run[1])
        yielding = num_decoding if num_yielding is None else num_yielding
        if speculated and fresh and yielding:
            b.spec_yield = self._ratio(b, "fresh", self.yield_decay).add(num_tokens, yielding)
        elif speculated and yielding:
            b.stale_yield = self._ratio(b, "stale", self.yield_decay).add(num_tokens, yielding)
            b.stale_samples += 1
        if b.best is not None and speculated != b.best and (fresh or not speculated):
            b.probe_samples += 1

    @staticmethod
    def _ratio(b: _Bucket, name: str, decay: float) -> _Ratio:
        return b.sums.setdefault(name, _Ratio(decay))

    def interrupt(self) -> None:
        """A step that is not all decode: the next one's interval is not a decode step's."""
        self._run, self._run_length, self._last_finish = None, 0, None

    def as_dict(self) -> dict:
        rates = {b: {name: round(r, 1) for name, m in (("spec", True), ("plain", False))
                     if (r := v.rate(m)) is not None} for b, v in sorted(self.buckets.items())}
        return {"speculative_steps": self.counts[True], "plain_steps": self.counts[False],
                "probe_every": {b: v.interval for b, v in sorted(self.buckets.items()) if v.interval},
                "tokens_per_s": rates,
                "spec_tokens_per_seq_step": {b: round(v.spec_yield, 3) for b, v in sorted(self.buckets.items())
                                             if v.spec_yield is not None}}

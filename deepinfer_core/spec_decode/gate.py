"""SpeculationGate: whether a confidence-scheduled engine speculates at all in a step.

The confidence scheduler chooses how many drafts each step verifies, but drafting itself (the MTP
catch-up and draft steps, the undo log, the host's wait for the accepted counts) costs the same however
few it verifies. Where that fixed cost outweighs what verification gains (a large batch, a model with
few layers) the step is better off as a plain decode: no drafts, no MTP, the plain async pipeline.

The gate measures both: output tokens per second of consecutive speculative steps and of consecutive
plain steps, a running mean per batch-size bucket (powers of two of decoding sequences), and runs the
faster mode, measuring the other one for ``probe_steps`` steps after ``probe_every`` of the faster. A
probe that leaves the faster mode as it was doubles the bucket's interval, up to ``max_probe_every``
(probing costs the steps it runs in the slower mode); one that changes it starts again from
``probe_every``. The first ``settle_steps`` of a run of one mode are left out of its mean (a switch
drains the pipeline, and the first speculative steps after plain ones have no drafts yet).

Plain steps leave the MTP block's window rows of their positions unwritten, so drafts accept less
until a sequence has gone a window past its last plain step: a speculative step counts towards
speculation's rate only when the engine says its sequences were ``fresh``, and a probe of speculation
lasts until it has such steps (up to ``max_stale_steps`` more). With ``max_tokens_per_step`` (1 + k)
every speculative step also bounds speculation's rate, fresh or not: at most that many tokens per
sequence in the time the step took; a bound below plain decode's rate ends a probe at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def bucket(num_seqs: int) -> int:
    return 1 << max(0, num_seqs - 1).bit_length()


@dataclass
class _Bucket:
    rate: dict[bool, float] = field(default_factory=dict)  # speculate -> output tokens per second
    steps: int = 0  # steps decided in this bucket
    best: bool | None = None  # the faster mode when the current interval began
    interval: int = 0  # steps of the faster mode between probes
    next_probe: int = 0  # the step at which the next probe begins
    ceiling: float | None = None  # speculation's best possible rate by its step time
    probe_samples: int = 0  # samples of the slower mode taken in the current probe


class SpeculationGate:
    def __init__(self, probe_every: int = 64, probe_steps: int = 8, settle_steps: int = 2, decay: float = 0.7,
                 max_probe_every: int = 1024, max_tokens_per_step: int | None = None, max_stale_steps: int = 128):
        if probe_steps <= settle_steps:
            raise ValueError("a probe must outlast the steps left out after a switch")
        if max_probe_every < probe_every:
            raise ValueError("max_probe_every must be at least probe_every")
        self.probe_every, self.probe_steps, self.settle_steps = probe_every, probe_steps, settle_steps
        self.max_probe_every = max_probe_every
        self.max_tokens_per_step, self.max_stale_steps = max_tokens_per_step, max_stale_steps
        self.decay = decay
        self.buckets: dict[int, _Bucket] = {}
        self.counts = {True: 0, False: 0}  # steps run per mode
        self._run: tuple[bool, int] | None = None  # (mode, bucket) of the current run of steps
        self._run_length = 0
        self._last_finish: float | None = None

    def decide(self, num_decoding: int) -> bool:
        """Whether the next step of ``num_decoding`` decoding sequences speculates."""
        b = self.buckets.setdefault(bucket(num_decoding), _Bucket())
        b.steps += 1
        spec = self._spec_rate(b)
        if spec is None and (b.ceiling is None or False in b.rate):  # plain's rate may make the bound enough
            mode = True
        elif False not in b.rate:
            mode = False
        else:
            mode = self._choose(b, spec)
        self.counts[mode] += 1
        return mode

    def _spec_rate(self, b: _Bucket) -> float | None:
        """Speculation's rate: its fresh steps' mean, lowered to the bound of its step time; only the bound
        (no fresh step yet) where that already loses to plain decode; None: unknown."""
        rate, ceiling, plain = b.rate.get(True), b.ceiling, b.rate.get(False)
        if rate is not None:
            return rate if ceiling is None else min(rate, ceiling)
        return ceiling if ceiling is not None and plain is not None and ceiling < plain else None

    def _choose(self, b: _Bucket, spec: float) -> bool:
        best = spec >= b.rate[False]
        if b.best is None or (b.steps >= b.next_probe + self.probe_steps and self._probed(b)):
            same = b.best == best  # an interval begins
            b.interval = min(2 * b.interval, self.max_probe_every) if same else self.probe_every
            b.best, b.next_probe, b.probe_samples = best, b.steps + b.interval, 0
        return (not b.best) if b.steps >= b.next_probe else b.best

    def _probed(self, b: _Bucket) -> bool:
        """Whether the probe running has measured the slower mode enough."""
        if b.probe_samples >= self.probe_steps - self.settle_steps:
            return True
        if b.best is False:  # probing speculation: fresh steps may take a window's tokens to come
            bound = b.ceiling is not None and b.ceiling < b.rate[False]
            return bound or b.steps >= b.next_probe + self.probe_steps + self.max_stale_steps
        return True

    def observe(self, speculated: bool, num_decoding: int, num_tokens: int, started: float, now: float,
                fresh: bool = True) -> None:
        """A finished all-decode step: its mode, sequences and output tokens, when it was launched and when
        it finished, and (speculative) whether every sequence drafted from MTP rows it had written. Its
        time is from the later of its launch and the previous step's finish (steps in flight together
        overlap; an idle engine's wait is no step's)."""
        run = (speculated, bucket(num_decoding))
        if run != self._run:
            self._run, self._run_length = run, 0
        self._run_length += 1
        last, self._last_finish = self._last_finish, now
        begin = started if last is None else max(last, started)
        if self._run_length <= self.settle_steps or now <= begin:
            return
        b = self.buckets.setdefault(run[1], _Bucket())
        if speculated and self.max_tokens_per_step:
            b.ceiling = self._mean(b.ceiling, num_decoding * self.max_tokens_per_step / (now - begin))
        if speculated and not fresh:
            return
        b.rate[speculated] = self._mean(b.rate.get(speculated), num_tokens / (now - begin))
        if b.best is not None and speculated != b.best:
            b.probe_samples += 1

    def _mean(self, old: float | None, sample: float) -> float:
        return sample if old is None else self.decay * old + (1 - self.decay) * sample

    def interrupt(self) -> None:
        """A step that is not all decode: the next one's interval is not a decode step's."""
        self._run, self._run_length, self._last_finish = None, 0, None

    def as_dict(self) -> dict:
        return {"speculative_steps": self.counts[True], "plain_steps": self.counts[False],
                "probe_every": {b: v.interval for b, v in sorted(self.buckets.items()) if v.interval},
                "tokens_per_s": {b: {("spec" if m else "plain"): round(r, 1) for m, r in v.rate.items()}
                                 for b, v in sorted(self.buckets.items())},
                "spec_ceiling_tokens_per_s": {b: round(v.ceiling, 1) for b, v in sorted(self.buckets.items())
                                              if v.ceiling is not None}}

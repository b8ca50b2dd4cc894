"""VirtualClock: an engine's step timing from a cost model instead of the wall clock.

The engine's decisions that rest on measured time (the speculation gate, the confidence scheduler's
step-time curve) can then be replayed on any machine with the costs of another one: each step's host
and device seconds come from a :class:`StepCosts`, device work runs in launch order, and a wait for a
step's output (the engine's, or the runner's own for an unchained speculative step) moves the host
clock to that step's completion. The model's arithmetic still runs for real, so tokens, acceptance and
the engine's scheduling are the real ones; only the clock they are timed by is not.
"""

from __future__ import annotations

import contextlib
import math
import random
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from deepinfer_core.engine import llm_engine
from deepinfer_core.engine.scheduler_output import SchedulerOutput


def _decodes(s: Any) -> bool:
    """Whether a scheduled sequence decodes (its token and drafts) rather than prefills a chunk."""
    return s.sample and len(s.token_ids) == 1 + s.num_drafts


def is_decode(so: SchedulerOutput) -> bool:
    return bool(so.scheduled) and all(_decodes(s) for s in so.scheduled)


@dataclass(frozen=True)
class StepCosts:
    """Seconds of a step by its kind and its decoding sequences ``n``: a plain decode's device time is
    ``plain + plain_per_seq * (n - 1)``, a speculative decode's ``spec + spec_per_seq * (n - 1)`` (drafting
    and verification; what it verifies changes little in a graph); prefill chunks add ``prefill_per_token``
    a token (a step of prefill chunks only costs ``plain`` besides). Every step also costs ``host`` seconds
    of host work at its launch, and a step with prefill chunks ``eager_host`` more (it launches kernel by
    kernel, no graph). With ``graph_sizes`` an all-decode step of up to the largest runs as a graph padded
    to the next of them, and costs what that many sequences cost."""

    plain: float
    plain_per_seq: float
    spec: float
    spec_per_seq: float
    prefill_per_token: float = 2e-6
    host: float = 2e-4
    graph_sizes: tuple[int, ...] = ()
    eager_host: float = 0.0

    def device(self, so: SchedulerOutput, speculative: bool) -> float:
        """``speculative``: the step drafts (an engine with speculative decoding, in a speculative step)."""
        n = sum(map(_decodes, so.scheduled))
        prefill = self.prefill_per_token * sum(len(s.token_ids) for s in so.scheduled if not _decodes(s))
        if not n:
            return self.plain + prefill
        if not prefill and self.graph_sizes and n <= self.graph_sizes[-1]:
            n = min(size for size in self.graph_sizes if size >= n)
        base, per_seq = (self.spec, self.spec_per_seq) if speculative else (self.plain, self.plain_per_seq)
        return base + per_seq * (n - 1) + prefill

    @classmethod
    def parse(cls, text: str) -> StepCosts:
        """A name of :data:`VIRTUAL_COSTS`, or ``P1,P64,S1,S64``: milliseconds of a plain and a speculative
        decode step at batch 1 and 64."""
        if text in VIRTUAL_COSTS:
            return VIRTUAL_COSTS[text]
        try:
            p1, p64, s1, s64 = (float(v) * 1e-3 for v in text.split(","))
        except ValueError:
            raise ValueError(f"step costs {text!r}: expected one of {sorted(VIRTUAL_COSTS)} or four "
                             "comma-separated milliseconds P1,P64,S1,S64") from None
        return cls.fit({1: p1, 64: p64}, {1: s1, 64: s64})

    @classmethod
    def fit(cls, plain: dict[int, float], spec: dict[int, float], **kw: Any) -> StepCosts:
        """Costs through two measured (batch size -> seconds per step) points of each kind."""
        (n0, p0), (n1, p1) = sorted(plain.items())[0], sorted(plain.items())[-1]
        (m0, s0), (m1, s1) = sorted(spec.items())[0], sorted(spec.items())[-1]
        return cls(p0 - (p1 - p0) / (n1 - n0) * (n0 - 1), (p1 - p0) / (n1 - n0),
                   s0 - (s1 - s0) / (m1 - m0) * (m0 - 1), (s1 - s0) / (m1 - m0), **kw)


#: Steps of the trained default model in bf16 on one H200 with async scheduling and CUDA graphs
#: (benchmarks/results/h200/spec_confidence_5fd37e3: plain decode 1.27 ms a step at batch 1 and
#: 2.75 ms at 64; chained k=3 speculative steps 2.66 ms and 9.95 ms).
H200_TRAINED = StepCosts.fit({1: 1.266e-3, 64: 2.751e-3}, {1: 2.664e-3, 64: 9.946e-3},
                             graph_sizes=(1, 2, 4, 8, 16, 32, 64))
#: The same on an H100 machine whose host paces the steps (benchmarks/results/h100/spec_cd9122d, end to
#: end: plain decode 1.24 ms a step at batch 1 and 3.31 ms at 64; k=3 2.70 ms and 7.69 ms), where k=3
#: wins at both ends. On another H100 host, steps with prompt chunks took 16-34 ms against 2.3-2.7 ms for
#: a graph's decode step at 64 (benchmarks/results/h100/spec_4e8d741, the step log): about 14 ms of eager
#: launches.
H100_TRAINED = StepCosts.fit({1: 1.238e-3, 64: 3.311e-3}, {1: 2.700e-3, 64: 7.690e-3}, eager_host=14e-3)
VIRTUAL_COSTS = {"h200-trained": H200_TRAINED, "h100-trained": H100_TRAINED}


class _Timed:
    """A launched step's output whose ``get_output`` moves the clock to the step's completion."""

    def __init__(self, clock: VirtualClock, output: Any, done: float):
        self._clock, self._done = clock, done
        self._get = output.get_output
        output.get_output = self.get_output  # the runner's own waits for the step go through it too

    def get_output(self):
        out = self._get()
        self._clock.now = max(self._clock.now, self._done)
        return out


class VirtualClock:
    """``jitter``: each step's device time is scaled by a log-normal factor of mean 1 and this sigma
    (seeded by ``seed``), as a real device's step times scatter (other processes, clocks, the host)."""

    def __init__(self, costs: StepCosts, jitter: float = 0.0, seed: int = 0):
        self.costs = costs
        self.jitter, self._rng = jitter, random.Random(seed)
        self.now = 0.0
        self.device_free = 0.0
        self.steps = {True: 0, False: 0}  # decode steps launched, by whether they speculated

    def perf_counter(self) -> float:
        return self.now

    def _launch(self, execute, so: SchedulerOutput, drafts: bool):
        output = execute(so)  # an unchained speculative step waits here for the step before (its clock too)
        self.now += self.costs.host + (0.0 if is_decode(so) else self.costs.eager_host)
        start = max(self.now, self.device_free)
        speculative = drafts and so.speculate
        scale = math.exp(self._rng.gauss(0.0, self.jitter) - self.jitter ** 2 / 2) if self.jitter else 1.0
        self.device_free = start + self.costs.device(so, speculative) * scale
        if is_decode(so):
            self.steps[speculative] += 1
        _Timed(self, output, self.device_free)
        return output

    @contextlib.contextmanager
    def attach(self, llm: Any) -> Iterator[VirtualClock]:
        """Time ``llm``'s engine (an LLM or an LLMEngine) by this clock inside the block."""
        engine = getattr(llm, "llm_engine", llm)
        runner = engine.runner
        execute = runner.execute_model
        drafts = engine.drafts is not None
        runner.execute_model = lambda so: self._launch(execute, so, drafts)
        real_time = llm_engine.time
        llm_engine.time = types.SimpleNamespace(perf_counter=self.perf_counter)
        try:
            yield self
        finally:
            llm_engine.time = real_time
            runner.execute_model = execute

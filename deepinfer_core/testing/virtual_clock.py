"""VirtualClock: an engine's step timing from a cost model instead of the wall clock.

The engine's decisions that rest on measured time (the speculation gate, the confidence scheduler's
step-time curve) can then be replayed on any machine with the costs of another one: each step's host
and device seconds come from a :class:`StepCosts`, device work runs in launch order, and a wait for a
step's output (the engine's, or the runner's own for an unchained speculative step) moves the host
clock to that step's completion. The model's arithmetic still runs for real, so tokens, acceptance and
the engine's scheduling are the real ones; only the clock they are timed by is not.

No machine's costs ship with the package: measured ones are data, a JSON file of named step costs read by
:func:`load_step_costs` (the repository keeps those of its benchmark machines in
``benchmarks/step_costs.json``).
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
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
    def parse(cls, text: str, named: Mapping[str, StepCosts] | None = None) -> StepCosts:
        """A name of ``named`` (e.g. :func:`load_step_costs`' tables), or ``P1,P64,S1,S64``: milliseconds
        of a plain and a speculative decode step at batch 1 and 64."""
        named = named or {}
        if text in named:
            return named[text]
        try:
            p1, p64, s1, s64 = (float(v) * 1e-3 for v in text.split(","))
        except ValueError:
            raise ValueError(f"step costs {text!r}: expected one of {sorted(named)} or four "
                             "comma-separated milliseconds P1,P64,S1,S64") from None
        return cls.fit({1: p1, 64: p64}, {1: s1, 64: s64})

    @classmethod
    def fit(cls, plain: dict[int, float], spec: dict[int, float], **kw: Any) -> StepCosts:
        """Costs through two measured (batch size -> seconds per step) points of each kind."""
        (n0, p0), (n1, p1) = sorted(plain.items())[0], sorted(plain.items())[-1]
        (m0, s0), (m1, s1) = sorted(spec.items())[0], sorted(spec.items())[-1]
        return cls(p0 - (p1 - p0) / (n1 - n0) * (n0 - 1), (p1 - p0) / (n1 - n0),
                   s0 - (s1 - s0) / (m1 - m0) * (m0 - 1), (s1 - s0) / (m1 - m0), **kw)


#: what a named entry of a step-costs file may hold besides ``plain_s`` and ``spec_s`` (and ``source``)
_FIT_OPTIONS = ("prefill_per_token", "host", "graph_sizes", "eager_host")


def load_step_costs(path: str | Path) -> dict[str, StepCosts]:
    """The named step costs of a JSON file: ``{name: {"plain_s": {batch: seconds, ...}, "spec_s": {...},
    [graph_sizes, eager_host, host, prefill_per_token,] "source": "where they were measured"}}``, each
    :meth:`StepCosts.fit` through its plain and speculative points (keys starting with ``_`` are notes)."""
    tables = json.loads(Path(path).read_text(encoding="utf-8"))
    costs = {}
    for name, entry in tables.items():
        if name.startswith("_"):
            continue
        unknown = set(entry) - {"plain_s", "spec_s", "source", *_FIT_OPTIONS}
        if unknown or not {"plain_s", "spec_s"} <= set(entry):
            raise ValueError(f"{path}: step costs {name!r} want plain_s and spec_s (and optionally "
                             f"{', '.join(_FIT_OPTIONS)}, source); got {sorted(entry)}")
        options = {k: tuple(v) if k == "graph_sizes" else v for k, v in entry.items() if k in _FIT_OPTIONS}
        costs[name] = StepCosts.fit({int(b): s for b, s in entry["plain_s"].items()},
                                    {int(b): s for b, s in entry["spec_s"].items()}, **options)
    return costs


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

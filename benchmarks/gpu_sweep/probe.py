"""Instrumentation of a running engine: what each forward computed, which experts it routed to, how long
the device spent in ``runner.execute`` and in the sampler (CUDA events, read once the run is over), and
how long each ``engine.step()`` call took on the wall clock."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks.bench_gpu_decode import record_routing
from benchmarks.gpu_sweep.costs import StepShape


class Clock:
    """Time marks on the device's own timeline (CUDA events) or the host's (elsewhere, where ops are
    synchronous); :meth:`seconds` is valid once the device has been synchronized."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start


@dataclass
class Forward:
    shape: StepShape
    padded_to: int | None = None
    routed: list[torch.Tensor] = field(default_factory=list)
    execute: tuple[Any, Any] | None = None
    execute_host_s: float = 0.0
    sample: tuple[Any, Any] | None = None
    sample_host_s: float = 0.0


class _TimedSampler:
    """Stands in for ``engine.sampler``: times each call, passes everything else through."""

    def __init__(self, sampler: Any, probe: EngineProbe):
        self._sampler, self._probe = sampler, probe

    def __call__(self, *args: Any, **kw: Any) -> Any:
        probe = self._probe
        if probe.capturing():
            return self._sampler(*args, **kw)
        start, t0 = probe.clock.mark(), time.perf_counter()
        out = self._sampler(*args, **kw)
        end, dt = probe.clock.mark(), time.perf_counter() - t0
        pending = next((f for f in reversed(probe.forwards) if f.sample is None), None)
        if pending is not None:
            pending.sample, pending.sample_host_s = (start, end), dt
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sampler, name)


class EngineProbe:
    """``with EngineProbe(engine) as probe:`` records a :class:`Forward` per ``runner.execute``; call
    :meth:`step` instead of ``engine.step()`` to get each call's wall time and forwards."""

    def __init__(self, engine: Any):
        self.engine, self.model = engine, engine.runner.model
        self.clock = Clock(self.model.device)
        self.forwards: list[Forward] = []
        self.calls: list[tuple[float, int, int]] = []  # (wall seconds, first forward, end forward)
        self._last = time.perf_counter()

    def capturing(self) -> bool:
        return self.clock.cuda and torch.cuda.is_current_stream_capturing()

    def __enter__(self) -> EngineProbe:
        runner = self.engine.runner
        prepare, execute = runner.prepare, runner.execute

        def timed_prepare(token_ids, spans, logits_rows, *args, **kw):
            batch = prepare(token_ids, spans, logits_rows, *args, **kw)
            shape = StepShape([(s.context_len, s.num_new) for s in spans], len(logits_rows))
            self.forwards.append(Forward(shape, getattr(batch, "padded_to", None)))
            return batch

        def timed_execute(batch, *args, **kw):
            if self.capturing() or not self.forwards or self.forwards[-1].execute is not None:
                return execute(batch, *args, **kw)
            fwd = self.forwards[-1]
            start, t0 = self.clock.mark(), time.perf_counter()
            out = execute(batch, *args, **kw)
            fwd.execute, fwd.execute_host_s = (start, self.clock.mark()), time.perf_counter() - t0
            return out

        runner.prepare, runner.execute = timed_prepare, timed_execute
        self._sampler = runner.sampler
        runner.sampler = _TimedSampler(runner.sampler, self)
        self._routing = record_routing(self.model, self._on_route)
        self._routing.__enter__()
        self._last = time.perf_counter()
        return self

    def _on_route(self, ids: torch.Tensor) -> None:
        if self.forwards:
            self.forwards[-1].routed.append(ids)

    def __exit__(self, *exc: Any) -> None:
        self._routing.__exit__(*exc)
        self.engine.runner.sampler = self._sampler
        for name in ("prepare", "execute"):
            self.engine.runner.__dict__.pop(name, None)
        if self.clock.cuda:
            torch.cuda.synchronize(self.model.device)

    def step(self) -> list[Any]:
        first = len(self.forwards)
        outs = self.engine.step()
        now = time.perf_counter()
        self.calls.append((now - self._last, first, len(self.forwards)))
        self._last = now
        for out in outs:
            if getattr(out, "error", None):
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
        return outs

    def timings(self, fwd: Forward) -> dict[str, float | None]:
        """Seconds of a forward's parts; after ``__exit__`` (the device is synchronized then)."""
        sec = self.clock.seconds
        return {
            "forward_s": sec(*fwd.execute) if fwd.execute else None,
            "execute_host_s": fwd.execute_host_s if fwd.execute else None,
            "sample_s": sec(*fwd.sample) if fwd.sample else None,
            "sample_host_s": fwd.sample_host_s if fwd.sample else None,
        }

    def unique_experts(self, fwd: Forward, num_moe_layers: int) -> list[int] | None:
        """Distinct experts per MoE layer, or None when routing was not seen (a replayed graph)."""
        if len(fwd.routed) != num_moe_layers:
            return None
        return [int(torch.unique(ids).numel()) for ids in fwd.routed]

"""Decode and prefill runs through the engine, one step record per forward, with the step's floors."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from benchmarks.gpu_sweep.costs import ModelCost, floors
from benchmarks.gpu_sweep.probe import EngineProbe

CONFIG_FLAGS = ("graphs", "eager", "async", "fp8")


@dataclass(frozen=True)
class EngineConfig:
    """A named engine variant: ``graphs`` or ``eager``, optionally ``+async`` and ``+fp8``."""

    name: str

    def __post_init__(self) -> None:
        flags = self.name.split("+")
        unknown = [f for f in flags if f not in CONFIG_FLAGS]
        if unknown or ("graphs" in flags) == ("eager" in flags) or len(set(flags)) != len(flags):
            raise ValueError(f"engine config {self.name!r}: want graphs|eager, then optional +async, +fp8")

    @property
    def fp8(self) -> bool:
        return "fp8" in self.name.split("+")

    def engine_args(self) -> dict[str, Any]:
        flags = self.name.split("+")
        args: dict[str, Any] = {"enforce_eager": "eager" in flags, "async_scheduling": "async" in flags}
        if self.fp8:
            args["quantization"] = "fp8"
        return args


def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _step_row(probe: EngineProbe, cost: ModelCost, index: int, wall: float) -> dict[str, Any]:
    fwd = probe.forwards[index]
    shape = fwd.shape
    row: dict[str, Any] = {"wall_s": wall, "tokens": shape.num_tokens, "seqs": len(shape.spans),
                           "context": max(c + n for c, n in shape.spans), "padded_to": fwd.padded_to}
    row |= probe.timings(fwd)
    parts = [row["forward_s"], row["sample_s"]]
    row["other_s"] = max(wall - sum(p for p in parts if p is not None), 0.0)
    row["flops"] = cost.flops(shape)
    row["kv_bytes"] = cost.kv_bytes(shape)
    row["unique_experts"] = probe.unique_experts(fwd, len(cost.moe_layers))
    return row


def _drive(engine: Any, probe: EngineProbe, expected: int, desc: str) -> None:
    """Step until every request is done; more than a few times the expected steps is a hung engine."""
    with tqdm(total=expected, desc=desc, unit="step", leave=False) as bar:
        while engine.has_unfinished_requests():
            if len(probe.calls) > 4 * expected + 16:
                raise RuntimeError(f"{desc}: requests unfinished after {len(probe.calls)} steps")
            probe.step()
            bar.update(1)


def run_decode(engine: Any, cost: ModelCost, batch: int, prompts: list[list[int]], gen_len: int,
               tag: str) -> list[dict[str, Any]]:
    """Step records of the forwards where all ``batch`` sequences decode one token.

    Sequences prefilled in earlier chunks start decoding before the last ones are prefilled, so each
    asks for enough extra tokens that ``gen_len`` all-decode steps follow the prefill.
    """
    from deepinfer_core.sampling.params import SamplingParams

    chunks = -(-batch * len(prompts[0]) // engine.scheduler_config.max_num_batched_tokens)
    n = gen_len + chunks + 1
    # no min_tokens: a sequence under its min_tokens needs its last token on the host, so async scheduling
    # would not overlap; ignore_eos alone keeps every sequence going to max_tokens
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": ids}, params)
    with EngineProbe(engine) as probe:
        _drive(engine, probe, n + chunks, f"{tag} decode b={batch}")
    rows = []
    for wall, first, end in probe.calls:
        if end - first == 1 and probe.forwards[first].shape.is_decode(batch):
            rows.append(_step_row(probe, cost, first, wall))
    return rows


def run_prefill(engine: Any, cost: ModelCost, prompts: list[list[int]], tag: str) -> list[list[dict[str, Any]]]:
    """Per prompt, run alone to its first token: the records of its chunks (the first prompt warms up)."""
    from deepinfer_core.sampling.params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    runs = []
    chunk = engine.scheduler_config.max_num_batched_tokens
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": ids}, params)
        with EngineProbe(engine) as probe:
            _drive(engine, probe, -(-len(ids) // chunk), f"{tag} prefill chunk={chunk}")
        rows: list[dict[str, Any]] = []
        for wall, first, end in probe.calls:
            if end - first == 1:
                rows.append(_step_row(probe, cost, first, wall))
            elif end == first and rows:
                # with async scheduling the call that launches nothing waits for the last chunk: its time
                # belongs to that chunk, or the prompt's time would end before its own last forward
                rows[-1]["wall_s"] += wall
                rows[-1]["other_s"] += wall
        runs.append(rows)
    return runs


def fill_floors(rows: list[dict[str, Any]], cost: ModelCost, bandwidth: float, matmul_flops: float,
                borrowed: list[list[int] | None] | None = None) -> None:
    """Weight bytes and floors of each step record. Steps whose routing was not seen (graph replays) use
    ``borrowed[i]`` (the same step of a run that saw it), else the uniform-routing expectation."""
    for i, row in enumerate(rows):
        unique, source = row["unique_experts"], "recorded"
        if unique is None and borrowed is not None and i < len(borrowed) and borrowed[i] is not None:
            unique, source = borrowed[i], "borrowed"
        if unique is None:
            unique, source = cost.expected_unique_experts(row["tokens"]), "expected"
        row["routing"] = source
        row["weight_bytes"] = cost.weight_bytes(row["tokens"], unique)
        row |= floors(row["weight_bytes"], row["kv_bytes"], row["flops"], bandwidth, matmul_flops)
        row["step_over_floor"] = row["wall_s"] / row["floor_s"]


def summarize_decode(rows: list[dict[str, Any]], batch: int, warmup: int) -> dict[str, Any]:
    """Medians over the all-decode steps after the first ``warmup``."""
    timed = rows[warmup:] if len(rows) > warmup else rows
    if not timed:
        return {"steps": 0}
    med = {k: _median([r[k] for r in timed]) for k in (
        "wall_s", "forward_s", "execute_host_s", "sample_s", "sample_host_s", "other_s",
        "floor_s", "floor_bw_s", "floor_compute_s", "weight_bytes", "kv_bytes")}
    step = med["wall_s"]
    experts = [statistics.mean(r["unique_experts"]) for r in timed if r["unique_experts"]]
    return {
        "steps": len(timed),
        "step_ms": step * 1e3,
        "tok_s": batch / step,
        "per_user_tok_s": 1 / step,
        "forward_ms": _ms(med["forward_s"]),
        "execute_host_ms": _ms(med["execute_host_s"]),
        "sample_ms": _ms(med["sample_s"]),
        "sample_host_ms": _ms(med["sample_host_s"]),
        "other_ms": _ms(med["other_s"]),
        "floor_ms": med["floor_s"] * 1e3,
        "floor_bw_ms": med["floor_bw_s"] * 1e3,
        "floor_compute_ms": med["floor_compute_s"] * 1e3,
        "step_over_floor": step / med["floor_s"],
        "weight_gb": med["weight_bytes"] / 1e9,
        "kv_mb": med["kv_bytes"] / 1e6,
        "unique_experts_per_layer": statistics.mean(experts) if experts else None,
        "routing": sorted({r["routing"] for r in timed}),
    }


def summarize_prefill(rows: list[dict[str, Any]], matmul_flops: float) -> dict[str, Any]:
    """Throughput of one prompt's chunks, its FLOP rate as a fraction of the matmul rate, its floor."""
    wall = sum(r["wall_s"] for r in rows)
    flops = sum(r["flops"] for r in rows)
    floor = sum(r["floor_s"] for r in rows)
    tokens = sum(r["tokens"] for r in rows)
    return {
        "chunks": len(rows),
        "tokens": tokens,
        "time_ms": wall * 1e3,
        "tok_s": tokens / wall,
        "chunk_ms": statistics.median(r["wall_s"] for r in rows) * 1e3,
        "forward_ms": _ms(_median([r["forward_s"] for r in rows])),
        "tflops": flops / wall / 1e12,
        "matmul_fraction": flops / wall / matmul_flops,
        "floor_ms": floor * 1e3,
        "step_over_floor": wall / floor,
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3

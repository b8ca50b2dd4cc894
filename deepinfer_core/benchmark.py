"""Throughput of the engine against transformers' ``generate`` on the same model, prompts and dtype.

For each batch size, ``batch_size`` prompts of ``prompt_len`` random token ids (fixed seed; the
same ids for both) each generate exactly ``gen_len`` tokens greedily (the engine with
``ignore_eos=True``, transformers with ``min_new_tokens=max_new_tokens=gen_len``), in one timed run:

* prefill time: from the start until every request has its first generated token;
* decode time: the rest of the run, over the ``batch_size * (gen_len - 1)`` tokens generated after it;
* prefill throughput = ``batch_size * prompt_len / prefill time``, decode throughput likewise.

Each framework runs one untimed warm-up per batch size first (same shapes, two new tokens, its own
prompts), and every timed run gets fresh prompts so that prefix caching cannot skip prefill work.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass
class BenchConfig:
    model: str | None = None
    backend: str = "cpu_ref"
    dtype: str | None = None
    batch_sizes: Sequence[int] = (1, 32)
    prompt_len: int = 64
    gen_len: int = 32
    seed: int = 0
    repeats: int = 1
    warmup: bool = True
    hf: bool = True
    engine_args: dict[str, Any] | None = None


@dataclass
class Timing:
    prefill_s: float
    total_s: float
    output_token_ids: list[list[int]]


def make_prompts(batch_size: int, prompt_len: int, vocab_size: int, special: Sequence[int],
                 gen: torch.Generator) -> list[list[int]]:
    """Random prompts over the vocabulary minus the special (BOS/EOS) token ids."""
    skip = set(special)
    allowed = torch.tensor([t for t in range(vocab_size) if t not in skip])
    picks = torch.randint(0, len(allowed), (batch_size, prompt_len), generator=gen)
    return allowed[picks].tolist()


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def machine_info() -> dict[str, Any]:
    import transformers

    from deepinfer_core import __version__

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "deepinfer": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
        "load_average_at_start": _load_average(),
    }


# --- the two runners -------------------------------------------------------------------------------


def time_engine(llm: Any, prompts: list[list[int]], gen_len: int) -> Timing:
    """One run through the engine's step loop; prefill ends when every request has a token."""
    from deepinfer_core.sampling.params import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True)
    tag = f"bench-{time.monotonic_ns()}"
    rids = [f"{tag}-{i}" for i in range(len(prompts))]
    started: set[str] = set()
    final: dict[str, list[int]] = {}
    prefill_done = None
    t0 = time.perf_counter()
    for rid, ids in zip(rids, prompts):
        engine.add_request(rid, {"prompt_token_ids": ids}, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.error:
                raise RuntimeError(f"engine request {out.request_id} failed: {out.error}")
            if out.outputs and out.outputs[0].token_ids:
                started.add(out.request_id)
            if out.finished:
                final[out.request_id] = list(out.outputs[0].token_ids)
        if prefill_done is None and len(started) == len(rids):
            prefill_done = time.perf_counter()
    end = time.perf_counter()
    return Timing((prefill_done or end) - t0, end - t0, [final[r] for r in rids])


def time_hf(model: Any, prompts: list[list[int]], gen_len: int, pad_id: int) -> Timing:
    """One greedy ``generate``; prefill ends when the first logits reach the logits processors."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class Marker(LogitsProcessor):
        """Changes nothing; notes when generation first reaches the logits processors."""

        at: float | None = None

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            if self.at is None:
                self.at = time.perf_counter()
            return scores

    marker = Marker()
    ids = torch.tensor(prompts, dtype=torch.long, device=model.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=1,
            max_new_tokens=gen_len, min_new_tokens=gen_len, pad_token_id=pad_id,
            logits_processor=LogitsProcessorList([marker]),
        )
    end = time.perf_counter()
    return Timing((marker.at or end) - t0, end - t0, out[:, ids.shape[1]:].tolist())


# --- the benchmark ---------------------------------------------------------------------------------


def _rates(t: Timing, batch_size: int, prompt_len: int, gen_len: int) -> dict[str, Any]:
    decode_s = t.total_s - t.prefill_s
    decode_tokens = batch_size * (gen_len - 1)
    return {
        "prefill_s": t.prefill_s,
        "decode_s": decode_s,
        "total_s": t.total_s,
        "prefill_tokens": batch_size * prompt_len,
        "decode_tokens": decode_tokens,
        "prefill_tok_s": batch_size * prompt_len / t.prefill_s if t.prefill_s > 0 else None,
        "decode_tok_s": decode_tokens / decode_s if decode_tokens and decode_s > 0 else None,
        "total_tok_s": batch_size * gen_len / t.total_s if t.total_s > 0 else None,
    }


def _median(runs: list[Timing]) -> Timing:
    """Median prefill and median total time over the runs (each taken on its own)."""
    return Timing(statistics.median(t.prefill_s for t in runs), statistics.median(t.total_s for t in runs),
                  runs[0].output_token_ids)


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of generated tokens equal up to each sequence's first divergence (greedy runs)."""
    same = total = 0
    for x, y in zip(a, b):
        total += len(x)
        for p, q in zip(x, y):
            if p != q:
                break
            same += 1
    return same / total if total else 1.0


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def run_benchmark(cfg: BenchConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the benchmark and return its JSON-ready report."""
    from deepinfer_core.entrypoints.llm import LLM

    if cfg.prompt_len < 1 or cfg.gen_len < 1 or cfg.repeats < 1 or not cfg.batch_sizes:
        raise ValueError("prompt_len, gen_len and repeats must be >= 1 and batch_sizes non-empty")
    if any(b < 1 for b in cfg.batch_sizes):
        raise ValueError(f"batch sizes must be >= 1, got {list(cfg.batch_sizes)}")
    llm = LLM(model=cfg.model, backend=cfg.backend, dtype=cfg.dtype, **(cfg.engine_args or {}))
    engine = llm.llm_engine
    mcfg = engine.model_config
    path = mcfg.path
    eos = list(mcfg.eos_token_ids)
    special = sorted({*eos, getattr(mcfg, "bos_token_id", None)} - {None})
    max_len = engine.scheduler_config.max_model_len
    if cfg.prompt_len + cfg.gen_len > max_len:
        raise ValueError(f"prompt_len + gen_len = {cfg.prompt_len + cfg.gen_len} exceeds "
                         f"max_model_len {max_len}")
    hf_model = None
    if cfg.hf:
        from deepinfer_core.testing.tiny_model import load_hf_model

        t = time.perf_counter()
        hf_model = load_hf_model(path, engine.dtype)
        log(f"loaded the transformers model in {time.perf_counter() - t:.1f}s")
    report: dict[str, Any] = {
        "machine": machine_info(),
        "config": {
            "model": str(path) if cfg.model is not None else "embedded default (tiny)",
            "backend": cfg.backend,
            "dtype": str(engine.dtype).removeprefix("torch."),
            "device": str(engine.device),
            "batch_sizes": list(cfg.batch_sizes),
            "prompt_len": cfg.prompt_len,
            "gen_len": cfg.gen_len,
            "seed": cfg.seed,
            "repeats": cfg.repeats,
            "warmup": cfg.warmup,
            "engine_args": dict(cfg.engine_args or {}),
            "method": "prefill: start until every request has its first token; decode: the rest of the run "
                      "over batch*(gen_len-1) tokens; greedy, EOS ignored; median of `repeats` runs",
        },
        "results": [],
    }
    gen = torch.Generator().manual_seed(cfg.seed)
    for bs in cfg.batch_sizes:
        warm = make_prompts(bs, cfg.prompt_len, mcfg.vocab_size, special, gen)
        timed = [make_prompts(bs, cfg.prompt_len, mcfg.vocab_size, special, gen) for _ in range(cfg.repeats)]
        row: dict[str, Any] = {"batch_size": bs}
        if cfg.warmup:
            time_engine(llm, warm, min(2, cfg.gen_len))
        runs = [time_engine(llm, p, cfg.gen_len) for p in timed]
        eng = _median(runs)
        row["engine"] = _rates(eng, bs, cfg.prompt_len, cfg.gen_len)
        row["engine"]["runs"] = [{"prefill_s": t.prefill_s, "total_s": t.total_s} for t in runs]
        log(f"batch {bs}: engine prefill {row['engine']['prefill_s']:.2f}s, "
            f"total {row['engine']['total_s']:.2f}s")
        if hf_model is not None:
            if cfg.warmup:
                time_hf(hf_model, warm, min(2, cfg.gen_len), eos[0])
            hf_runs = [time_hf(hf_model, p, cfg.gen_len, eos[0]) for p in timed]
            hf = _median(hf_runs)
            row["transformers"] = _rates(hf, bs, cfg.prompt_len, cfg.gen_len)
            row["transformers"]["runs"] = [{"prefill_s": t.prefill_s, "total_s": t.total_s} for t in hf_runs]
            row["ratio"] = {k: _ratio(row["engine"][f"{k}_tok_s"], row["transformers"][f"{k}_tok_s"])
                            for k in ("prefill", "decode", "total")}
            row["greedy_token_agreement"] = _agreement(runs[0].output_token_ids, hf_runs[0].output_token_ids)
            log(f"batch {bs}: transformers prefill {row['transformers']['prefill_s']:.2f}s, "
                f"total {row['transformers']['total_s']:.2f}s")
        report["results"].append(row)
    report["machine"]["load_average_at_end"] = _load_average()
    return report


# --- presentation ----------------------------------------------------------------------------------


def _fmt(x: float | None, ratio: bool = False) -> str:
    if x is None:
        return "-"
    return f"{x:.2f}x" if ratio else f"{x:,.1f}"


def format_table(report: dict[str, Any]) -> str:
    """Throughput (tokens/s) side by side, with the engine/transformers ratio."""
    cfg = report["config"]
    has_hf = any("transformers" in r for r in report["results"])
    headers = ["batch", "prefill engine"]
    if has_hf:
        headers += ["prefill HF", "ratio"]
    headers += ["decode engine"]
    if has_hf:
        headers += ["decode HF", "ratio", "greedy agree"]
    rows = []
    for r in report["results"]:
        e, h, q = r["engine"], r.get("transformers"), r.get("ratio", {})
        cells = [str(r["batch_size"]), _fmt(e["prefill_tok_s"])]
        if has_hf:
            cells += [_fmt(h and h["prefill_tok_s"]), _fmt(q.get("prefill"), True)]
        cells += [_fmt(e["decode_tok_s"])]
        if has_hf:
            agree = r.get("greedy_token_agreement")
            cells += [_fmt(h and h["decode_tok_s"]), _fmt(q.get("decode"), True),
                      "-" if agree is None else f"{agree:.0%}"]
        rows.append(cells)
    widths = [max(len(c) for c in col) for col in zip(headers, *rows)]
    lines = [
        f"model {cfg['model']}, backend {cfg['backend']}, {cfg['dtype']} on {cfg['device']}, "
        f"prompt {cfg['prompt_len']} + gen {cfg['gen_len']} tokens, "
        f"{report['machine']['torch_threads']} torch threads; throughput in tokens/s"
        + ("; ratio = engine / transformers" if has_hf else ""),
        "  ".join(h.rjust(w) for h, w in zip(headers, widths)),
    ]
    lines += ["  ".join(c.rjust(w) for c, w in zip(cells, widths)) for cells in rows]
    machine = report["machine"]
    load, cpus = machine.get("load_average_at_start"), machine.get("cpu_count") or 1
    if load and machine["torch_threads"] > 1 and load[0] >= cpus:
        lines.append(f"note: load average {load[0]:.1f} on {cpus} CPUs at the start; multi-threaded torch "
                     "ops stall on a busy CPU (try --threads 1)")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str | Path) -> bool:
    """Bar charts of prefill and decode throughput; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    results = report["results"]
    labels = [str(r["batch_size"]) for r in results]
    has_hf = any("transformers" in r for r in results)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.4 if has_hf else 0.8
    xs = range(len(labels))
    for ax, kind in zip(axes, ("prefill", "decode")):
        eng = [r["engine"][f"{kind}_tok_s"] or 0 for r in results]
        ax.bar([x - (width / 2 if has_hf else 0) for x in xs], eng, width, label="deepinfer")
        if has_hf:
            hf = [(r.get("transformers") or {}).get(f"{kind}_tok_s") or 0 for r in results]
            ax.bar([x + width / 2 for x in xs], hf, width, label="transformers")
        ax.set_xticks(list(xs), labels)
        ax.set_xlabel("batch size")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"{kind} throughput")
        ax.legend()
    cfg = report["config"]
    fig.suptitle(f"{cfg['model']}, {cfg['backend']}, {cfg['dtype']}, "
                 f"prompt {cfg['prompt_len']}, gen {cfg['gen_len']}")
    fig.tight_layout()
    fig.savefig(str(path))
    plt.close(fig)
    return True

"""The sweep's outputs: sweep.json, summary.md (also printed), pareto.png and breakdown.png."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

BREAKDOWN_BATCHES = (1, 16, 64, 256)
PARTS = (("forward_ms", "forward (device)"), ("sample_ms", "sampling"), ("other_ms", "other host"))


def _f(value: Any, fmt: str) -> str:
    return format(value, fmt) if isinstance(value, (int, float)) else "-"


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" for _ in headers) + "|"]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def _by_key(rows: list[dict[str, Any]], key: str) -> dict[int, dict[str, Any]]:
    return {r[key]: r for r in rows}


def decode_rows(report: dict[str, Any]) -> list[list[str]]:
    hf = _by_key(report["transformers"]["decode"], "batch")
    rows = []
    for b in report["options"]["batch_sizes"]:
        h = hf.get(b, {})
        for name, res in report["configs"].items():
            r = _by_key(res["decode"], "batch").get(b)
            if r is None:
                continue
            s = r.get("summary", {})
            note = "error" if "error" in r else ",".join(s.get("routing", []))
            rows.append([str(b), name, _f(s.get("step_ms"), ".3f"), _f(s.get("tok_s"), ",.1f"),
                         _f(s.get("per_user_tok_s"), ",.1f"), _f(s.get("forward_ms"), ".3f"),
                         _f(s.get("sample_ms"), ".3f"), _f(s.get("other_ms"), ".3f"), _f(h.get("tok_s"), ",.1f"),
                         _f(s.get("engine_over_transformers"), ".2f"), _f(s.get("floor_ms"), ".3f"),
                         _f(s.get("step_over_floor"), ".2f"), note])
    return rows


def prefill_rows(report: dict[str, Any]) -> list[list[str]]:
    hf = _by_key(report["transformers"]["prefill"], "chunk")
    rows = []
    for chunk in report["options"]["chunk_sizes"]:
        h = hf.get(chunk, {})
        for name, res in report["configs"].items():
            r = _by_key(res["prefill"], "chunk").get(chunk)
            if r is None:
                continue
            s = r.get("summary", {})
            rows.append([str(chunk), name, _f(s.get("tok_s"), ",.0f"), _f(s.get("chunk_ms"), ".2f"),
                         _f(s.get("tflops"), ".3f"), _f(s.get("matmul_fraction"), ".1%"), _f(h.get("tok_s"), ",.0f"),
                         _f(s.get("engine_over_transformers"), ".2f"), _f(s.get("floor_ms"), ".2f"),
                         _f(s.get("step_over_floor"), ".2f"), "error" if "error" in r else ""])
    return rows


def goals(report: dict[str, Any], max_batch: int = 64, step_goal: float = 1.5,
          prefill_goal: float = 0.5) -> list[str]:
    """Per config: worst decode step/floor up to ``max_batch``, and the largest chunk's share of the matmul rate."""
    out = []
    for name, res in report["configs"].items():
        ratios = [r["summary"]["step_over_floor"] for r in res["decode"]
                  if r["batch"] <= max_batch and r.get("summary", {}).get("step_over_floor")]
        if ratios:
            verdict = "met" if max(ratios) <= step_goal else "not met"
            out.append(f"- {name}: decode step/floor at batch <= {max_batch}: worst {max(ratios):.2f}x "
                       f"(goal <= {step_goal}x: {verdict})")
        pre = [r for r in res["prefill"] if r.get("summary")]
        if pre:
            last = max(pre, key=lambda r: r["chunk"])
            frac = last["summary"]["matmul_fraction"]
            verdict = "met" if frac >= prefill_goal else "not met"
            out.append(f"- {name}: prefill chunk {last['chunk']}: {frac:.1%} of the matmul rate "
                       f"(goal >= {prefill_goal:.0%}: {verdict})")
    return out


def fp8_goals(report: dict[str, Any], batch: int = 64, step_goal: float = 0.65, prefill_goal: float = 1.3
              ) -> list[str]:
    """Per FP8 config against its bf16 config of the same run: the decode step at ``batch`` (or the largest
    batch below it) and the largest chunk's prefill tokens/s."""
    def figures(res: dict[str, Any], part: str, key: str, field: str) -> dict[int, float]:
        return {r[key]: r["summary"][field] for r in res[part] if r.get("summary", {}).get(field)}

    out, configs = [], report["configs"]
    for name, res in configs.items():
        base = configs.get(name.removesuffix("+fp8"))
        if not name.endswith("+fp8") or base is None:
            continue
        steps, ref = (figures(r, "decode", "batch", "step_ms") for r in (res, base))
        both = [b for b in steps if b in ref and b <= batch]
        if both:
            b = max(both)
            ratio = steps[b] / ref[b]
            verdict = "met" if ratio <= step_goal else "not met"
            out.append(f"- {name}: decode step at batch {b} {ratio:.2f}x the bf16 step "
                       f"(goal <= {step_goal}x at batch {batch}: {verdict})")
        tok, ref = (figures(r, "prefill", "chunk", "tok_s") for r in (res, base))
        both = [c for c in tok if c in ref]
        if both:
            c = max(both)
            ratio = tok[c] / ref[c]
            verdict = "met" if ratio >= prefill_goal else "not met"
            out.append(f"- {name}: prefill chunk {c} {ratio:.2f}x the bf16 tokens/s "
                       f"(goal >= {prefill_goal}x: {verdict})")
    return out


def errors(report: dict[str, Any]) -> list[str]:
    out = []
    for name, res in report["configs"].items():
        if "error" in res:
            out.append(f"- {name}: {res['error'].splitlines()[-1]}")
        for part, key in (("decode", "batch"), ("prefill", "chunk")):
            out += [f"- {name} {part} {key} {r[key]}: {r['error'].splitlines()[-1]}"
                    for r in res[part] if "error" in r]
    for part, key in (("decode", "batch"), ("prefill", "chunk")):
        out += [f"- transformers {part} {key} {r[key]}: {r['error'].splitlines()[-1]}"
                for r in report["transformers"][part] if "error" in r]
    return out


def markdown_summary(report: dict[str, Any]) -> str:
    env, opts, model = report["environment"], report["options"], report["model"]
    lines = [
        f"# deepinfer GPU sweep: {env.get('device')}",
        "",
        f"torch {env.get('torch')}, triton {env.get('triton')}, transformers {env.get('transformers')}; "
        f"copy bandwidth {env['copy_bandwidth_gb_s']:.0f} GB/s, {env['matmul_dtype']} matmul "
        f"{env['matmul_tflops']:.1f} TFLOP/s",
        f"model: {model['layers']} layers, hidden {model['hidden']}, {model['experts']} experts (top {model['topk']}), "
        f"{model['dtype']}, backend {model['backend']}; prompt {opts['prompt_len']}, {opts['gen_len']} decode steps",
        "",
    ]
    if report["configs"] and any(res["decode"] for res in report["configs"].values()):
        lines += ["## Decode (medians per step; ratio engine/transformers on tokens/s; floor = bytes/bandwidth "
                  "or FLOPs/matmul rate, whichever is larger)", ""]
        lines += _table(["batch", "config", "step ms", "tok/s", "tok/s/user", "forward ms", "sampling ms",
                         "other ms", "HF tok/s", "engine/HF", "floor ms", "step/floor", "routing"],
                        decode_rows(report))
        lines.append("")
    if report["configs"] and any(res["prefill"] for res in report["configs"].values()):
        lines += [f"## Prefill ({opts['prefill_len']}-token prompt in chunks; HF: one forward of `chunk` tokens)",
                  ""]
        lines += _table(["chunk", "config", "tok/s", "chunk ms", "TFLOP/s", "of matmul", "HF tok/s", "engine/HF",
                         "floor ms", "time/floor", "note"], prefill_rows(report))
        lines.append("")
    met = goals(report) + fp8_goals(report)
    if met:
        lines += ["## Goals", "", *met, ""]
    errs = errors(report)
    if errs:
        lines += ["## Errors", "", *errs, ""]
    return "\n".join(lines)


# --- plots -----------------------------------------------------------------------------------------


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _decode_series(report: dict[str, Any]) -> dict[str, list[tuple[int, float, float]]]:
    """Per config (and transformers): (batch, tokens/s per user, tokens/s of the batch)."""
    series = {}
    for name, res in report["configs"].items():
        pts = [(r["batch"], r["summary"]["per_user_tok_s"], r["summary"]["tok_s"])
               for r in res["decode"] if r.get("summary", {}).get("tok_s")]
        if pts:
            series[name] = pts
    hf = [(r["batch"], r["per_user_tok_s"], r["tok_s"]) for r in report["transformers"]["decode"] if r.get("tok_s")]
    if hf:
        series["transformers"] = hf
    return series


def plot_pareto(report: dict[str, Any], path: Path) -> bool:
    plt = _pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(8, 6))
    for name, pts in _decode_series(report).items():
        xs, ys = [p[1] for p in pts], [p[2] for p in pts]
        ax.plot(xs, ys, marker="o", linestyle="--" if name == "transformers" else "-", label=name)
        for b, x, y in pts:
            ax.annotate(str(b), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("per-user tokens/s (1 / step time)")
    ax.set_ylabel("output tokens/s (whole batch)")
    env = report["environment"]
    ax.set_title(f"decode, {env.get('device')}, prompt {report['options']['prompt_len']}; labels: batch size")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(str(path))
    plt.close(fig)
    return True


def breakdown_batches(report: dict[str, Any], wanted: tuple[int, ...] = BREAKDOWN_BATCHES) -> list[int]:
    measured = report["options"]["batch_sizes"]
    picked = [b for b in wanted if b in measured]
    if len(picked) < min(2, len(measured)):
        step = max(len(measured) // 4, 1)
        picked = measured[::step][:4]
    return picked


def plot_breakdown(report: dict[str, Any], path: Path) -> bool:
    plt = _pyplot()
    if plt is None:
        return False
    batches = breakdown_batches(report)
    names = list(report["configs"])
    fig, axes = plt.subplots(1, len(batches), figsize=(max(7, 4 * len(batches) + 1), 4.5), squeeze=False)
    for ax, b in zip(axes[0], batches):
        bottom = [0.0] * len(names)
        summaries = [_by_key(report["configs"][n]["decode"], "batch").get(b, {}).get("summary", {}) for n in names]
        for key, label in PARTS:
            vals = [s.get(key) or 0.0 for s in summaries]
            ax.bar(range(len(names)), vals, bottom=bottom, label=label)
            bottom = [x + v for x, v in zip(bottom, vals)]
        for i, s in enumerate(summaries):
            if s.get("step_ms"):
                ax.plot(i, s["step_ms"], "k_", markersize=18, label="wall step" if i == 0 else None)
            if s.get("floor_ms"):
                ax.plot(i, s["floor_ms"], "rv", label="floor" if i == 0 else None)
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
        ax.set_title(f"batch {b}")
        ax.set_ylabel("ms per decode step")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("decode step time per config (stacked parts; bar: wall step; triangle: floor)")
    fig.tight_layout()
    fig.savefig(str(path))
    plt.close(fig)
    return True


def draw_plots(report: dict[str, Any], out_dir: Path, log: Callable[[str], None] = print) -> list[Path]:
    """pareto.png and breakdown.png; none (with a message) when matplotlib is missing."""
    drawn = []
    for name, plot in (("pareto.png", plot_pareto), ("breakdown.png", plot_breakdown)):
        path = out_dir / name
        if not plot(report, path):
            log("matplotlib is not installed: plots skipped (redraw later with --plot-only sweep.json)")
            return drawn
        drawn.append(path)
    return drawn


def write_outputs(report: dict[str, Any], out_dir: Path, log: Callable[[str], None] = print) -> str:
    """sweep.json, summary.md and the plots under ``out_dir``; returns the markdown summary."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "sweep.json").write_text(json.dumps(report, indent=1) + "\n")
    summary = markdown_summary(report)
    (out_dir / "summary.md").write_text(summary + "\n")
    for path in draw_plots(report, out_dir, log):
        log(f"wrote {path}")
    log(f"wrote {out_dir / 'sweep.json'} and {out_dir / 'summary.md'}")
    return summary


def redraw(json_path: Path, out_dir: Path | None = None, log: Callable[[str], None] = print) -> list[Path]:
    """Plots (and summary.md) from a sweep.json, next to it unless ``out_dir`` is given."""
    report = json.loads(Path(json_path).read_text())
    out_dir = Path(out_dir) if out_dir else Path(json_path).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.md").write_text(markdown_summary(report) + "\n")
    return draw_plots(report, out_dir, log)

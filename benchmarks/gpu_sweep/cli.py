"""Command line of the sweep (``python benchmarks/sweep_gpu.py``, ``deepinfer bench --mode sweep``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import bench_gpu_decode as bgd
from benchmarks.gpu_sweep.sweep import DEFAULT_BATCHES, DEFAULT_CHUNKS, DEFAULT_CONFIGS, Sweep, SweepOptions

DEFAULT_OUT = Path("bench_results/gpu_sweep")
MODE_PARTS = {"sweep": ("decode", "prefill"), "decode": ("decode",), "prefill": ("prefill",)}


def int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"want comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"want integers >= 1, got {text!r}")
    return values


def name_list(text: str) -> tuple[str, ...]:
    from benchmarks.gpu_sweep.engine_runs import EngineConfig

    names = tuple(n.strip() for n in text.split(",") if n.strip())
    try:
        for n in names:
            EngineConfig(n)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return names


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description="Decode/prefill sweep of deepinfer engine configs against transformers and the floors, on "
                    "random V4-Flash-width weights. Model options (--small, --layers, --hidden, ..., --backend, "
                    "--device, --dtype, --seed) are those of benchmarks/bench_gpu_decode.py.")
    ap.add_argument("--out", type=Path, default=None,
                    help=f"folder for sweep.json, summary.md, pareto.png, breakdown.png (default {DEFAULT_OUT}; "
                         "with --plot-only: the JSON's folder)")
    ap.add_argument("--plot-only", type=Path, default=None, metavar="SWEEP_JSON",
                    help="only redraw the plots and summary.md from a sweep.json (into --out if given)")
    ap.add_argument("--mode", choices=tuple(MODE_PARTS), default="sweep", help="decode, prefill or both (sweep)")
    ap.add_argument("--configs", type=name_list, default=DEFAULT_CONFIGS,
                    help=f"engine configs (default {','.join(DEFAULT_CONFIGS)})")
    ap.add_argument("--fp8", action="store_true", help="also every config with FP8 weights (+fp8)")
    ap.add_argument("--batch-sizes", type=int_list, default=DEFAULT_BATCHES)
    ap.add_argument("--prompt-len", type=int, default=256, help="prompt tokens of the decode runs")
    ap.add_argument("--gen-len", type=int, default=64, help="all-decode steps per batch size")
    ap.add_argument("--chunk-sizes", type=int_list, default=DEFAULT_CHUNKS,
                    help="prefill chunks (max_num_batched_tokens)")
    ap.add_argument("--prefill-len", type=int, default=None, help="prefill prompt tokens (default: largest chunk)")
    ap.add_argument("--decode-batched-tokens", type=int, default=8192,
                    help="max_num_batched_tokens of the decode engines")
    ap.add_argument("--warmup-steps", type=int, default=3, help="decode steps per batch size left out of medians")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers")
    return ap


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    args, model_argv = build_parser().parse_known_args(argv)
    bgd.parse_args(model_argv)  # unknown options fail here, before anything is built
    return args, model_argv


def options_from_args(args: argparse.Namespace, model_argv: list[str]) -> SweepOptions:
    return SweepOptions(
        out=args.out or DEFAULT_OUT, modes=MODE_PARTS[args.mode], configs=args.configs, fp8=args.fp8,
        batch_sizes=args.batch_sizes, prompt_len=args.prompt_len, gen_len=args.gen_len,
        chunk_sizes=args.chunk_sizes, prefill_len=args.prefill_len,
        decode_batched_tokens=args.decode_batched_tokens, warmup_steps=args.warmup_steps, hf=not args.no_hf,
        model_argv=list(model_argv))


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run(opts: SweepOptions) -> dict[str, Any]:
    """The sweep; writes its outputs under ``opts.out`` and prints the markdown summary."""
    from benchmarks.gpu_sweep.report import write_outputs

    sweep = Sweep(opts, log)
    try:
        report = sweep.run()
    finally:
        sweep.close()
    print(write_outputs(report, Path(opts.out), log))
    return report


def main(argv: Sequence[str] | None = None) -> int:
    args, model_argv = parse_args(argv)
    if args.plot_only is not None:
        from benchmarks.gpu_sweep.report import redraw

        drawn = redraw(args.plot_only, args.out, log)
        for path in drawn:
            print(f"wrote {path}")
        return 0 if drawn else 1
    run(options_from_args(args, model_argv))
    return 0

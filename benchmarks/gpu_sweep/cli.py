"""Command line of the sweep (``python benchmarks/sweep_gpu.py``, ``deepinfer bench --mode sweep``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import bench_gpu_decode as bgd
from benchmarks.gpu_sweep.libraries import (
    KNOWN_LIBRARIES,
    MERGED_JSON,
    MERGED_MD,
    check_hidden,
    hidden_here,
    library_sets_arg,
    parse_library_set,
    run_library_sets,
)
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
    ap.add_argument("--libraries", type=library_sets_arg, default=None, metavar="SET,SET,...",
                    help="run the whole sweep once per set of DeepSeek's kernel libraries, each in its own process "
                         f"with the others ({', '.join(KNOWN_LIBRARIES)}) made unimportable: 'none' or names "
                         "joined by '+', e.g. none,flash_mla,flash_mla+deep_gemm; per set OUT/SET/sweep.json, "
                         f"merged into OUT/{MERGED_JSON} and OUT/{MERGED_MD} with ratios against 'none'")
    ap.add_argument("--library-set", default=None, help=argparse.SUPPRESS)  # set by --libraries in its children
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    return ap


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    parser = build_parser()
    args, model_argv = parser.parse_known_args(argv)
    if args.libraries is not None and args.plot_only is not None:
        parser.error("--libraries runs sweeps; --plot-only redraws one: give one of them")
    bgd.parse_args(model_argv)  # unknown options fail here, before anything is built
    return args, model_argv


def options_from_args(args: argparse.Namespace, model_argv: list[str]) -> SweepOptions:
    return SweepOptions(
        out=args.out or DEFAULT_OUT, modes=MODE_PARTS[args.mode], configs=args.configs, fp8=args.fp8,
        batch_sizes=args.batch_sizes, prompt_len=args.prompt_len, gen_len=args.gen_len,
        chunk_sizes=args.chunk_sizes, prefill_len=args.prefill_len,
        decode_batched_tokens=args.decode_batched_tokens, warmup_steps=args.warmup_steps, hf=not args.no_hf,
        model_argv=list(model_argv), library_set=args.library_set)


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
    if args.libraries is not None:
        return run_library_sets(args.libraries, args, model_argv, args.out or DEFAULT_OUT, log)
    if args.library_set is not None:
        leaked = check_hidden(dict.fromkeys((*parse_library_set(args.library_set).hidden, *hidden_here())))
        if leaked:  # the finder is not in force (e.g. python -S or -I): the set's figures would be wrong
            log(f"library set {args.library_set}: {', '.join(leaked)} should be hidden but can be imported")
            return 2
    import torch

    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        run(options_from_args(args, model_argv))
    finally:
        torch.set_num_threads(threads)
    return 0

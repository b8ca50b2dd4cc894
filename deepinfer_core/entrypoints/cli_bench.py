"""``deepinfer bench``: engine prefill/decode throughput against transformers' ``generate``."""

from __future__ import annotations

import argparse
import json
import sys

from deepinfer_core.entrypoints.cli_generate import UsageError, add_engine_arguments, engine_kwargs, fail


def _batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"want comma-separated integers, got {text!r}") from None
    if not sizes or any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"want batch sizes >= 1, got {text!r}")
    return sizes


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"want an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"want an integer >= 1, got {value}")
    return value


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    b = parser.add_argument_group("benchmark")
    b.add_argument("--batch-sizes", type=_batch_sizes, default=[1, 32], metavar="B,B,...",
                   help="batch sizes to measure (default: 1,32)")
    b.add_argument("--prompt-len", type=_positive, default=64, metavar="N",
                   help="prompt tokens (default: 64)")
    b.add_argument("--gen-len", type=_positive, default=32, metavar="N",
                   help="generated tokens per prompt (default: 32)")
    b.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default: 0)")
    b.add_argument("--repeats", type=_positive, default=1, metavar="N",
                   help="timed runs per batch size; medians are reported (default: 1)")
    b.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up runs")
    b.add_argument("--no-hf", action="store_true", help="measure the engine only, not transformers")
    b.add_argument("--threads", type=_positive, default=None, metavar="N",
                   help="torch CPU threads (default: torch's); tiny models on a busy CPU run faster with 1")
    b.add_argument("--json-out", default=None, metavar="FILE", help="also write the report as JSON to FILE")
    b.add_argument("--plot", default=None, metavar="FILE.png",
                   help="also draw the throughput (needs matplotlib)")


def run_bench(args: argparse.Namespace) -> int:
    try:
        kwargs = engine_kwargs(args)
    except UsageError as exc:
        return fail("bench", str(exc))
    import torch

    from deepinfer_core.benchmark import BenchConfig, format_table, plot, run_benchmark
    from deepinfer_core.plugins import PluginError

    threads_before = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, backend, dtype = kwargs.pop("model"), kwargs.pop("backend"), kwargs.pop("dtype")
    cfg = BenchConfig(model=model, backend=backend, dtype=dtype, batch_sizes=args.batch_sizes,
                      prompt_len=args.prompt_len, gen_len=args.gen_len, seed=args.seed, repeats=args.repeats,
                      warmup=not args.no_warmup, hf=not args.no_hf, engine_args=kwargs)

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    try:
        report = run_benchmark(cfg, log=log)
    except (ValueError, TypeError, FileNotFoundError, PluginError) as exc:
        return fail("bench", str(exc))
    finally:
        torch.set_num_threads(threads_before)
    print(format_table(report))
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=2)
            fh.write("\n")
        print(f"wrote {args.json_out}")
    if args.plot:
        if plot(report, args.plot):
            print(f"wrote {args.plot}")
        else:
            print("--plot skipped: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
    return 0

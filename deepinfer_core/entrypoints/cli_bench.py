"""``deepinfer bench``: engine prefill/decode throughput against transformers' ``generate``.

``--mode throughput`` (the default) runs :mod:`deepinfer_core.benchmark` on a checkpoint (the embedded
tiny model by default). ``--mode decode|prefill|sweep`` run the GPU sweep of a deepinfer source checkout
(its ``benchmarks/gpu_sweep``; ``--checkout DIR``, by default the current directory) on random
V4-Flash-width weights (``--small``: tiny widths, for a CPU); ``--libraries none,flash_mla,...`` runs them
once per set of DeepSeek's kernel libraries, each set in a process of its own, and merges the results.
The sweep is a benchmark script of the repository, not part of the installed package: the package loads
it from the checkout named, and only in those modes.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Any

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


MODES = ("throughput", "decode", "prefill", "sweep")
# --batch-sizes, --prompt-len, --gen-len defaults: throughput mode here, the sweep modes in benchmarks/gpu_sweep
THROUGHPUT_DEFAULTS = {"batch_sizes": [1, 32], "prompt_len": 64, "gen_len": 32}


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mode", choices=MODES, default="throughput",
                        help="throughput: engine vs transformers on a checkpoint (default); decode, prefill, sweep: "
                             "the GPU sweep on random V4-Flash-width weights (needs a source checkout)")
    add_engine_arguments(parser)
    b = parser.add_argument_group("benchmark")
    b.add_argument("--batch-sizes", type=_batch_sizes, default=None, metavar="B,B,...",
                   help="batch sizes to measure (default: 1,32; sweep modes: 1,2,4,...,256)")
    b.add_argument("--prompt-len", type=_positive, default=None, metavar="N",
                   help="prompt tokens (default: 64; sweep modes: 256)")
    b.add_argument("--gen-len", type=_positive, default=None, metavar="N",
                   help="generated tokens per prompt (default: 32; sweep modes: 64 all-decode steps)")
    b.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default: 0)")
    b.add_argument("--repeats", type=_positive, default=1, metavar="N",
                   help="timed runs per batch size; medians are reported (default: 1)")
    b.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up runs")
    b.add_argument("--no-hf", action="store_true", help="measure the engine only, not transformers")
    b.add_argument("--threads", type=_positive, default=None, metavar="N",
                   help="torch CPU threads, the engine's --cpu-threads unless given (default: the engine's "
                        "choice, 1 for small models)")
    b.add_argument("--json-out", default=None, metavar="FILE", help="also write the report as JSON to FILE")
    b.add_argument("--plot", default=None, metavar="FILE.png",
                   help="also draw the throughput (needs matplotlib)")
    w = parser.add_argument_group("sweep modes (--mode decode|prefill|sweep; engine options other than --backend, "
                                  "--device and --dtype do not apply)")
    w.add_argument("--checkout", default=None, metavar="DIR",
                   help="the deepinfer source checkout whose benchmarks/gpu_sweep the sweep modes run "
                        "(default: the current directory)")
    w.add_argument("--small", action="store_true", help="tiny widths instead of V4-Flash widths (CPU smoke test)")
    w.add_argument("--layers", type=_positive, default=None, metavar="N", help="decoder layers (default: 4)")
    w.add_argument("--configs", default=None, metavar="NAME,...",
                   help="engine configs: graphs|eager, optionally +async, +fp8 "
                        "(default: graphs+async,graphs,eager+async,eager)")
    w.add_argument("--fp8", action="store_true", help="also every config with FP8 weights")
    w.add_argument("--chunk-sizes", type=_batch_sizes, default=None, metavar="C,C,...",
                   help="prefill chunk sizes (default: 512,2048,8192)")
    w.add_argument("--prefill-len", type=_positive, default=None, metavar="N",
                   help="prefill prompt tokens (default: the largest chunk)")
    w.add_argument("--warmup-steps", type=int, default=None, metavar="N",
                   help="decode steps per batch size left out of the medians (default: 3)")
    w.add_argument("--libraries", default=None, metavar="SET,SET,...",
                   help="run the sweep once per set of DeepSeek's kernel libraries (flash_mla, deep_gemm, deep_ep), "
                        "each in its own process with the others made unimportable: 'none' or names joined by '+', "
                        "e.g. none,flash_mla,flash_mla+deep_gemm; per set DIR/SET/sweep.json, merged into "
                        "DIR/libraries.json and DIR/libraries.md with ratios against 'none'")
    w.add_argument("--out", default=None, metavar="DIR",
                   help="folder for sweep.json, summary.md and the plots (default: bench_results/gpu_sweep)")
    w.add_argument("--plot-only", default=None, metavar="SWEEP_JSON",
                   help="only redraw the plots and summary.md of a sweep.json (into --out if given)")


def load_sweep_cli(checkout: str | Path | None = None) -> Any:
    """``benchmarks.gpu_sweep.cli`` of the deepinfer source checkout ``checkout`` (default: the current
    directory), its root put on ``sys.path`` so that the sweep's own ``benchmarks`` imports resolve."""
    root = Path(checkout if checkout is not None else ".").resolve()
    if not (root / "benchmarks" / "gpu_sweep" / "cli.py").is_file():
        raise UsageError(f"the sweep modes run benchmarks/gpu_sweep of a deepinfer source checkout, and {root} has "
                         "none: run from the checkout's root or pass --checkout DIR")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module("benchmarks.gpu_sweep.cli")


def _sweep_argv(args: argparse.Namespace) -> list[str]:
    """The sweep's own command line for these options (it validates them)."""
    device = args.device or ("cuda" if args.backend != "cpu_ref" else "cpu")
    argv = ["--mode", args.mode, "--backend", args.backend, "--device", device, "--seed", str(args.seed)]
    if args.dtype not in (None, "auto"):
        argv += ["--dtype", args.dtype]
    for name in ("batch_sizes", "chunk_sizes"):
        value = getattr(args, name)
        if value is not None:
            argv += ["--" + name.replace("_", "-"), ",".join(map(str, value))]
    for name in ("prompt_len", "gen_len", "prefill_len", "warmup_steps", "layers", "configs", "libraries", "out",
                 "plot_only", "threads"):
        value = getattr(args, name)
        if value is not None:
            argv += ["--" + name.replace("_", "-"), str(value)]
    argv += [flag for flag, on in (("--small", args.small), ("--fp8", args.fp8), ("--no-hf", args.no_hf)) if on]
    return argv


def run_sweep_mode(args: argparse.Namespace) -> int:
    if args.backend == "cpu_ref" and args.device is None and not (args.small or args.plot_only):
        return fail("bench", f"--mode {args.mode} builds V4-Flash-width weights; on cpu_ref that takes hours: "
                             "pass a GPU backend (--backend nvidia_sm100), or --small for a CPU smoke test "
                             "(--device cpu runs it on cpu_ref anyway)")
    try:
        cli = load_sweep_cli(args.checkout)
    except UsageError as exc:
        return fail("bench", str(exc))
    import torch

    threads_before = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return cli.main(_sweep_argv(args))
    finally:
        torch.set_num_threads(threads_before)


def _transformers_knows(model: str | None) -> bool:
    """Whether transformers can build the checkpoint ``model`` (None: the default) to compare against: V4 yes,
    V4.1 (no transformers class) no. A folder that cannot be read is left to the benchmark to report."""
    from deepinfer_core.config import ModelConfig
    from deepinfer_core.default_model import default_model_path

    try:
        cfg = ModelConfig.from_pretrained(model or default_model_path())
    except Exception:
        return True
    return cfg.architecture.name != "DeepseekV41ForCausalLM"


def run_bench(args: argparse.Namespace) -> int:
    if args.mode != "throughput":
        return run_sweep_mode(args)
    for name, value in THROUGHPUT_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
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
        kwargs.setdefault("cpu_threads", args.threads)  # the engine sets its count: make it this one
    model, backend, dtype = kwargs.pop("model"), kwargs.pop("backend"), kwargs.pop("dtype")

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    hf = not args.no_hf
    if hf and not _transformers_knows(model):
        log("transformers has no implementation of this architecture (DeepSeek-V4.1): measuring the engine only")
        hf = False
    cfg = BenchConfig(model=model, backend=backend, dtype=dtype, batch_sizes=args.batch_sizes,
                      prompt_len=args.prompt_len, gen_len=args.gen_len, seed=args.seed, repeats=args.repeats,
                      warmup=not args.no_warmup, hf=hf, engine_args=kwargs)

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

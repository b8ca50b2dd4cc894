"""``deepinfer plan``: what each rank of a parallel layout will allocate (weights, routed experts, KV
pools), from the config and checkpoint headers alone, without loading the model."""

from __future__ import annotations

import argparse
import json

from deepinfer_core.entrypoints.cli_generate import UsageError, add_engine_arguments, engine_kwargs, fail


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--json", action="store_true", help="one JSON object per rank instead of a table")


def run_plan(args: argparse.Namespace) -> int:
    try:
        kwargs = engine_kwargs(args)
    except UsageError as exc:
        return fail("plan", str(exc))
    from deepinfer_core.engine.llm_engine import EngineArgs
    from deepinfer_core.parallel.memory_plan import plan_memory

    try:
        ranks = plan_memory(EngineArgs(**kwargs))
    except ValueError as exc:
        return fail("plan", str(exc))
    if args.json:
        print(json.dumps([r.as_dict() for r in ranks]))
        return 0
    mib = 2**20
    print(f"{'rank':>4} {'device':>6} {'experts':>7} {'weights MiB':>12} {'experts MiB':>12} {'KV MiB':>9} "
          f"{'blocks':>7} {'window':>7} {'slots':>6}")
    for r in ranks:
        print(f"{r.rank:>4} {r.device:>6} {r.expert_slots:>7} {r.weight_bytes / mib:>12.2f} "
              f"{r.expert_bytes / mib:>12.2f} {r.kv_bytes / mib:>9.2f} {r.num_blocks:>7} "
              f"{r.num_window_blocks:>7} {r.num_state_slots:>6}")
    r = ranks[0]
    print(f"KV bytes per token: {r.compressed_bytes_per_token:.1f} compressed (whole sequence) + "
          f"{r.window_bytes_per_token:.1f} window (sliding window), {r.kv_layout} entries of {r.entry_bytes} B; "
          f"dense entries: {r.dense_compressed_bytes_per_token:.1f} + {r.dense_window_bytes_per_token:.1f}")
    return 0

"""``deepinfer plan``: what each rank of a parallel layout will allocate (weights, routed experts, KV
pools), from the config and checkpoint headers alone, without loading the model; with ``CONFIG`` (a
config.json or a folder holding one, no weights needed), the model's footprint: weight bytes as stored
and as loaded, per rank over ``--devices``, KV per token by layer type, and what fits ``--device-memory``."""

from __future__ import annotations

import argparse
import json

from deepinfer_core.entrypoints.cli_generate import UsageError, add_engine_arguments, engine_kwargs, fail


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", default=None, metavar="CONFIG",
                        help="config.json (or its folder): the footprint from the config alone")
    parser.add_argument("--devices", type=int, default=1, metavar="N",
                        help="with CONFIG: ranks the routed experts are spread over (default 1)")
    parser.add_argument("--device-memory", type=float, default=None, metavar="GB",
                        help="with CONFIG: memory of one device in GB (1e9 bytes): what fits beside the weights")
    add_engine_arguments(parser)
    parser.add_argument("--json", action="store_true", help="one JSON object per rank instead of a table")


def run_footprint(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from deepinfer_core.config import ModelConfig
    from deepinfer_core.parallel.memory_plan import footprint

    path = Path(args.config)
    folder = path.parent if path.name == "config.json" else path
    if not (folder / "config.json").is_file():
        return fail("plan", f"no config.json at {args.config}")
    try:
        cfg = ModelConfig.from_pretrained(folder)
        memory = None if args.device_memory is None else int(args.device_memory * 1e9)
        fp = footprint(cfg, getattr(torch, args.dtype) if args.dtype not in (None, "auto") else torch.bfloat16,
                       args.numerics or "deepseek", args.devices, memory, args.block_size or 128, args.max_model_len,
                       args.num_redundant_experts or 0)
    except ValueError as exc:
        return fail("plan", str(exc))
    if args.json:
        print(json.dumps(fp.as_dict()))
        return 1 if fp.device_memory is not None and not fp.longest_context else 0
    gb = 1e9
    print(f"weights: {fp.stored_bytes:,} B as stored ({fp.stored_expert_bytes / gb:.1f} GB routed experts), "
          f"{fp.loaded_bytes:,} B as loaded ({fp.dequantised_bytes / gb:.1f} GB dequantised)")
    if fp.table_bytes:
        print(f"  of which {fp.table_bytes:,} B lookup tables kept FP8 (Engram); where each --engram-placement "
              "puts them:")
        print(f"  {'placement':<15} {'device GB/rank':>14} {'host GB/node':>12} {'fits':>5}  how")
        for e in fp.engram:
            fits = "-" if e.fits is None else ("yes" if e.fits else "no")
            print(f"  {e.placement:<15} {e.device_bytes_per_rank / gb:>14.2f} {e.host_bytes_per_node / gb:>12.2f} "
                  f"{fits:>5}  {e.note}")
    print(f"per rank over {fp.devices} device(s) (Engram tables on the device)"
          + (f" with {args.num_redundant_experts} redundant experts" if args.num_redundant_experts else "")
          + f": {fp.rank_bytes / gb:.2f} GB")
    print(f"{'layers':>8} {'kind':>8} {'KV B/token':>11} {'window B/token':>15}")
    for k in fp.kv:
        print(f"{k.layers:>8} {k.kind:>8} {k.compressed_bytes_per_token:>11.2f} {k.window_bytes_per_token:>15.1f}")
    print(f"KV per token: {fp.compressed_bytes_per_token:.2f} B (whole sequence); per sequence: "
          f"{fp.window_bytes_per_seq:,} B window pools (the last sliding_window tokens) + "
          f"{fp.state_bytes_per_seq:,} B compressor state")
    if fp.device_memory is not None:
        print(f"on {fp.device_memory / gb:.0f} GB devices: one sequence of up to {fp.longest_context:,} tokens, "
              f"or {fp.max_seqs} of {fp.context:,} tokens per rank (activations not counted)")
    for note in fp.notes:
        print(note)
    if fp.device_memory is not None and not fp.longest_context:  # nothing fits: a script must see it
        return 1
    return 0


def run_plan(args: argparse.Namespace) -> int:
    if args.config is not None:
        return run_footprint(args)
    try:
        kwargs = engine_kwargs(args)
    except UsageError as exc:
        return fail("plan", str(exc))
    from deepinfer_core.engine.args import EngineArgs
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

"""Expert parallel's decode step, eager against CUDA graphs, on one rank: the MoE dispatch and combine
inside the captured graphs.

    python benchmarks/bench_ep_graphs.py --backend nvidia_sm100 \\
        --device cuda --batch-sizes 1,16,64 --out ep_graphs.json

A random model at V4-Flash widths (``bench_gpu_decode.RandomModel``: ``--layers`` layers, 256 experts, top 6)
served by three engines over the same weights, in one process that is a world of one rank:

- ``plain``: no expert parallel (the reference for the tokens and the step);
- ``ep eager``: the backend's expert dispatcher (``deepinfer_make_ep_dispatcher``: DeepEP where ``deep_ep``
  imports, its ``DEEPINFER_DEEPEP_MODE``, ``auto`` by default: normal kernels eagerly, low-latency ones in
  graphs; else all_to_all) on every MoE layer, eagerly;
- ``ep graphs``: the same dispatcher inside the decode graphs (captured on a device that has them, else run
  uncaptured through the padded graph layouts); the dispatcher runs at fixed shapes there.

Per batch size: the median decode step (every sequence decoding; timed from the host, a synchronous
engine's step returns once the device is done) and ``ep eager`` / ``ep graphs``; and whether each engine's
greedy tokens equal ``plain``'s. A world of one rank exchanges nothing over a link: this measures what the
dispatcher's kernels and the host cost a step, not the network. Prints a table and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gpu_decode as bgd  # noqa: E402

MODES = ("plain", "ep eager", "ep graphs")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="cpu_ref")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on an accelerator, float32 on the CPU")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--small", action="store_true", help="tiny widths (a CPU smoke run)")
    ap.add_argument("--batch-sizes", type=lambda v: [int(x) for x in v.split(",")], default=[1, 16, 64])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per batch")
    ap.add_argument("--warmup", type=int, default=3, help="decode steps run before timing")
    ap.add_argument("--check-tokens", type=int, default=8, help="greedy tokens compared across the engines")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def one_rank_world(device: torch.device, store: Path) -> None:
    if device.type == "cuda" and device.index is None:  # NCCL binds the group to one numbered device
        device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{store}", rank=0,
                            world_size=1, **({"device_id": device} if device.type == "cuda" else {}))


def with_graphs(engine, hook, sizes: list[int]) -> str:
    """Give ``engine`` decode graphs of ``sizes`` sequences built around its model as it is now (with the
    dispatcher): captured where the platform can, else the padded layouts run uncaptured. Which it got."""
    from deepinfer_core.parallel.batch_sync import coordinator_for

    if not engine.platform.supports_graphs:
        from deepinfer_core.testing.uncaptured_graphs import install_uncaptured_graphs

        install_uncaptured_graphs(engine, sizes)  # counts its replays (graph_counts)
        return "uncaptured"
    runner = hook.deepinfer_graph_runner(model=engine.model, cache=engine.cache, capture_sizes=sizes,
                                         max_model_len=engine.scheduler_config.max_model_len,
                                         block_size=engine.args.block_size, platform=engine.platform,
                                         query_lens=(1,), keep_streams=False, prologue=None)
    if runner is None:
        raise SystemExit("the backend captures no decode graphs")
    runner.coordinator = coordinator_for(engine.model)
    engine.runner.graph_runner = runner
    return "captured"


def greedy_tokens(engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    from deepinfer_core.entrypoints.llm import LLM
    from deepinfer_core.sampling.params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in LLM.from_engine(engine).generate(prompts, params, use_tqdm=False)]


def main(argv=None) -> dict:
    from deepinfer_core.plugins import load_backend

    a = parse_args(argv)
    device = torch.device(a.device)
    dtype_name = a.dtype or ("float32" if device.type == "cpu" else "bfloat16")
    longest = a.prompt_len + a.warmup + a.steps + a.check_tokens + 16
    gen = ["--gen-len", str(longest - a.prompt_len)]
    ra = bgd.parse_args(["--backend", a.backend, "--device", a.device, "--dtype", dtype_name, "--layers",
                         str(a.layers), "--prompt-len", str(a.prompt_len), *gen] + ["--small"] * a.small)
    rm = bgd.RandomModel(ra, device, getattr(torch, dtype_name))
    hook = load_backend(a.backend).hook
    sizes = sorted(set(a.batch_sizes))
    prompts = torch.randint(5, rm.cfg.vocab_size, (4, a.prompt_len),
                            generator=torch.Generator().manual_seed(a.seed)).tolist()
    report = {"benchmark": "ep_graphs", "backend": a.backend, "device": str(device), "dtype": dtype_name,
              "torch": torch.__version__, "layers": a.layers, "experts": rm.cfg.n_routed_experts,
              "deepep_mode": os.environ.get("DEEPINFER_DEEPEP_MODE", "auto"), "rows": [], "tokens_equal": {}}
    with tempfile.TemporaryDirectory() as tmp:
        one_rank_world(device, Path(tmp) / "store")
        try:
            comm = hook.deepinfer_make_communicator(group=dist.group.WORLD, device=device)
            disp = hook.deepinfer_make_ep_dispatcher(communicator=comm, num_experts=rm.cfg.n_routed_experts,
                                                     hidden_size=rm.cfg.hidden_size)
            report["dispatcher"] = type(disp).__name__ + (f" ({disp.mode})" if hasattr(disp, "mode") else "")
            steps: dict[str, dict[int, float]] = {}
            tokens: dict[str, list[list[int]]] = {}
            for mode in MODES:
                model = rm.deepinfer_model()
                # DeepEP's low-latency kernels on every step take a bounded count of tokens a rank: prompts in
                # chunks of it (auto mode runs prompts through the normal kernels)
                every_step_ll = getattr(disp, "mode", "") == "low_latency"
                chunk = {"max_num_batched_tokens": disp.max_tokens} if every_step_ll else {}
                engine = bgd.make_engine(model, rm.cfg_dir, backend=a.backend, seed=a.seed, max_num_seqs=sizes[-1],
                                         **bgd.host_pools(device),
                                         enforce_eager=mode != "plain", **({} if mode == "plain" else chunk))
                if mode != "plain":
                    model.ep = disp
                if mode == "ep graphs":
                    report["graphs"] = with_graphs(engine, hook, sizes)
                tokens[mode] = greedy_tokens(engine, prompts, a.check_tokens)
                steps[mode] = {}
                for batch in sizes:
                    times = bgd.decode_steps(engine, batch, a, rm.cfg.vocab_size)
                    steps[mode][batch] = statistics.median(times)
                    print(f"{mode:>9} batch {batch:>4}: {steps[mode][batch]:.3f} ms a decode step")
                if mode == "ep graphs" and report["graphs"] == "uncaptured":
                    report["graph_counts"] = dict(engine.runner.graph_runner.counts)
                del engine, model
                gc.collect()  # the next engine sizes its pools from the memory left free
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        finally:
            dist.destroy_process_group()
    for batch in sizes:
        report["rows"].append({"batch": batch, **{f"{m} ms": steps[m][batch] for m in MODES},
                               "eager / graphs": steps["ep eager"][batch] / steps["ep graphs"][batch],
                               "graphs / plain": steps["ep graphs"][batch] / steps["plain"][batch]})
    report["tokens_equal"] = {m: tokens[m] == tokens["plain"] for m in MODES[1:]}
    print(table(report))
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=2))
    return report


def table(report: dict) -> str:
    head = f"{'batch':>5} | " + " | ".join(f"{m + ' ms':>12}" for m in MODES) + " | eager/graphs | graphs/plain"
    lines = [f"{report['dispatcher']}, graphs {report.get('graphs')}; tokens equal to plain: {report['tokens_equal']}",
             head, "-" * len(head)]
    for r in report["rows"]:
        lines.append(f"{r['batch']:>5} | " + " | ".join(f"{r[m + ' ms']:>12.3f}" for m in MODES)
                     + f" | {r['eager / graphs']:>12.2f} | {r['graphs / plain']:>12.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

"""Expert parallel + attention data parallel on the CPU (gloo, rank processes): step-time overhead of
N ranks against one, EPLB balance on a skewed workload, and per-rank weight bytes against ``deepinfer plan``.

1. Overhead: the same fixed mixed workload (prompts of 3..120 tokens, so chunked prefill, and 32..56 greedy
   tokens each, all submitted at once) through ``LLM(..., data_parallel_size=N, enable_expert_parallel=True)``
   for every N of ``--ranks`` (N = 1: the plain single-process engine), and for every N of ``--dp-only-ranks``
   without expert parallel (each rank all the experts, no MoE collectives: what the front-end, its pipes and
   the extra processes cost on their own); the repeats go round the configurations. Every ``engine.step()``
   is timed from the caller (so a step of N ranks includes the front-end's pipe round trip and the
   lock-step collectives); a "decode step" is one taken when every unfinished request already had its first
   token (no prefill anywhere). Reported: mean / median decode step ms, mean step ms over all steps, total
   wall (mean and best run), output tokens/s, and their ratios against the first of ``--ranks`` (1); greedy
   tokens are checked equal to its.
2. EPLB: ``enable_eplb=True`` with redundant experts (default: one per rank), a skewed live workload
   (prompts drawn from three token ids, so the router concentrates on a few experts). A first wave of 8
   requests runs ``--eplb-steps`` steps; then, in the middle of the run, ``rearrange_experts()`` rebalances
   from the load the ranks measured (their EPLB window, gathered over the ranks) and moves the expert
   weights; a second wave of 8 requests of the same skew joins the first and the run goes on to the end.
   Per layer: max/mean load over the ranks (what EPLB balances; a logical expert's pairs split evenly over
   its replicas, as in the engine's own statistics) of the load measured before the rearrangement, under
   the old layout and under the new one (what the policy predicts), and of the load measured after it,
   under the new layout (what the ranks got) and the old one (what they would have got); plus the engine's
   own statistics (``balancedness`` = mean/max rank load, mean over layers). Greedy tokens of all 16
   requests are checked equal to the single-process engine's.
3. Memory: per rank, the weight / routed-expert / KV bytes the rank holds (its tensors, read by the rank:
   ``rank_memory()``; ``measured_memory`` for one process) against ``deepinfer plan --json`` for the same
   arguments, and each rank process's RSS for scale (interpreter and torch included).

The model is the golden ``tiny`` config (seed 0) with 8 routed experts, so that 1, 2 and 4 ranks split them
evenly (``--model default``: the embedded trained model, 6 experts: 4 ranks only with redundant experts;
``--model DIR``: a checkpoint folder). One torch thread per rank (``--threads``: the front-end gives each rank
``os.cpu_count() // N`` threads, which the benchmark overrides). Example::

    python benchmarks/bench_expert_parallel.py --out benchmarks/results/cpu/expert_parallel.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform as host_platform
import statistics
import subprocess
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from deepinfer_core.entrypoints.llm import LLM
from deepinfer_core.sampling.params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "cpu" / "expert_parallel.json"
LENGTHS = [3, 9, 17, 30, 41, 64, 90, 120]
MAX_TOKENS = [48, 40, 56, 32, 48, 44, 52, 36]
SKEW_TOKENS = [17, 42, 99]


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny8", help="tiny8 (golden 'tiny', 8 experts), default (the embedded "
                    "model) or a checkpoint folder")
    ap.add_argument("--ranks", type=int_list, default=[1, 2, 4], help="data-parallel sizes of the overhead runs")
    ap.add_argument("--dp-only-ranks", type=int_list, default=[2], help="data-parallel sizes run without expert "
                    "parallel too (no MoE collectives: the front-end's own overhead; empty: none)")
    ap.add_argument("--eplb-ranks", type=int_list, default=[2, 4], help="data-parallel sizes of the EPLB runs "
                    "(empty: none)")
    ap.add_argument("--redundant", type=int, default=None, help="EPLB's redundant experts (default: one per rank)")
    ap.add_argument("--eplb-steps", type=int, default=24, help="steps before the mid-run rearrangement")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=8, help="timed runs of the workload per configuration")
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies every max_tokens (a quicker smoke run)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-cache-bytes", type=int, default=64 << 20, help="per rank")
    ap.add_argument("--threads", type=int, default=1, help="torch threads in each rank (and in one process)")
    ap.add_argument("--timeout", type=float, default=300.0, help="distributed_timeout_s")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="JSON file to write ('' : none)")
    return ap.parse_args(argv)


def git_commit() -> dict[str, Any]:
    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], capture_output=True, text=True, check=True, cwd=ROOT).stdout.strip()

    try:
        status = git("status", "--porcelain", "--untracked-files=no").splitlines()
        changed = [line.split(maxsplit=1)[1] for line in status]
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(changed), "modified_tracked_files": changed}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None, "modified_tracked_files": None}


def resolve_model(name: str, tmp: str) -> tuple[str, str, int]:
    """(checkpoint folder, label, vocabulary size)."""
    from deepinfer_core.config import ModelConfig
    from deepinfer_core.default_model import default_model_path

    if name == "tiny8":
        from deepinfer_core.testing.tiny_model import build_tiny_checkpoint

        with contextlib.redirect_stderr(io.StringIO()):
            path = build_tiny_checkpoint(Path(tmp) / "tiny8", "tiny", seed=0, n_routed_experts=8)
        label = "golden tiny config 'tiny' (seed 0), n_routed_experts=8"
    elif name == "default":
        path, label = default_model_path(), "embedded default model"
    else:
        path, label = Path(name), name
    return str(path), label, int(ModelConfig.from_pretrained(path).vocab_size)


def prompt(length: int, seed: int, vocab: int | list[int]) -> list[int]:
    gen = torch.Generator().manual_seed(1000 + seed)
    if isinstance(vocab, list):
        return [vocab[i] for i in torch.randint(0, len(vocab), (length,), generator=gen).tolist()]
    return torch.randint(2, vocab, (length,), generator=gen).tolist()  # 0, 1: BOS/EOS left out


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


# --- engines -------------------------------------------------------------------------------------


def engine_kwargs(a: argparse.Namespace, model: str, ranks: int, redundant: int = 0,
                  expert_parallel: bool = True) -> dict[str, Any]:
    """The arguments ``deepinfer plan`` sees too (plus the timeout and EPLB's schedule, which change no bytes)."""
    kw: dict[str, Any] = dict(model=model, dtype=a.dtype, block_size=a.block_size, kv_cache_bytes=a.kv_cache_bytes,
                              max_num_batched_tokens=a.max_num_batched_tokens, max_num_seqs=len(LENGTHS),
                              enable_prefix_caching=False, cpu_threads=a.threads)
    if ranks > 1:
        kw.update(data_parallel_size=ranks, enable_expert_parallel=expert_parallel)
    if redundant:
        kw.update(enable_eplb=True, eplb_config={"num_redundant_experts": redundant})
    return kw


def plan_flags(kw: dict[str, Any]) -> list[str]:
    flags = ["plan", "--json", "--model", kw["model"], "--dtype", kw["dtype"], "--block-size", str(kw["block_size"]),
             "--kv-cache-bytes", str(kw["kv_cache_bytes"]), "--max-num-batched-tokens",
             str(kw["max_num_batched_tokens"]), "--max-num-seqs", str(kw["max_num_seqs"]), "--no-prefix-caching"]
    if kw.get("data_parallel_size", 1) > 1:
        flags += ["-dp", str(kw["data_parallel_size"])]
    if kw.get("enable_expert_parallel"):
        flags += ["--enable-expert-parallel"]
    if kw.get("enable_eplb"):
        flags += ["--enable-eplb", "--num-redundant-experts", str(kw["eplb_config"]["num_redundant_experts"])]
    return flags


def deepinfer_plan(kw: dict[str, Any]) -> tuple[list[str], list[dict[str, Any]]]:
    """``deepinfer plan --json`` for the engine arguments ``kw`` (run in process): its flags and per-rank rows."""
    from deepinfer_core.entrypoints.cli import main

    flags = plan_flags(kw)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(flags)
    if rc != 0:
        raise RuntimeError(f"deepinfer {' '.join(flags)} exited {rc}: {out.getvalue()}")
    return flags, json.loads(out.getvalue())


def make_llm(a: argparse.Namespace, kw: dict[str, Any]) -> LLM:
    ranks = kw.get("data_parallel_size", 1)
    if ranks == 1:
        return LLM(**kw)
    extra = dict(distributed_timeout_s=a.timeout)
    if kw.get("enable_eplb"):  # rearranged only when the benchmark asks, over a window that holds the whole run
        extra["eplb_config"] = {**kw["eplb_config"], "step_interval": 1 << 30, "window_size": 4096}
    # the front-end gives each rank cpu_count // ranks torch threads: make that --threads
    with mock.patch("os.cpu_count", return_value=a.threads * ranks):
        return LLM(**{**kw, **extra})


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def rank_memory(llm: LLM) -> list[dict[str, Any]]:
    engine = llm.llm_engine
    if hasattr(engine, "rank_memory"):
        return [{**m, "rss_bytes": rss_bytes(pid)} for m, pid in zip(engine.rank_memory(), engine.rank_pids)]
    from deepinfer_core.parallel.memory_plan import measured_memory

    return [{**measured_memory(engine.model, engine.cache), "rss_bytes": rss_bytes(os.getpid())}]


# --- 1. overhead ---------------------------------------------------------------------------------


def run_workload(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], tag: str) -> dict[str, Any]:
    """Submit every request, then step to the end timing every step."""
    engine = llm.llm_engine
    ids = [engine.add_request(f"{tag}-{i}", p, s) for i, (p, s) in enumerate(zip(prompts, params))]
    got = dict.fromkeys(ids, 0)
    unfinished, tokens = set(ids), {}
    steps: list[tuple[float, bool]] = []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        decode = all(got[r] > 0 for r in unfinished)
        t0 = time.perf_counter()
        outs = engine.step()
        steps.append((time.perf_counter() - t0, decode))
        for out in outs:
            got[out.request_id] = len(out.outputs[0].token_ids)
            if out.finished:
                unfinished.discard(out.request_id)
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    wall = time.perf_counter() - start
    return {"wall_s": wall, "steps": steps, "tokens": [tokens[r] for r in ids]}


def overhead(a: argparse.Namespace, model: str, vocab: int) -> list[dict[str, Any]]:
    """Every configuration's engine is built first (idle ranks block on their pipes, using no CPU), then the
    repeats go round the configurations, so that a slow spell of a shared machine hits them all alike."""
    params = [greedy(max(1, round(m * a.scale))) for m in MAX_TOKENS]
    configs = [(n, True) for n in a.ranks] + [(n, False) for n in a.dp_only_ranks]
    engines, rows = [], []
    try:
        for ranks, ep in configs:
            kw = engine_kwargs(a, model, ranks, expert_parallel=ep)
            t0 = time.perf_counter()
            llm = make_llm(a, kw)
            engines.append((kw, llm, time.perf_counter() - t0))
            warm = [prompt(n, 500 + i, vocab) for i, n in enumerate(LENGTHS[:2])]
            run_workload(llm, warm, [greedy(4)] * 2, "warm")
        runs: list[list[dict[str, Any]]] = [[] for _ in configs]
        for rep in range(a.repeats):  # fresh prompts each repeat (the same for every configuration)
            prompts = [prompt(n, 100 * rep + i, vocab) for i, n in enumerate(LENGTHS)]
            for c, (_, llm, _) in enumerate(engines):
                runs[c].append(run_workload(llm, prompts, params, f"r{rep}"))
        for (ranks, ep), (kw, llm, startup), mine in zip(configs, engines, runs):
            counters = llm.llm_engine.rank_counters() if ranks > 1 else None
            flags, plan = deepinfer_plan(kw)
            decode = [dt for run in mine for dt, d in run["steps"] if d]
            every = [dt for run in mine for dt, _ in run["steps"]]
            out_tokens = sum(p.max_tokens for p in params)
            walls = [run["wall_s"] for run in mine]
            rows.append({
                "ranks": ranks, "expert_parallel": ep and ranks > 1, "startup_s": startup, "repeats": a.repeats,
                "threads_per_rank": a.threads, "steps_per_run": len(mine[0]["steps"]),
                "decode_steps_per_run": sum(d for _, d in mine[0]["steps"]),
                "decode_step_ms_mean": 1e3 * statistics.fmean(decode),
                "decode_step_ms_median": 1e3 * statistics.median(decode),
                "step_ms_mean": 1e3 * statistics.fmean(every), "wall_s_mean": statistics.fmean(walls),
                "wall_s_best": min(walls), "wall_s_runs": walls, "output_tokens_per_run": out_tokens,
                "tokens_per_s": out_tokens / statistics.fmean(walls),
                "tokens_equal_baseline": [r["tokens"] for r in mine] == [r["tokens"] for r in runs[0]],
                "rank_counters": counters, "plan_flags": flags, "plan": plan, "measured": rank_memory(llm),
            })
            print(f"  {_name(rows[-1])}: decode step {rows[-1]['decode_step_ms_mean']:.2f} ms, wall "
                  f"{rows[-1]['wall_s_mean']:.2f} s", flush=True)
    finally:
        for kw, llm, _ in engines:
            if kw.get("data_parallel_size", 1) > 1:
                llm.llm_engine.shutdown()
    base = rows[0]
    for r in rows:
        r["decode_step_ratio"] = r["decode_step_ms_mean"] / base["decode_step_ms_mean"]
        r["wall_ratio"] = r["wall_s_mean"] / base["wall_s_mean"]
        r["tokens_per_s_ratio"] = r["tokens_per_s"] / base["tokens_per_s"]
    return rows


# --- 2. EPLB -------------------------------------------------------------------------------------


def rank_loads(load: torch.Tensor, phy2log: torch.Tensor, world: int) -> torch.Tensor:
    """``[layers, world]``: the rank loads of ``load[layers, logical]`` under ``phy2log`` (even split over replicas)."""
    from deepinfer_core.parallel.eplb_policy import gpu_loads
    from deepinfer_core.parallel.expert_map import log2phy_of

    _, logcnt = log2phy_of(phy2log, load.shape[1])
    return gpu_loads(load.double(), phy2log, logcnt, world)


def imbalance(per_rank: torch.Tensor) -> list[float]:
    """max / mean over the ranks, per layer (1.0: even)."""
    mean = per_rank.mean(-1)
    return (per_rank.max(-1).values / mean.clamp_min(1e-12)).tolist()


def eplb_run(a: argparse.Namespace, model: str, ranks: int, single_tokens) -> dict[str, Any]:
    redundant = ranks if a.redundant is None else a.redundant
    kw = engine_kwargs(a, model, ranks, redundant)
    params = [greedy(max(2, round(m * a.scale))) for m in MAX_TOKENS]
    waves = [[prompt(max(n, 24), seed + i, SKEW_TOKENS) for i, n in enumerate(LENGTHS)] for seed in (700, 800)]
    expected = single_tokens(waves[0] + waves[1], params + params)
    llm = make_llm(a, kw)
    engine = llm.llm_engine
    try:
        engine.expert_load()  # a fresh count
        old = torch.tensor(engine.eplb_stats()[0]["phy2log"])
        ids = [engine.add_request(f"skew0-{i}", p, s) for i, (p, s) in enumerate(zip(waves[0], params))]
        tokens: dict[str, list[int]] = {}

        def step() -> None:
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = list(out.outputs[0].token_ids)

        for _ in range(a.eplb_steps):
            if engine.has_unfinished_requests():
                step()
        if not engine.has_unfinished_requests():
            raise RuntimeError(f"the skewed workload ended within {a.eplb_steps} steps: lower --eplb-steps")
        steps_before = engine.eplb_stats()[0]["steps"]
        before_load = engine.expert_load()
        t0 = time.perf_counter()
        stats = engine.rearrange_experts()  # from the window the ranks measured, gathered over them
        rearrange_s = time.perf_counter() - t0
        new = torch.tensor(engine.eplb_stats()[0]["phy2log"])
        # the first wave still decoding, a second wave of the same skew arrives
        ids += [engine.add_request(f"skew1-{i}", p, s) for i, (p, s) in enumerate(zip(waves[1], params))]
        while engine.has_unfinished_requests():
            step()
        after_load = engine.expert_load()
        eplb_stats = engine.eplb_stats()
        flags, plan = deepinfer_plan(kw)
        memory = rank_memory(llm)
    finally:
        engine.shutdown()
    got = [tokens[r] for r in ids]
    layers = []
    for layer in range(before_load.shape[0]):
        b, f = before_load[layer], after_load[layer]
        layers.append({
            "layer": layer,
            "expert_max_over_mean_before": float(b.max() / b.double().mean()),
            "rank_max_over_mean_before_old_layout": imbalance(rank_loads(b[None], old[layer][None], ranks))[0],
            "rank_max_over_mean_before_new_layout": imbalance(rank_loads(b[None], new[layer][None], ranks))[0],
            "rank_max_over_mean_after_old_layout": imbalance(rank_loads(f[None], old[layer][None], ranks))[0],
            "rank_max_over_mean_after_new_layout": imbalance(rank_loads(f[None], new[layer][None], ranks))[0],
            "rank_loads_before_old_layout": rank_loads(b[None], old[layer][None], ranks)[0].tolist(),
            "rank_loads_after_new_layout": rank_loads(f[None], new[layer][None], ranks)[0].tolist(),
            "old_phy2log": old[layer].tolist(), "new_phy2log": new[layer].tolist(),
            "replicas": {e: c for e, c in enumerate(torch.bincount(new[layer]).tolist()) if c > 1},
        })
    return {
        "ranks": ranks, "num_redundant_experts": redundant, "physical_experts": int(old.shape[1]),
        "steps_before": steps_before, "steps_total": eplb_stats[0]["steps"], "rearrange_s": rearrange_s,
        "pairs_before": int(before_load.sum()), "pairs_after": int(after_load.sum()),
        "window_pairs": stats["tokens"], "moved_slots": stats["moved_slots"],
        "engine_stats": {"before": stats["before"], "after": stats["after"]},
        "tokens_equal_1_rank": got == expected, "layers": layers,
        "plan_flags": flags, "plan": plan, "measured": memory,
    }


# --- tables --------------------------------------------------------------------------------------


def md_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" for _ in headers) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def overhead_table(rows: list[dict[str, Any]]) -> str:
    return md_table(
        ["ranks", "decode step ms (mean)", "decode step ms (median)", "step ms (all)", "steps/run",
         "wall s (mean / best)",
         "tok/s", "decode step x", "wall x", "tok/s x", "tokens = row 1"],
        [[_name(r), f"{r['decode_step_ms_mean']:.2f}", f"{r['decode_step_ms_median']:.2f}",
          f"{r['step_ms_mean']:.2f}", f"{r['steps_per_run']} ({r['decode_steps_per_run']} decode)",
          f"{r['wall_s_mean']:.2f} / {r['wall_s_best']:.2f}", f"{r['tokens_per_s']:.1f}",
          f"{r['decode_step_ratio']:.2f}",
          f"{r['wall_ratio']:.2f}", f"{r['tokens_per_s_ratio']:.2f}", str(r["tokens_equal_baseline"])] for r in rows])


def _name(row: dict[str, Any]) -> str:
    if row["ranks"] == 1:
        return "1 (one process)"
    return f"{row['ranks']} (DP + EP)" if row["expert_parallel"] else f"{row['ranks']} (DP only)"


def eplb_table(run: dict[str, Any]) -> str:
    return md_table(
        ["layer", "expert max/mean (before)", "before: old layout", "before: new layout (policy)",
         "after: new layout (live)", "after: old layout (had it stayed)", "replicated (expert: copies)"],
        [[str(x["layer"]), f"{x['expert_max_over_mean_before']:.2f}",
          f"{x['rank_max_over_mean_before_old_layout']:.3f}", f"{x['rank_max_over_mean_before_new_layout']:.3f}",
          f"{x['rank_max_over_mean_after_new_layout']:.3f}", f"{x['rank_max_over_mean_after_old_layout']:.3f}",
          ", ".join(f"{e}: {c}" for e, c in x["replicas"].items()) or "-"] for x in run["layers"]])


def memory_table(entries: list[tuple[str, dict[str, Any]]]) -> str:
    mib = 2 ** 20
    rows = []
    for name, run in entries:
        for rank, (plan, got) in enumerate(zip(run["plan"], run["measured"])):
            same = all(plan[k] == got[k] for k in ("weight_bytes", "expert_bytes", "kv_bytes"))
            rss = f"{got['rss_bytes'] / mib:.1f}" if got.get("rss_bytes") else "-"
            rows.append([name, str(rank), str(plan["expert_slots"]), f"{got['weight_bytes']:,}",
                         f"{plan['weight_bytes']:,}", f"{got['expert_bytes']:,}", f"{plan['expert_bytes']:,}",
                         f"{got['kv_bytes']:,}", f"{plan['kv_bytes']:,}", str(same), rss])
    return md_table(["run", "rank", "expert slots", "weights B (measured)", "weights B (plan)", "experts B (measured)",
                     "experts B (plan)", "KV B (measured)", "KV B (plan)", "equal", "RSS MiB"], rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model, label, vocab = resolve_model(a.model, tmp)
        print(f"model: {label}; {a.dtype}; {a.threads} torch thread(s) per rank; {os.cpu_count()} CPUs", flush=True)
        print("overhead runs:", flush=True)
        rows = overhead(a, model, vocab)
        single = LLM(**engine_kwargs(a, model, 1))

        def single_tokens(prompts, params):
            return [o.outputs[0].token_ids for o in single.generate(prompts, params, use_tqdm=False)]

        eplb = []
        for ranks in a.eplb_ranks:
            print(f"EPLB run, {ranks} ranks:", flush=True)
            eplb.append(eplb_run(a, model, ranks, single_tokens))
    report = {
        "benchmark": "expert_parallel", **git_commit(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": host_platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__, "backend": "cpu_ref",
        "dist_backend": "gloo", "model": label, "settings": {k: v for k, v in vars(a).items() if k != "out"},
        "workload": {"prompt_lengths": LENGTHS, "max_tokens": [max(1, round(m * a.scale)) for m in MAX_TOKENS],
                     "skewed_prompt_token_ids": SKEW_TOKENS, "prefix_caching": False},
        "overhead": rows, "eplb": eplb,
    }
    print()
    print(f"## Step-time overhead ({label}, {a.dtype}, {a.threads} thread(s)/rank, {os.cpu_count()} CPUs, "
          f"{a.repeats} runs of {len(LENGTHS)} requests, {sum(report['workload']['max_tokens'])} output tokens each)")
    print()
    print(overhead_table(rows))
    for run in eplb:
        es = run["engine_stats"]
        print()
        print(f"## EPLB, {run['ranks']} ranks, {run['num_redundant_experts']} redundant experts "
              f"({run['physical_experts']} slots), rearranged after {run['steps_before']} of {run['steps_total']} "
              f"steps: max/mean rank load per layer ({run['pairs_before']} pairs before, {run['pairs_after']} after; "
              f"{run['moved_slots']} slots moved between ranks in {1e3 * run['rearrange_s']:.0f} ms; "
              f"tokens = one process: {run['tokens_equal_1_rank']})")
        print()
        print(eplb_table(run))
        print()
        before, after = es["before"], es["after"]
        print(f"engine statistics (mean over layers): balancedness (mean/max rank load) {before['balancedness']:.3f}"
              f" -> {after['balancedness']:.3f}; max rank load {before['max']:.1f} -> {after['max']:.1f}"
              f" (mean {before['mean']:.1f})")
    print()
    print("## Per-rank memory: measured tensor bytes vs `deepinfer plan`")
    print()
    entries = [(_name(r), r) for r in rows]
    entries += [(f"EPLB {r['ranks']} ranks +{r['num_redundant_experts']}", r) for r in eplb]
    print(memory_table(entries))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"\nwrote {a.out}")
    return report


if __name__ == "__main__":
    main()

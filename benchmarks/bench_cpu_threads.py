"""Offline generation on cpu_ref against torch's thread count and the OpenMP wait policy.

Times ``LLM.generate`` of 64 prompts x 48 tokens (greedy) with the embedded model under each
configuration, each in a fresh process: torch's thread count is process-wide and the OpenMP runtime reads
its wait policy only when it starts. ``--busy N`` keeps N other processes spinning meanwhile, as on a
shared host (where spinning OpenMP threads cost most). Prints a table; ``--out`` writes JSON.

Configurations: ``torch`` (torch's own thread count: the engine before ``cpu_threads``), ``torch-passive``
(the same with ``OMP_WAIT_POLICY=PASSIVE``), ``auto`` (the engine's default, ``cpu_threads=None``) and
``threads=N``. Example: ``python benchmarks/bench_cpu_threads.py --busy 2 --repeats 3``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

CONFIGS = ("torch", "torch-passive", "auto")


def _child(a: argparse.Namespace) -> None:
    """One configuration in this process: a warm-up call, then ``--repeats`` timed calls (one JSON line)."""
    import torch

    from deepinfer_core.entrypoints import LLM, SamplingParams

    config = a.child
    threads = torch.get_num_threads() if config.startswith("torch") else (
        None if config == "auto" else int(config.removeprefix("threads=")))
    llm = LLM(dtype="float32", cpu_threads=threads)
    gen = torch.Generator().manual_seed(0)
    vocab = llm.llm_engine.model_config.vocab_size
    prompts = [{"prompt_token_ids": torch.randint(2, vocab, (a.prompt_len,), generator=gen).tolist()}
               for _ in range(a.prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=a.tokens, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)
    times = []
    for _ in range(a.repeats):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    print(json.dumps({"config": config, "threads": torch.get_num_threads(), "times_s": times}), flush=True)


def _run(config: str, a: argparse.Namespace) -> dict:
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    if config == "torch-passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    argv = [sys.executable, os.path.abspath(__file__), "--child", config, "--prompts", str(a.prompts),
            "--tokens", str(a.tokens), "--prompt-len", str(a.prompt_len), "--repeats", str(a.repeats)]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{config} failed:\n{proc.stderr[-2000:]}")
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    row["median_s"], row["min_s"] = statistics.median(row["times_s"]), min(row["times_s"])
    return row


def _spinners(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated (default: {','.join(CONFIGS)})")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=48, help="generated tokens per prompt")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--busy", type=int, default=0, help="spinning processes kept running meanwhile")
    ap.add_argument("--out", default=None, help="write the report as JSON here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child is not None:
        _child(a)
        return {}
    spinners = _spinners(a.busy)
    try:
        rows = [_run(config, a) for config in a.configs.split(",")]
    finally:
        for proc in spinners:
            proc.kill()
            proc.wait()
    report = {"cpus": os.cpu_count(), "busy": a.busy, "machine": platform.machine(), "prompts": a.prompts,
              "tokens": a.tokens, "rows": rows}
    print(f"{a.prompts} prompts x {a.tokens} tokens, embedded model, {os.cpu_count()} CPUs, {a.busy} spinning "
          "process(es)")
    print(f"{'config':<16}{'threads':>8}{'median s':>10}{'min s':>8}  all s")
    for r in rows:
        print(f"{r['config']:<16}{r['threads']:>8}{r['median_s']:>10.2f}{r['min_s']:>8.2f}  "
              + " ".join(f"{t:.2f}" for t in r["times_s"]))
    if a.out:
        with open(a.out, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=2)
    return report


if __name__ == "__main__":
    main()

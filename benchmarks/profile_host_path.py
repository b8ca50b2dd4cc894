"""The host side of a GPU engine's decode steps, measured on the CPU: the engine runs the padded graph
layouts a GPU replays (``GraphRunner(capture=False)``, ``MtpGraphs(capture=False)``, the undo log inside the
verification "graph"), and everything a captured graph would do on the device is timed apart. What is left
is the host's work per step: the scheduler, the draft planner, the batch layouts and uploads, the
verification's host side, the output processing; and the torch ops it launches outside graphs, which on a
GPU cost a launch each (``--launch-us``) where the CPU computes them.

On a GPU whose steps are bound by the host (the trained default model at batch 64 on an H100: a plain
step took 2.41 ms against its graph's 1.16 ms) this is what sets the speed of each mode; here it can be
changed and measured without one.

    python benchmarks/profile_host_path.py --modes off,fixed,confidence --batch-size 64 --max-tokens 48
    python benchmarks/profile_host_path.py --modes fixed --cprofile 40   # the host functions by own time

``--step-profile FILE`` prices confidence scheduling by a GPU's graph times (a ``bench_spec_decode.py``
result with ``step_profile_ms``), as the engine would there.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_spec_decode as spec_bench  # noqa: E402

from deepinfer_core.default_model import v4_model_path  # noqa: E402
from deepinfer_core.entrypoints.llm import LLM  # noqa: E402
from deepinfer_core.models.deepseek_v4.model import DeepseekV4Model  # noqa: E402
from deepinfer_core.models.deepseek_v4.mtp import DeepseekV4MTP  # noqa: E402
from deepinfer_core.sampling.params import SamplingParams  # noqa: E402
from deepinfer_core.spec_decode import verify_graph  # noqa: E402
from deepinfer_core.spec_decode.chain_graph import ChainGraphs  # noqa: E402
from deepinfer_core.spec_decode.confidence import StepProfile  # noqa: E402
from deepinfer_core.spec_decode.mtp_graph import MtpGraphs  # noqa: E402
from deepinfer_core.spec_decode.rollback import CacheUndo  # noqa: E402
from deepinfer_core.testing.uncaptured_graphs import use_uncaptured_graphs  # noqa: E402
from deepinfer_core.worker.graph_runner import GraphRunner  # noqa: E402

#: what a GPU runs inside captured graphs, or eagerly as a forward of its own (a verification graph's undo
#: log is put back by a restore graph: ``GraphUndo.capture_restores``)
DEVICE = [(GraphRunner, "replay_step"), (GraphRunner, "_derive"), (MtpGraphs, "_run"), (MtpGraphs, "_derive_static"),
          (CacheUndo, "restore_rows"), (DeepseekV4Model, "forward"), (DeepseekV4MTP, "forward"),
          (verify_graph, "greedy_verify_spans"), (ChainGraphs, "_apply")]
SIZES = [1, 2, 4, 8, 16, 32, 64]


class _Meter(TorchDispatchMode):
    """Torch ops outside the device work, their count and CPU seconds; seconds inside the device work."""

    def __init__(self):
        super().__init__()
        self.ops, self.op_seconds, self.device_seconds, self.depth = 0, 0.0, 0.0, 0
        self.profiler: cProfile.Profile | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.depth:
            return func(*args, **(kwargs or {}))
        self.ops += 1
        begin = time.perf_counter()
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.op_seconds += time.perf_counter() - begin

    def device(self, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if self.depth:
                return fn(*args, **kwargs)
            self.depth += 1
            if self.profiler is not None:
                self.profiler.disable()
            begin = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.device_seconds += time.perf_counter() - begin
                self.depth -= 1
                if self.profiler is not None:
                    self.profiler.enable()
        return timed


def _engine(mode: str, args) -> LLM:
    """An engine of ``mode`` (off / fixed / confidence) whose runners lay steps out as a GPU's graphs do."""
    k = args.k
    spec = None if mode == "off" else spec_bench._spec(k, mode)
    # the trained tiny V4 (its MTP drafter and decode graphs: what this profile measures)
    llm = LLM(str(v4_model_path()), speculative_config=spec, async_scheduling=True, max_num_seqs=args.batch_size,
              dtype="float32")
    engine = llm.llm_engine
    query_lens = (1,) if spec is None else tuple(range(1, k + 2)) if mode == "confidence" else (1, 1 + k)
    use_uncaptured_graphs(engine, [s for s in SIZES if s <= args.batch_size] or [1], query_lens, drafting=True)
    if spec is not None:
        if engine.drafts.gate is not None:  # the gate's work, but every step speculates (its GPU choice at 64)
            decide = engine.drafts.gate.decide
            engine.drafts.gate.decide = lambda *a, **kw: decide(*a, **kw) or True
        if mode == "confidence" and args.step_profile:
            engine.drafts.use_profile(_step_profile(args.step_profile))
    return llm


def _step_profile(path: str) -> StepProfile:
    rows = [r for r in json.loads(Path(path).read_text())["rows"] if "step_profile_ms" in r]
    if not rows:
        raise SystemExit(f"{path}: no step_profile_ms (a bench_spec_decode.py result with confidence scheduling)")
    return StepProfile({tuple(map(int, key.split(","))): ms / 1e3 for key, ms in rows[0]["step_profile_ms"].items()})


def measure(mode: str, args) -> dict:
    llm = _engine(mode, args)
    engine, meter = llm.llm_engine, _Meter()
    prompts = spec_bench._prompts(llm, args.batch_size, args.prompt_len)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    undo = [(owner, name, getattr(owner, name)) for owner, name in DEVICE]
    steps, step = [0], engine.step

    def counted():
        steps[0] += 1
        return step()

    engine.step = counted
    try:
        for owner, name, fn in undo:
            setattr(owner, name, meter.device(fn))
        if args.cprofile:
            meter.profiler = cProfile.Profile()
            meter.profiler.enable()
        begin = time.perf_counter()
        with meter:
            llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - begin
        if meter.profiler is not None:
            meter.profiler.disable()
    finally:
        for owner, name, fn in undo:
            setattr(owner, name, fn)
        engine.step = step
    n = steps[0]
    host = seconds - meter.device_seconds - meter.op_seconds
    row = {"mode": mode, "batch": args.batch_size, "steps": n, "tokens": args.batch_size * args.max_tokens,
           "host_python_ms": 1e3 * host / n, "ops": meter.ops / n, "op_cpu_ms": 1e3 * meter.op_seconds / n,
           "device_cpu_ms": 1e3 * meter.device_seconds / n}
    row["gpu_host_ms"] = row["host_python_ms"] + row["ops"] * args.launch_us / 1e3
    row["gpu_host_us_per_token"] = 1e3 * row["gpu_host_ms"] * n / row["tokens"]
    if meter.profiler is not None:
        text = io.StringIO()
        pstats.Stats(meter.profiler, stream=text).sort_stats("tottime").print_stats(args.cprofile)
        row["cprofile"] = text.getvalue()
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", type=lambda v: v.split(","), default=["off", "fixed", "confidence"],
                    metavar="MODE,...", help="off, fixed (k drafts), confidence")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--launch-us", type=float, default=5.0,
                    help="host microseconds a GPU spends launching one op outside a graph (default 5)")
    ap.add_argument("--step-profile", default=None, metavar="RESULT.json")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N", help="print the N host functions by own time")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json-out", default=None, metavar="FILE")
    args = ap.parse_args(argv)
    unknown = set(args.modes) - {"off", "fixed", "confidence"}
    if unknown:
        raise SystemExit(f"--modes: unknown {sorted(unknown)}")
    torch.set_num_threads(args.threads)
    rows = [measure(mode, args) for mode in args.modes]
    print(f"{'mode':>10} {'batch':>5} {'steps':>5} {'host py ms':>10} {'ops':>6} {'op cpu ms':>9} "
          f"{'gpu host ms':>11} {'us/token':>8}")
    for r in rows:
        print(f"{r['mode']:>10} {r['batch']:>5} {r['steps']:>5} {r['host_python_ms']:>10.3f} {r['ops']:>6.0f} "
              f"{r['op_cpu_ms']:>9.3f} {r['gpu_host_ms']:>11.3f} {r['gpu_host_us_per_token']:>8.2f}")
        if "cprofile" in r:
            print(r["cprofile"])
    report = {"benchmark": "profile_host_path", "k": args.k, "launch_us": args.launch_us, "rows": rows,
              "max_tokens": args.max_tokens, "prompt_len": args.prompt_len, "torch": torch.__version__}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()

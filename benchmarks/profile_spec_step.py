"""Where a decode step's host time goes, with speculation off and on: inclusive host milliseconds per step
of the engine's, the runners' and the drafter's main functions, and of the host's waits for the device
(``Tensor.tolist`` / ``item``, the copies that end a step).

Each function is wrapped with a wall-clock timer; nothing is synchronised beyond what the engine itself
does, so a wait shows up where the engine waits. The time of a function includes the functions it calls
(the rows overlap). Models as in ``bench_spec_decode.py``: the embedded trained model, or ``--random``
(V4-Flash widths, an MTP block, ``--force-acceptance``).

GPU:  python benchmarks/profile_spec_step.py --backend nvidia_sm100 --device cuda --ks 1,3 --batch-sizes 1,8
      (each mode builds an engine and captures its graphs: ``--confidence --modes confidence`` profiles plain
      decode and confidence scheduling only)
CPU:  python benchmarks/profile_spec_step.py --batch-sizes 1 --ks 1 --max-tokens 8 --json-out OUT.json
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_spec_decode as spec_bench  # noqa: E402

#: (module, attribute path) of every timed function; a module's own name for an imported function is
#: patched where it is called from
TIMED = [
    ("deepinfer_core.engine.llm_engine", "LLMEngine.step"),
    ("deepinfer_core.engine.llm_engine", "LLMEngine._finish"),
    ("deepinfer_core.engine.scheduler", "Scheduler.schedule"),
    ("deepinfer_core.worker.model_runner", "ModelRunner.execute_model"),
    ("deepinfer_core.worker.spec_model_runner", "SpecDecodeModelRunner.execute_model"),
    ("deepinfer_core.spec_decode.verifier", "Verifier.verify"),
    ("deepinfer_core.worker.spec_model_runner", "SpecDecodeModelRunner._complete"),
    ("deepinfer_core.worker.spec_model_runner", "SpecDecodeModelRunner._draft"),
    ("deepinfer_core.worker.spec_model_runner", "SpecDecodeModelRunner._draft_on_device"),
    ("deepinfer_core.worker.spec_model_runner", "SpecDecodeModelRunner._execute_chained"),
    ("deepinfer_core.spec_decode.verifier", "Verifier.verify_rows"),
    ("deepinfer_core.worker.spec_model_runner", "SpecDecodeModelRunner._propose_chained"),
    ("deepinfer_core.worker.spec_model_runner", "_HostCopy.lists"),
    ("deepinfer_core.worker.spec_model_runner", "build_forward_batch"),
    ("deepinfer_core.worker.model_runner", "build_forward_batch"),
    ("deepinfer_core.spec_decode.mtp_graph", "build_forward_batch"),
    ("deepinfer_core.spec_decode.mtp_proposer", "build_forward_batch"),
    ("deepinfer_core.spec_decode.mtp_proposer", "MtpProposer.propose"),
    ("deepinfer_core.spec_decode.mtp_graph", "MtpGraphs.propose"),
    ("deepinfer_core.spec_decode.rollback", "CacheUndo.restore"),
    ("deepinfer_core.worker.graph_runner", "GraphRunner.load"),
    ("deepinfer_core.worker.graph_runner", "GraphRunner.load_facts"),
    ("deepinfer_core.worker.graph_runner", "GraphRunner.derive"),
    ("deepinfer_core.spec_decode.mtp_graph", "MtpGraphs._derive"),
    ("deepinfer_core.worker.graph_runner", "GraphRunner.replay"),
    ("deepinfer_core.worker.graph_runner", "GraphRunner.replay_with_streams"),
    ("deepinfer_core.worker.graph_runner", "GraphRunner.replay_step"),
    ("deepinfer_core.models.deepseek_v4.model", "DeepseekV4Model.forward"),
    ("deepinfer_core.models.deepseek_v4.mtp", "DeepseekV4MTP.forward"),
    ("deepinfer_core.spec_decode.drafts", "DraftPlanner.decide"),
    ("deepinfer_core.spec_decode.drafts", "DraftPlanner.plan"),
    ("deepinfer_core.spec_decode.drafts", "DraftPlanner.accept"),
    ("deepinfer_core.spec_decode.drafts", "DraftPlanner.observe_output"),
    ("deepinfer_core.spec_decode.confidence", "ConfidenceScheduler.plan"),
]
WAITS = ("tolist", "item")  # torch.Tensor methods that wait for the device


class Timers:
    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._undo: list = []

    def wrap(self, owner, attr: str, name: str) -> None:
        fn = getattr(owner, attr)

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t
                self.calls[name] += 1

        setattr(owner, attr, timed)
        self._undo.append((owner, attr, fn))

    def install(self) -> None:
        for module, path in TIMED:
            owner = importlib.import_module(module)
            *outer, attr = path.split(".")
            for part in outer:
                owner = getattr(owner, part)
            label = path if outer else f"{module.rsplit('.', 1)[-1]}.{path}"
            self.wrap(owner, attr, label)
        for attr in WAITS:
            self.wrap(torch.Tensor, attr, f"Tensor.{attr} (waits)")

    def uninstall(self) -> None:
        for owner, attr, fn in reversed(self._undo):
            setattr(owner, attr, fn)
        self._undo.clear()

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def _device_busy_ms(llm, prompts, params, top: int = 15) -> tuple[float, list[tuple[str, float, int]]]:
    """Milliseconds the GPU spent in kernels during one more run (profiled apart from the timed one: the
    profiler slows the host), and the ``top`` kernels by time: (name, milliseconds, launches)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        spec_bench._generate(llm, prompts, params)
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)
    return (sum(e.self_device_time_total for e in events) / 1e3,
            [(e.key, e.self_device_time_total / 1e3, e.count) for e in events[:top]])


def _cprofile(llm, prompts, params, out: Path) -> None:
    """cProfile of one more run: the host functions by own time and by inclusive time."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    spec_bench._generate(llm, prompts, params)
    prof.disable()
    text = io.StringIO()
    for key in ("tottime", "cumulative"):
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(45)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text.getvalue())


def _kind(mode: str) -> str:
    return "always" if mode.endswith("always") else "confidence" if mode.startswith("confidence") else "fixed"


def profile(args) -> dict:
    if args.force_acceptance is not None:
        spec_bench.force_acceptance(args.force_acceptance)
    params = spec_bench.SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    engine_kw = spec_bench._engine_kw(args)
    make = spec_bench._random_llm_factory(args, engine_kw) if args.random else (
        lambda spec, **kw: spec_bench.LLM(args.model, speculative_config=spec, **engine_kw, **kw))
    modes = [("off", None)] + [(f"k={k}", spec_bench._spec(k)) for k in args.ks]
    if args.confidence:  # as the gate decides, and speculating in every step (the scheduler's own cost)
        k = max(args.ks)
        modes += [(f"confidence k={k}", spec_bench._spec(k, "confidence")),
                  (f"confidence k={k} always", spec_bench._spec(k, "confidence"))]
    if args.modes is not None:  # plain decode stays: the bounds are against it
        unknown = set(args.modes) - {"fixed", "confidence", "always"}
        if unknown:
            raise SystemExit(f"--modes: unknown {sorted(unknown)}; choose from fixed, confidence, always")
        modes = [(name, spec) for name, spec in modes if name == "off" or _kind(name) in args.modes]
    timers, rows = Timers(), []
    for name, spec in modes:
        sched = {"async_scheduling": True} if args.async_scheduling else {}
        llm = make(spec, max_num_seqs=max(args.batch_sizes), **sched)
        if name.endswith("always"):
            llm.llm_engine.drafts.gate.decide = lambda num_decoding, decode_only=True: True
        for batch in args.batch_sizes:
            prompts = spec_bench._prompts(llm, batch, args.prompt_len)
            spec_bench._generate(llm, prompts, params)  # warm-up: the same shapes
            timers.reset()
            timers.install()
            try:
                _, seconds = spec_bench._generate(llm, prompts, params)
            finally:
                timers.uninstall()
            steps = timers.calls["LLMEngine.step"]
            per_step = {k: 1e3 * v / steps for k, v in sorted(timers.seconds.items(), key=lambda kv: -kv[1])}
            rows.append({"mode": name, "batch": batch, "seconds": seconds, "steps": steps,
                         "tokens_per_step": batch * args.max_tokens / steps,
                         "ms_per_step": per_step, "calls_per_step": {k: timers.calls[k] / steps for k in per_step}})
            if args.cprofile:
                _cprofile(llm, prompts, params, Path(args.cprofile) / f"{name.replace('=', '')}_b{batch}.txt")
            if torch.cuda.is_available() and str(args.device).startswith("cuda"):
                busy, kernels = _device_busy_ms(llm, prompts, params)
                rows[-1]["device_busy_ms_per_step"] = busy / steps
                rows[-1]["top_kernels_ms_per_step"] = [(k, ms / steps, n / steps) for k, ms, n in kernels]
    for r in rows:
        busy = r.get("device_busy_ms_per_step")
        print(f"\n{r['mode']} batch {r['batch']}: {r['steps']} steps, {1e3 * r['seconds'] / r['steps']:.3f} ms "
              f"per step, {r['tokens_per_step']:.2f} tokens per step"
              + (f", GPU busy {busy:.3f} ms per step" if busy is not None else ""))
        print(f"  {'function':<44} {'ms/step':>8} {'calls/step':>10}")
        for k, ms in r["ms_per_step"].items():
            print(f"  {k:<44} {ms:>8.3f} {r['calls_per_step'][k]:>10.2f}")
        if "top_kernels_ms_per_step" in r:
            print(f"  {'kernel (GPU)':<44} {'ms/step':>8} {'calls/step':>10}")
            for k, ms, n in r["top_kernels_ms_per_step"]:
                print(f"  {k[:44]:<44} {ms:>8.3f} {n:>10.2f}")
    summary = _speed_up_bounds(rows)
    return {"benchmark": "profile_spec_step", "backend": args.backend, "model": spec_bench._model_name(args),
            "torch": torch.__version__, "max_tokens": args.max_tokens, "async_scheduling": args.async_scheduling,
            "rows": rows, "speed_up_bounds": summary}


def _speed_up_bounds(rows: list[dict]) -> list[dict]:
    """Per speculative row, the speed-up over plain decode at its batch size, achieved (wall time per token)
    and bounded by the device's work: tokens per step over the GPU's busy milliseconds per step, against
    plain decode's. The bound is ``(1 + accepted tokens per step) / (1 + overhead)`` with the overhead (the
    verification's extra work and the drafting) as the profiler measured it; where the achieved speed-up
    falls short of it, the host's work per step is what is missing."""
    plain = {r["batch"]: r for r in rows if r["mode"] == "off"}
    out = []
    for r in rows:
        base = plain.get(r["batch"])
        if r["mode"] == "off" or base is None:
            continue
        wall = 1e3 * r["seconds"] / r["steps"]
        base_wall = 1e3 * base["seconds"] / base["steps"]
        row = {"mode": r["mode"], "batch": r["batch"],
               "tokens_per_step": r["tokens_per_step"] / r["batch"],
               "step_ms": wall, "plain_step_ms": base_wall,
               "achieved": (r["tokens_per_step"] / wall) / (base["tokens_per_step"] / base_wall)}
        busy, base_busy = r.get("device_busy_ms_per_step"), base.get("device_busy_ms_per_step")
        if busy and base_busy:
            row.update(device_ms=busy, plain_device_ms=base_busy, overhead=busy / base_busy - 1,
                       bound=(r["tokens_per_step"] / busy) / (base["tokens_per_step"] / base_busy))
        out.append(row)
    if out:
        print(f"\n{'mode':>6} {'batch':>5} {'tok/seq/step':>12} {'step ms':>8} {'plain ms':>8} {'device ms':>9} "
              f"{'plain dev':>9} {'overhead':>8} {'bound':>6} {'achieved':>8}")
    for o in out:
        dev = (f"{o['device_ms']:>9.3f} {o['plain_device_ms']:>9.3f} {o['overhead']:>8.2f} {o['bound']:>6.2f}"
               if "bound" in o else f"{'-':>9} {'-':>9} {'-':>8} {'-':>6}")
        print(f"{o['mode']:>6} {o['batch']:>5} {o['tokens_per_step']:>12.2f} {o['step_ms']:>8.3f} "
              f"{o['plain_step_ms']:>8.3f} {dev} {o['achieved']:>8.2f}")
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the embedded trained model)")
    ap.add_argument("--backend", default="cpu_ref")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--ks", type=spec_bench._ints, default=[1, 3], metavar="K,K,...")
    ap.add_argument("--batch-sizes", type=spec_bench._ints, default=[1, 8], metavar="B,B,...")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--force-acceptance", type=float, default=None, metavar="P")
    ap.add_argument("--random", action="store_true", help="random V4-Flash-width weights with an MTP block")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--async-scheduling", action="store_true", help="schedule step N+1 while step N runs")
    ap.add_argument("--confidence", action="store_true",
                    help="also confidence-scheduled k = max(ks): as its gate decides, and always speculating")
    ap.add_argument("--modes", type=lambda v: v.split(","), default=None, metavar="KIND,...",
                    help="profile only these besides plain decode: fixed (k=K), confidence, always "
                         "(confidence speculating every step); default all")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cprofile", default=None, metavar="DIR", help="also write a cProfile of each run here")
    ap.add_argument("--json-out", default=None, metavar="FILE")
    ap.set_defaults(method="mtp")  # bench_spec_decode's drafter option: this profile drafts with MTP
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    report = profile(args)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()

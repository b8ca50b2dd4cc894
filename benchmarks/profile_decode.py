"""Kernel-level breakdown of one decode step at V4-Flash widths (random weights), with torch.profiler.

Builds the model as ``bench_gpu_decode.py`` does, prefills ``--batch`` prompts, decodes a few warm-up
steps, then profiles ``--steps`` decode steps and prints the CUDA time per kernel family and the host
time of the step's phases. Run eagerly (``--eager``) to see kernels; with graphs the profile shows the
replay and what stays on the host.

  python benchmarks/profile_decode.py --batch 64 --eager --out OUT

``--fp8`` quantises the weights to block FP8 first (``quantize_params_fp8``, the engine with
``quantization="fp8"``), as the sweep's ``+fp8`` configs do. ``--prefill`` profiles the prefill instead:
after a warm-up request, ``--batch`` prompts of ``--prompt-len`` tokens, one chunk of ``--prompt-len``
tokens per step (the sweep's prefill rows), each step timed to device completion (``step_ms``: the
median of a round outside the profiler), then another ``--batch`` profiled:

  python benchmarks/profile_decode.py --prefill --batch 2 --prompt-len 4096 --fp8 --out OUT

With ``--context N`` nothing is prefilled: ``--batch`` sequences with ``N`` tokens cached decode through
``bench_long_context``'s Harness (the cache holds no real history: every sequence reads the same blocks,
which changes no shape and no amount of work), eagerly (``--eager``: build_forward_batch, upload,
forward) or through a GraphRunner decode graph captured for ``--max-model-len`` (default ``N + 1``):

  python benchmarks/profile_decode.py --context 131072 --batch 16 --eager --out OUT
  python benchmarks/profile_decode.py --context 131072 --batch 16 --out OUT

(``--small --device cpu --backend cpu_ref`` runs it at small widths on the CPU, where the profile's times
are CPU times.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gpu_decode as bench  # noqa: E402


def main(argv=None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--async-scheduling", action="store_true")
    ap.add_argument("--fp8", action="store_true", help="block-FP8 weights (not with --context)")
    ap.add_argument("--prefill", action="store_true", help="profile prefill chunks instead of decode steps")
    ap.add_argument("--out", default="profile_out")
    ap.add_argument("--rows", type=int, default=25)
    ctx = ap.add_argument_group("--context mode (no prefill; bench_long_context's Harness)")
    ctx.add_argument("--context", type=int, default=None, help="tokens every sequence has cached")
    ctx.add_argument("--max-model-len", type=int, default=None,
                     help="capacity the decode graphs are captured for (default: context + 1)")
    ctx.add_argument("--warmup", type=int, default=2, help="steps before the timed and profiled ones")
    ctx.add_argument("--block-size", type=int, default=None, help="default: the engine's for the model")
    ctx.add_argument("--small", action="store_true", help="bench_gpu_decode's small widths (CPU smoke test)")
    ctx.add_argument("--backend", default="nvidia_sm100")
    ctx.add_argument("--device", default="cuda")
    ctx.add_argument("--dtype", default=None, help="bfloat16 (default) or float32 (default on the CPU)")
    a = ap.parse_args(argv)
    if a.context is not None:
        if a.fp8 or a.prefill:
            raise SystemExit("--fp8 and --prefill are not for --context")
        return profile_context(a)
    from transformers import DeepseekV4ForCausalLM

    from deepinfer_core.config import ModelConfig
    from deepinfer_core.sampling.params import SamplingParams

    ba = bench.parse_args(["--gen-len", "64", "--prompt-len", str(a.prompt_len), "--device", a.device]
                          + ["--small"] * a.small)
    config = bench.make_config(ba)
    device = torch.device(a.device)
    dtype = getattr(torch, a.dtype or ba.dtype)
    torch.set_default_dtype(dtype)
    with torch.device(device):
        hf = DeepseekV4ForCausalLM(config).to(dtype)
    torch.set_default_dtype(torch.float32)
    bench.randomize(hf, config, ba.std, 0)
    tmp = tempfile.TemporaryDirectory()
    config.save_pretrained(tmp.name)
    cfg = ModelConfig.from_pretrained(Path(tmp.name))
    params = bench.convert_params(hf, cfg, dtype)
    del hf
    if a.fp8:
        from deepinfer_core.model.loader import fp8_weight_names
        from deepinfer_core.quant.fp8 import quantize_params_fp8

        quantize_params_fp8(params, fp8_weight_names(cfg))
    model = bench.build_deepinfer_model(cfg, params, a.backend, dtype, device)
    engine = bench.make_engine(
        model, tmp.name, backend=a.backend, dtype=dtype, device=a.device, max_model_len=a.prompt_len + 64,
        max_num_seqs=a.batch, max_num_batched_tokens=a.prompt_len if a.prefill else max(2048, a.prompt_len),
        enable_prefix_caching=False, block_size=bench.cfg_block_size(cfg), enforce_eager=a.eager,
        async_scheduling=a.async_scheduling, **({"quantization": "fp8"} if a.fp8 else {}),
    )
    gen = torch.Generator().manual_seed(0)
    cuda = device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def add(n: int, tag: str, max_tokens: int) -> None:
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for i in range(n):
            prompt = torch.randint(2, cfg.vocab_size, (a.prompt_len,), generator=gen).tolist()
            engine.add_request(f"{tag}{i}", prompt, sp)

    def prefilling() -> bool:
        return bool(engine.scheduler.waiting) or any(
            s.num_computed_tokens < len(s.prompt_token_ids) for s in engine.scheduler.running)

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda
    tag = f"b{a.batch}_{'eager' if a.eager else 'graphs'}{'_async' if a.async_scheduling else ''}{'_fp8' * a.fp8}"
    if a.prefill:
        add(1, "warmup", 2)
        while engine.has_unfinished_requests():
            engine.step()

        phases = _PhaseTimer(engine.runner, cuda)

        def prefill(tag: str) -> list[float]:
            add(a.batch, tag, 1)
            times = []
            while prefilling():
                sync()
                t0 = time.perf_counter()
                engine.step()
                sync()
                times.append(time.perf_counter() - t0)
            return times

        with phases:
            step_ms = statistics.median(prefill("timed")) * 1e3  # outside the profiler, which slows the host
        while engine.has_unfinished_requests():
            engine.step()
        with profile(activities=activities) as prof:
            a.steps = len(prefill("profiled"))
        return report(prof, a, f"prefill{a.prompt_len}_{tag}", cuda=cuda, step_ms=step_ms,
                      prefill_tok_s=a.prompt_len / (step_ms / 1e3), prefill_steps=a.steps,
                      phases_ms=phases.medians())
    add(a.batch, "", a.steps + 60)
    while prefilling():
        engine.step()
    for _ in range(4):
        engine.step()
    sync()
    with profile(activities=activities) as prof:
        for _ in range(a.steps):
            engine.step()
        sync()
    return report(prof, a, tag, cuda=cuda)


class _PhaseTimer:
    """Within ``with``: per call of the runner's ``prepare`` and ``execute``, the host's milliseconds, and
    for ``execute`` the device's span from its first launch to its last kernel's end (CUDA events), which
    counts the device's idle gaps inside the forward that a kernel total does not."""

    def __init__(self, runner, cuda: bool):
        self.runner, self.cuda = runner, cuda
        self.times: dict[str, list[float]] = {"prepare_host": [], "execute_host": [], "execute_device": []}
        self._events: list[tuple] = []

    def __enter__(self):
        self._prepare, self._execute = self.runner.prepare, self.runner.execute

        def prepare(*args, **kw):
            t0 = time.perf_counter()
            out = self._prepare(*args, **kw)
            self.times["prepare_host"].append((time.perf_counter() - t0) * 1e3)
            return out

        def execute(*args, **kw):
            start = end = None
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            out = self._execute(*args, **kw)
            self.times["execute_host"].append((time.perf_counter() - t0) * 1e3)
            if self.cuda:
                end.record()
                self._events.append((start, end))
            return out

        self.runner.prepare, self.runner.execute = prepare, execute
        return self

    def __exit__(self, *exc):
        self.runner.prepare, self.runner.execute = self._prepare, self._execute
        if self._events:
            torch.cuda.synchronize()
            self.times["execute_device"] += [s.elapsed_time(e) for s, e in self._events]

    def medians(self) -> dict[str, float]:
        return {k: statistics.median(v) for k, v in self.times.items() if v}


def report(prof, a, tag: str, cuda: bool = True, **extra) -> dict:
    """Write ``profile_{tag}.txt`` (the tables) and ``profile_{tag}.json`` under ``--out`` and print the
    time per step of the top ``--rows`` events by self time: the kernels' CUDA time, or with ``cuda=False``
    (a profile without the CUDA activity, as on the CPU) the operators' CPU time."""
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    events = prof.key_averages()
    table = events.table(sort_by="cuda_time_total" if cuda else "self_cpu_time_total", row_limit=a.rows)
    host = events.table(sort_by="cpu_time_total", row_limit=15)
    (out / f"profile_{tag}.txt").write_text(table + "\n\n" + host)

    def self_us(e):
        return e.self_device_time_total if cuda else e.self_cpu_time_total

    # on the device, kernels only: an operator's self device time is its kernels' again
    kernels = [e for e in events if e.device_type != DeviceType.CPU] if cuda else list(events)
    kernels = kernels or list(events)
    total = sum(self_us(e) for e in kernels) / 1e3 / a.steps
    ranked = sorted(kernels, key=lambda e: -self_us(e))[:a.rows]
    host_ranked = sorted(events, key=lambda e: -e.self_cpu_time_total)[:a.rows]
    summary = {"batch": a.batch, "mode": tag, "device_ms_per_step": total, **extra,
               "top": [(e.key, self_us(e) / 1e3 / a.steps) for e in ranked],
               "host_top": [(e.key, e.count // a.steps, e.self_cpu_time_total / 1e3 / a.steps)
                            for e in host_ranked]}
    (out / f"profile_{tag}.json").write_text(json.dumps(summary, indent=1))
    print(f"== {tag}: {'device' if cuda else 'CPU'} time {total:.2f} ms/step"
          + (f", step {extra['step_ms']:.2f} ms" if "step_ms" in extra else ""))
    for k, v in summary["top"]:
        print(f"{v:9.3f} ms  {k[:110]}")
    if extra.get("phases_ms"):
        print("phases (ms, median): " + ", ".join(f"{k} {v:.2f}" for k, v in extra["phases_ms"].items()))
    print("host, self CPU time per step:")
    for k, n, v in summary["host_top"][:15]:
        print(f"{v:9.3f} ms  {n:6d}x  {k[:100]}")
    return summary


def profile_context(a) -> dict:
    """Decode steps of ``--batch`` sequences at context ``--context``, no prefill: bench_long_context's
    model (V4-Flash widths, or ``--small``) and Harness, eager or through a decode graph."""
    import bench_long_context as blc
    from torch.profiler import ProfilerActivity, profile

    capacity = 0 if a.eager else (a.max_model_len or a.context + 1)
    if capacity and a.context + 1 > capacity:
        raise SystemExit(f"--max-model-len {capacity} holds no decode step at context {a.context}")
    la = blc.parse_args(["--gpu", "--contexts", str(a.context), "--batches", str(a.batch), "--chunk", "0",
                         "--max-model-len", str(capacity), "--backend", a.backend, "--device", a.device]
                        + ["--dtype", a.dtype] * (a.dtype is not None) + ["--small"] * a.small)
    if la.dtype is None and a.device == "cpu":
        la.dtype = "float32"
    dtype, device, platform = blc.setup(la)
    with torch.inference_mode():
        model = blc.flash_model(la, dtype)
        la.block_size = a.block_size or bench.cfg_block_size(model.cfg)
        h = blc.Harness(model, platform, la)
        if a.eager:
            def step():
                return h.eager(a.context, 1, a.batch)[2]
        else:
            if h.graphs.padding_for(h.spans(a.context, 1, a.batch), list(range(a.batch))) is None:
                raise SystemExit(f"no decode graph holds batch {a.batch} at context {a.context}")

            def step():
                return h.graph(a.context, a.batch)[2]
        for _ in range(a.warmup):
            step()
        step_ms = statistics.median(step() for _ in range(a.steps)) * 1e3
        phases = None
        if not a.eager:
            runs = [h.graph_phases(a.context, a.batch) for _ in range(max(a.steps, 5))]
            phases = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            print("phases (ms, median): " + ", ".join(f"{k} {v:.3f}" for k, v in phases.items()))
        cuda = device.type == "cuda"
        activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda
        with profile(activities=activities) as prof:
            for _ in range(a.steps):
                step()
            platform.synchronize()
    tag = f"ctx{a.context}_b{a.batch}_{'eager' if a.eager else 'graphs'}"
    return report(prof, a, tag, cuda=cuda, time="cuda" if cuda else "cpu", context=a.context,
                  max_model_len=capacity or None,
                  block_size=la.block_size, step_ms=step_ms, phases_ms=phases,
                  graph_init_s=getattr(h, "graph_init_s", None), device=str(device), backend=a.backend,
                  dtype=str(dtype).split(".")[-1], model="bench_gpu_decode-small" if a.small else "v4-flash-4-layers")


if __name__ == "__main__":
    main()

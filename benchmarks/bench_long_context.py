"""Long-context step cost on the model alone: host bytes each step builds and step time vs context.

For every context ``L`` and batch ``B``: ``B`` sequences with ``L`` tokens cached decode one token (and one
sequence prefills a ``--chunk``-token chunk at context ``L``), laid out

- eagerly (``build_forward_batch``, packed, uploaded, forward), and
- for a decode graph (``GraphRunner``; captured on a GPU, run eagerly from the static buffers on the CPU),
  with ``--max-model-len`` as the capacity the graphs were built for.

"host KB" is the bytes of the step's packed host batch (every index tensor the step builds); "build ms"
the host time to build it; "step ms" build + copy + forward (+ device sync); "max RSS MB" the process's
peak host memory so far (run one context per process for each context's own peak). The cache holds no
real history (every sequence reads the same blocks), which changes no shape and no amount of work.

CPU (tiny model)::

    python benchmarks/bench_long_context.py --out benchmarks/results/cpu/long_context.json

GPU (4 layers at V4-Flash widths, bf16, captured graphs; random weights)::

    python benchmarks/bench_long_context.py --gpu --backend nvidia_sm100 --device cuda \\
        --contexts 4096,32768,131072,524288 --batches 1,16,64 --max-model-len 1048576 --chunk 2048 \\
        --out benchmarks/results/h200/long_context.json

(``--gpu --small --device cpu --backend cpu_ref --dtype float32`` runs the GPU path at small widths.)
"""

from __future__ import annotations

import argparse
import json
import platform as host_platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

import torch

from deepinfer_core.model.cache import ModelCache
from deepinfer_core.model.metadata import SeqSpan, build_forward_batch
from deepinfer_core.platform import Platform


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int_list, default=int_list("1024,2048,4096,8192,16384,32768,65536"))
    ap.add_argument("--batches", type=int_list, default=[1, 4])
    ap.add_argument("--max-model-len", type=int, default=131072, help="capacity the decode graphs are built for")
    ap.add_argument("--chunk", type=int, default=256, help="tokens of the prefill chunk measured (0: none)")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--backend", default="cpu_ref")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="float32 on the CPU, bfloat16 with --gpu")
    ap.add_argument("--gpu", action="store_true", help="4 layers at V4-Flash widths, random weights, graphs captured")
    ap.add_argument("--small", action="store_true", help="with --gpu: bench_gpu_decode's small widths (a CPU "
                    "smoke test of the GPU path)")
    ap.add_argument("--kv-fp8", action="store_true",
                    help="DeepSeek's FP8 KV entries (numerics='deepseek''s cache layout; the rest of the model as is)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads on the CPU")
    ap.add_argument("--label", default=None, help="what this run measures (default: the git commit)")
    ap.add_argument("--out", default=None, help="JSON file to write")
    return ap.parse_args(argv)


def tiny_model(a, dtype: torch.dtype, tmp: str):
    from deepinfer_core.models import load_model
    from deepinfer_core.testing.tiny_model import build_tiny_checkpoint

    longest = max(a.max_model_len, max(a.contexts) + max(a.chunk, 1) + 1)
    path = build_tiny_checkpoint(Path(tmp), "tiny", max_position_embeddings=longest)
    return load_model(path, a.backend, dtype, a.device)


def flash_model(a, dtype: torch.dtype):
    """bench_gpu_decode's random model (4 layers at V4-Flash widths) on the device."""
    sys.path.insert(0, str(Path(__file__).parent))
    import bench_gpu_decode as gd

    longest = max(a.max_model_len, max(a.contexts) + max(a.chunk, 1) + 1)
    ga = gd.parse_args(["--backend", a.backend, "--device", a.device, "--dtype", str(dtype).split(".")[-1],
                        "--prompt-len", str(longest), "--gen-len", "1"] + (["--small"] * a.small))
    return gd.RandomModel(ga, torch.device(a.device), dtype).deepinfer_model()


def host_bytes(batch) -> int:
    return sum(t.numel() * t.element_size() for t in batch.tensors().values())


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Harness:
    """One cache big enough for one sequence of the longest context; every sequence of a step reads the
    same blocks (their own state slots)."""

    def __init__(self, model, platform: Platform, a):
        from deepinfer_core.config import CacheConfig
        from deepinfer_core.model.kv_cache_spec import resolve_kv_cache_spec
        from deepinfer_core.plugins import load_backend

        self.model, self.platform, self.bs = model, platform, a.block_size
        longest = max(a.contexts) + max(a.chunk, 1) + 1
        self.blocks = -(-longest // self.bs)
        spec = resolve_kv_cache_spec(load_backend(a.backend).hook, model.cfg, CacheConfig(block_size=self.bs),
                                     model.dtype, "deepseek" if a.kv_fp8 else "transformers")
        self.cache = ModelCache(model.cfg, self.blocks, self.blocks, max(a.batches), self.bs, model.dtype,
                                model.device, spec=spec)
        self.specs, self.window = model.compressor_specs(), model.cfg.sliding_window
        self.graphs = None
        if a.max_model_len:
            from deepinfer_core.worker.graph_runner import GraphRunner

            t0 = time.perf_counter()
            self.graphs = GraphRunner(model, self.cache, sorted(set(a.batches)), a.max_model_len, self.bs,
                                      capture=platform.supports_graphs, platform=platform)
            self.graph_init_s = time.perf_counter() - t0

    def spans(self, ctx: int, new: int, batch: int) -> list[SeqSpan]:
        need = -(-(ctx + new) // self.bs)
        table = list(range(need))
        return [SeqSpan(ctx, new, table, table, slot) for slot in range(batch)]

    def eager(self, ctx: int, new: int, batch: int) -> tuple[int, float, float]:
        """(host bytes, build s, step s) of one eager step."""
        spans = self.spans(ctx, new, batch)
        ids = [2] * (new * batch)
        t0 = time.perf_counter()
        host = build_forward_batch(ids, spans, self.specs, self.bs, self.window, None)
        t1 = time.perf_counter()
        dev = host.with_storage(self.platform.upload(host.packed()))
        self.model.forward(dev, self.cache)
        self.platform.synchronize()
        return host_bytes(host), t1 - t0, time.perf_counter() - t0

    def graph(self, ctx: int, batch: int) -> tuple[int, float, float]:
        spans = self.spans(ctx, 1, batch)
        rows = list(range(batch))
        t0 = time.perf_counter()
        pad = self.graphs.padding_for(spans, rows)
        host = build_forward_batch([2] * batch, spans, self.specs, self.bs, self.window, rows, pad=pad)
        t1 = time.perf_counter()
        self.graphs.replay(self.graphs.load(host))
        self.platform.synchronize()
        return host_bytes(host), t1 - t0, time.perf_counter() - t0


    def graph_phases(self, ctx: int, batch: int) -> dict[str, float]:
        """Milliseconds of one graph step's phases: padding and build_forward_batch, load (the copy into the
        graph's buffers), replay (the launch, host side), wait (until the device is done), and on a GPU
        ``device``: the step's time on the device (CUDA events around load and replay)."""
        spans, rows = self.spans(ctx, 1, batch), list(range(batch))
        cuda = self.model.device.type == "cuda"
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.platform.synchronize()
        t = [time.perf_counter()]
        host = build_forward_batch([2] * batch, spans, self.specs, self.bs, self.window, rows,
                                   pad=self.graphs.padding_for(spans, rows))
        t.append(time.perf_counter())
        if cuda:
            start.record()
        loaded = self.graphs.load(host)
        t.append(time.perf_counter())
        self.graphs.replay(loaded)
        if cuda:
            end.record()
        t.append(time.perf_counter())
        self.platform.synchronize()
        t.append(time.perf_counter())
        out = {name: (b - a) * 1e3 for name, a, b in zip(("build", "load", "replay", "wait"), t, t[1:])}
        if cuda:
            out["device"] = start.elapsed_time(end)
        return out


def measure(fn, warmup: int, reps: int) -> tuple[int, float, float]:
    for _ in range(warmup):
        fn()
    runs = [fn() for _ in range(reps)]
    return runs[0][0], statistics.median(r[1] for r in runs), statistics.median(r[2] for r in runs)


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def setup(a) -> tuple[torch.dtype, torch.device, Platform]:
    """The run's dtype, device and the backend's platform (on the CPU, ``--threads`` torch threads)."""
    from deepinfer_core.plugins import load_backend

    if a.device == "cpu":
        torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype or ("bfloat16" if a.gpu else "float32"))
    device = torch.device(a.device)
    return dtype, device, load_backend(a.backend).hook.deepinfer_platform(device=device) or Platform(device)


def main(argv=None) -> dict:
    a = parse_args(argv)
    dtype, device, platform = setup(a)
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        model = flash_model(a, dtype) if a.gpu else tiny_model(a, dtype, tmp)
        h = Harness(model, platform, a)
        rows = []
        for ctx in a.contexts:
            for batch in a.batches:
                row = dict(context=ctx, batch=batch)
                row["eager_host_bytes"], build, step = measure(partial(h.eager, ctx, 1, batch), a.warmup, a.reps)
                row["eager_build_ms"], row["eager_step_ms"] = build * 1e3, step * 1e3
                if h.graphs is not None and ctx + 1 <= a.max_model_len:
                    row["graph_host_bytes"], build, step = measure(partial(h.graph, ctx, batch), a.warmup, a.reps)
                    row["graph_build_ms"], row["graph_step_ms"] = build * 1e3, step * 1e3
                row["max_rss_mb"] = rss_mb()
                rows.append(row)
                print(_line(row), flush=True)
            if a.chunk:
                row = dict(context=ctx, batch=1, chunk=a.chunk)
                row["eager_host_bytes"], build, step = measure(partial(h.eager, ctx, a.chunk, 1), 1,
                                                                 max(a.reps // 2, 1))
                row["eager_build_ms"], row["eager_step_ms"] = build * 1e3, step * 1e3
                row["max_rss_mb"] = rss_mb()
                rows.append(row)
                print(_line(row), flush=True)
    report = dict(
        benchmark="long_context", label=a.label or git_commit(), commit=git_commit(),
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        host=host_platform.platform(), torch=torch.__version__, device=str(device), backend=a.backend,
        dtype=str(dtype).split(".")[-1],
        model=("bench_gpu_decode-small" if a.small else "v4-flash-4-layers") if a.gpu else "tiny",
        block_size=a.block_size, max_model_len=a.max_model_len, threads=torch.get_num_threads(),
        kv_layout=h.cache.kv_spec.layout,
        graph_init_s=getattr(h, "graph_init_s", None), rows=rows,
    )
    print()
    print(table(report))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(report, indent=2) + "\n")
    return report


HEADERS = ["context", "batch", "new", "eager host KB", "eager build ms", "eager step ms", "graph host KB",
           "graph step ms", "max RSS MB"]


def _cells(row: dict) -> list[str]:
    def f(key, scale=1.0, fmt="{:.2f}"):
        return fmt.format(row[key] * scale) if row.get(key) is not None else "-"

    return [str(row["context"]), str(row["batch"]), str(row.get("chunk", 1)), f("eager_host_bytes", 1 / 1024, "{:.1f}"),
            f("eager_build_ms"), f("eager_step_ms"), f("graph_host_bytes", 1 / 1024, "{:.1f}"), f("graph_step_ms"),
            f("max_rss_mb", fmt="{:.0f}")]


def _line(row: dict) -> str:
    return "  ".join(f"{h}={c}" for h, c in zip(HEADERS, _cells(row)))


def table(report: dict) -> str:
    cells = [HEADERS] + [_cells(r) for r in report["rows"]]
    widths = [max(len(c[i]) for c in cells) for i in range(len(HEADERS))]
    lines = [f"{report['label']}  ({report['model']}, {report['device']}, max_model_len {report['max_model_len']})"]
    for i, c in enumerate(cells):
        lines.append(" | ".join(x.rjust(w) for x, w in zip(c, widths)))
        if i == 0:
            lines.append("-+-".join("-" * w for w in widths))
    return "\n".join(lines)


if __name__ == "__main__":
    main()

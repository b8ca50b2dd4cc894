"""Long context through the engine: prefill tokens/s, TTFT of a prefix-cache hit vs cold, KV + state bytes
per token (measured vs computed) and peak host memory, all through ``LLMEngine`` (chunked prefill, prefix
caching on, ``max_model_len`` far beyond the prompts).

- **prefill**: per ``--prompt-lens`` length ``L``, one request of ``L`` random tokens on a reset prefix
  cache, ``max_tokens=1``: tokens/s = ``L`` / time from ``add_request`` to the step that returns its first
  token (the engine reads the sampled token to the host, so the device has finished; on an accelerator the
  device is also synchronized before the clock starts and when it stops).
- **TTFT, 64K-history turn**: an agent's first turn sends a ``--history-len`` history (cached when it
  ends); the second request re-sends that history plus a ``--turn-len`` new turn ("hit"); then the prefix
  cache is reset and the same second request runs again ("cold"). Its cached tokens come from the
  request's output (``num_cached_tokens``) and the engine's prefix-cache statistics.
- **KV + state bytes per token**: measured = the bytes of the tensors the engine's cache allocated (per
  pool: compressed entries, indexer keys and boundary records; window; compressor state slots), per pool
  row or slot, and in all over the token capacity the engine reports (compressed blocks x block size);
  computed = the memory plan's per-block and per-slot figures (``bytes_per_block``,
  ``bytes_per_state_slot`` in the cache's KV layout), and where the plan runs (budget-sized pools: the
  CPU) ``deepinfer plan``'s own figures. On an accelerator also the device memory the engine's
  construction allocated (pools, graph buffers, sampler) over the same capacity.
- **peak host memory**: the process's ``ru_maxrss``, recorded after every phase.

One warm-up request (one chunk plus a turn, two tokens) runs first; nothing else is repeated.

CPU (tiny model, a few seconds)::

    python benchmarks/bench_long_context_engine.py --out benchmarks/results/cpu/long_context_engine.json

GPU (4 layers at V4-Flash widths, bf16, random weights; ``bench_gpu_decode``'s model)::

    python benchmarks/bench_long_context_engine.py --gpu --backend nvidia_sm100 --device cuda \\
        --prompt-lens 32768,131072 --history-len 65536 --max-model-len 1048576 \\
        --out benchmarks/results/h200/long_context_engine.json

(``--gpu --small --backend cpu_ref --device cpu`` runs the GPU path at bench_gpu_decode's small widths.)
"""

from __future__ import annotations

import argparse
import json
import platform as host_platform
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from deepinfer_core.parallel.memory_plan import storage_bytes

sys.path.insert(0, str(Path(__file__).parent))
import bench_gpu_decode as gd  # noqa: E402
import bench_long_context as blc  # noqa: E402

CPU_DEFAULTS = dict(prompt_lens=[2048, 4096], history_len=2048, max_num_batched_tokens=512)
GPU_DEFAULTS = dict(prompt_lens=[32768, 131072], history_len=65536, max_num_batched_tokens=2048)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", action="store_true", help="4 layers at V4-Flash widths, random weights "
                    "(bench_gpu_decode's model); default: the tiny CPU checkpoint")
    ap.add_argument("--small", action="store_true", help="with --gpu: bench_gpu_decode's small widths")
    ap.add_argument("--backend", default="cpu_ref")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="float32 on the CPU, bfloat16 with --gpu on a device")
    ap.add_argument("--prompt-lens", type=blc.int_list, default=None,
                    help=f"prefill prompts (default {CPU_DEFAULTS['prompt_lens']}; "
                         f"{GPU_DEFAULTS['prompt_lens']} with --gpu on a device)")
    ap.add_argument("--history-len", type=int, default=None,
                    help=f"history of the TTFT turn (default {CPU_DEFAULTS['history_len']}; "
                         f"{GPU_DEFAULTS['history_len']} with --gpu on a device; 0: no TTFT figures)")
    ap.add_argument("--turn-len", type=int, default=256, help="new tokens of the TTFT turn")
    ap.add_argument("--max-model-len", type=int, default=1 << 20)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help=f"the prefill chunk (default {CPU_DEFAULTS['max_num_batched_tokens']}; "
                         f"{GPU_DEFAULTS['max_num_batched_tokens']} with --gpu on a device)")
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=None, help="default: the engine's (tiny) or "
                    "bench_gpu_decode's (--gpu)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--enforce-eager", action="store_true", help="no decode graphs")
    ap.add_argument("--async-scheduling", action="store_true")
    ap.add_argument("--numerics", choices=("deepseek", "transformers"), default=None,
                    help="deepseek: DeepSeek's FP8 KV entries (default: the checkpoint's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads on the CPU")
    ap.add_argument("--label", default=None, help="what this run measures (default: the git commit)")
    ap.add_argument("--out", default=None, help="JSON file to write")
    a = ap.parse_args(argv)
    defaults = GPU_DEFAULTS if a.gpu and a.device != "cpu" else CPU_DEFAULTS
    for key, value in defaults.items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    if a.dtype is None:
        a.dtype = "bfloat16" if a.gpu and a.device != "cpu" else "float32"
    return a


def rss_mb() -> float:
    return blc.rss_mb()


class Bench:
    """The engine under test and the clock around its requests."""

    def __init__(self, a: argparse.Namespace, tmp: str):
        self.a, self.device, self.dtype = a, torch.device(a.device), getattr(torch, a.dtype)
        self.rss = {"start": rss_mb()}
        self.model_summary: dict[str, Any]
        t0 = time.perf_counter()
        engine_args = dict(backend=a.backend, dtype=self.dtype, device=a.device, max_model_len=a.max_model_len,
                           max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                           enable_prefix_caching=True, enforce_eager=a.enforce_eager,
                           async_scheduling=a.async_scheduling, gpu_memory_utilization=a.gpu_memory_utilization,
                           seed=a.seed, numerics=a.numerics)
        if a.block_size:
            engine_args["block_size"] = a.block_size
        if a.device == "cpu":
            engine_args["cpu_threads"] = a.threads  # the engine sets its own count otherwise
        if a.gpu:
            ga = gd.parse_args(["--backend", a.backend, "--device", a.device, "--dtype", a.dtype,
                                "--prompt-len", str(a.max_model_len), "--gen-len", "1", "--seed", str(a.seed)]
                               + ["--small"] * a.small)
            self.random_model = gd.RandomModel(ga, self.device, self.dtype)
            model = self.random_model.deepinfer_model()
            self.model_summary = gd.model_summary(ga, self.random_model) | dict(
                name="bench_gpu_decode-small" if a.small else "v4-flash-4-layers")
            self.model_s = time.perf_counter() - t0
            self.rss["model"] = rss_mb()
            self.sync()
            before = self._allocated()
            t0 = time.perf_counter()
            self.engine = gd.make_engine(model, self.random_model.cfg_dir, **engine_args)
        else:
            from deepinfer_core.engine.args import EngineArgs
            from deepinfer_core.engine.llm_engine import LLMEngine
            from deepinfer_core.testing.tiny_model import build_tiny_checkpoint

            self.random_model = None
            path = build_tiny_checkpoint(Path(tmp) / "tiny", "tiny", max_position_embeddings=a.max_model_len)
            self.model_summary = dict(name="tiny", path=str(path))
            self.model_s = time.perf_counter() - t0
            self.rss["model"] = rss_mb()
            before = None
            t0 = time.perf_counter()
            self.engine = LLMEngine(EngineArgs(model=str(path), **engine_args))
        self.sync()
        self.engine_init_s = time.perf_counter() - t0
        self.engine_device_bytes = None if before is None else self._allocated() - before
        self.rss["engine"] = rss_mb()
        self.gen = torch.Generator().manual_seed(a.seed)
        self.vocab = self.engine.model_config.vocab_size
        self._ids = 0

    def _allocated(self) -> int | None:
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else None

    def sync(self) -> None:
        gd.sync(self.device)

    def tokens(self, n: int) -> list[int]:
        return torch.randint(2, self.vocab, (n,), generator=self.gen).tolist()

    def request(self, ids: list[int], max_tokens: int = 1) -> dict[str, Any]:
        """Run one request alone to completion: its time to first token, steps, cached tokens."""
        from deepinfer_core.sampling.params import SamplingParams

        engine = self.engine
        assert not engine.has_unfinished_requests()
        rid = f"r{self._ids}"
        self._ids += 1
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        stats0 = engine.prefix_cache_stats()
        self.sync()
        t0 = time.perf_counter()
        engine.add_request(rid, {"prompt_token_ids": ids}, params)
        ttft, steps, last = None, 0, None
        most = 4 * (-(-len(ids) // self.a.max_num_batched_tokens) + max_tokens) + 16
        while engine.has_unfinished_requests():
            if steps > most:
                raise RuntimeError(f"request of {len(ids)} tokens unfinished after {steps} steps")
            outs = engine.step()
            steps += 1
            for out in outs:
                if out.request_id != rid:
                    continue
                last = out
                if ttft is None and out.outputs[0].token_ids:
                    self.sync()
                    ttft = time.perf_counter() - t0
                    steps_to_first = steps
        self.sync()
        total = time.perf_counter() - t0
        if last is None or last.error or ttft is None:
            raise RuntimeError(f"request of {len(ids)} tokens failed: {getattr(last, 'error', 'no output')}")
        stats1 = engine.prefix_cache_stats()
        return dict(prompt_tokens=len(ids), ttft_s=ttft, total_s=total, steps_to_first_token=steps_to_first,
                    cached_tokens=last.num_cached_tokens,
                    hit_tokens=stats1["hit_tokens"] - stats0["hit_tokens"],
                    replayed_tokens=stats1["replayed_tokens"] - stats0["replayed_tokens"],
                    max_rss_mb=rss_mb())

    def cold(self, ids: list[int], max_tokens: int = 1) -> dict[str, Any]:
        self.engine.reset_prefix_cache()
        return self.request(ids, max_tokens)


def prefill(b: Bench, lengths: list[int]) -> list[dict[str, Any]]:
    rows = []
    for n in lengths:
        if n + 1 > b.engine.scheduler_config.max_model_len:
            rows.append(dict(prompt_tokens=n, skipped=f"longer than max_model_len "
                                                      f"{b.engine.scheduler_config.max_model_len}"))
            continue
        r = b.cold(b.tokens(n))
        r["tok_s"] = n / r["ttft_s"]
        r["chunks"] = -(-n // b.a.max_num_batched_tokens)
        rows.append(r)
        print(f"prefill {n} tokens: {r['ttft_s']:.3f} s, {r['tok_s']:.0f} tok/s, max RSS {r['max_rss_mb']:.0f} MB",
              flush=True)
    return rows


def ttft(b: Bench, history_len: int, turn_len: int) -> dict[str, Any]:
    """First turn (history), second turn (history + new turn) on that cache, the same turn cold."""
    history, turn = b.tokens(history_len), b.tokens(turn_len)
    first = b.cold(history)
    hit = b.request(history + turn)
    cold = b.cold(history + turn)
    out = dict(history_len=history_len, turn_len=turn_len, first_turn=first, hit=hit, cold=cold,
               speedup=cold["ttft_s"] / hit["ttft_s"])
    print(f"TTFT {history_len}-token history + {turn_len}: hit {hit['ttft_s'] * 1e3:.1f} ms "
          f"({hit['cached_tokens']} cached), cold {cold['ttft_s'] * 1e3:.1f} ms ({cold['cached_tokens']} cached), "
          f"{out['speedup']:.1f}x", flush=True)
    return out


def kv_bytes(b: Bench, lengths: list[int]) -> dict[str, Any]:
    """The cache's tensors per pool vs the memory plan's per-block and per-slot figures."""
    from deepinfer_core.model.cache import bytes_per_block, bytes_per_state_slot
    from deepinfer_core.model.kv_cache_spec import KVCacheSpec
    from deepinfer_core.parallel.memory_plan import measured_memory

    engine = b.engine
    cache, sizes, cfg = engine.cache, engine.pool_sizes, engine.model_config
    spec, bs, dtype = cache.kv_spec, engine.cache_config.block_size, engine.dtype
    seen: set[int] = set()
    measured = {
        "compressed": storage_bytes([cache.comp_kv, cache.index_keys, cache.comp_boundary, cache.index_boundary],
                                     seen),
        "window": storage_bytes(cache.window_kv, seen),
        "state": storage_bytes([cache.comp_state, cache.index_state], seen),
    }
    comp, window = bytes_per_block(cfg, bs, dtype, spec)
    slot = bytes_per_state_slot(cfg, dtype, spec)
    # the cache allocates one row more of each pool than the plan hands out (the trash)
    rows = {"compressed": sizes.num_blocks + 1, "window": sizes.num_window_blocks + 1,
            "state": sizes.num_state_slots + 1}
    computed = {"compressed": rows["compressed"] * comp, "window": rows["window"] * window,
                "state": rows["state"] * slot}
    capacity = sizes.num_blocks * bs
    total = measured_memory(engine.model, cache)["kv_bytes"]  # every tensor the cache holds
    pools = {}
    for name, unit in (("compressed", bs), ("window", bs), ("state", 1)):
        pools[name] = dict(rows=rows[name], measured_bytes=measured[name], computed_bytes=computed[name],
                           unit="token" if unit == bs else "slot",
                           measured_per_unit=measured[name] / (rows[name] * unit),
                           computed_per_unit=computed[name] / (rows[name] * unit))
    window_blocks = -(-cfg.sliding_window // bs) + 1
    dense_comp, dense_window = bytes_per_block(cfg, bs, dtype, KVCacheSpec.default(cfg, bs, dtype))
    per_sequence = [dict(context=n, bytes=-(-n // bs) * comp + window_blocks * window + slot) for n in lengths]
    for row in per_sequence:
        row["bytes_per_token"] = row["bytes"] / row["context"]
    out = dict(
        layout=spec.layout, entry_bytes=spec.entry_bytes, block_size=bs, num_blocks=sizes.num_blocks,
        num_window_blocks=sizes.num_window_blocks, num_state_slots=sizes.num_state_slots,
        capacity_tokens=capacity, max_model_len=engine.scheduler_config.max_model_len,
        budget_bytes=sizes.budget_bytes, pools=pools,
        measured_total_bytes=total, computed_total_bytes=sum(computed.values()),
        measured_bytes_per_capacity_token=total / capacity,
        computed_bytes_per_capacity_token=sum(computed.values()) / capacity,
        compressed_bytes_per_token=comp / bs, window_bytes_per_token=window / bs, state_bytes_per_slot=slot,
        dense_compressed_bytes_per_token=dense_comp / bs, dense_window_bytes_per_token=dense_window / bs,
        per_sequence=per_sequence,
    )
    if b.engine_device_bytes is not None:
        out["engine_device_bytes"] = b.engine_device_bytes
        out["engine_device_bytes_per_capacity_token"] = b.engine_device_bytes / capacity
    out["plan"] = memory_plan(engine)
    return out


def memory_plan(engine) -> dict[str, Any]:
    """``deepinfer plan``'s figures for the engine's arguments, where it plans (budget-sized pools)."""
    from deepinfer_core.parallel.memory_plan import plan_memory

    try:
        rank = plan_memory(engine.args)[0]
    except (ValueError, OSError) as exc:
        return {"skipped": str(exc)}
    return {k: v for k, v in rank.as_dict().items() if k not in ("rank", "device", "expert_slots")}


def environment(device: torch.device) -> dict[str, Any]:
    """bench_gpu_decode's (device name, torch, transformers, triton) and the host's."""
    return gd.environment(device) | dict(host=host_platform.platform(), python=host_platform.python_version(),
                                         threads=torch.get_num_threads())


def main(argv=None) -> dict:
    a = parse_args(argv)
    threads = torch.get_num_threads()
    if a.device == "cpu":
        torch.set_num_threads(a.threads)
    try:
        return run(a)
    finally:
        torch.set_num_threads(threads)


def run(a: argparse.Namespace) -> dict:
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        b = Bench(a, tmp)
        engine = b.engine
        chunk = a.max_num_batched_tokens
        warm = b.cold(b.tokens(chunk + a.turn_len), max_tokens=2)  # kernels, a full and a turn-sized chunk
        b.rss["warmup"] = rss_mb()
        rows = prefill(b, a.prompt_lens)
        b.rss["prefill"] = rss_mb()
        turn = None
        if a.history_len:
            turn = ttft(b, a.history_len, a.turn_len)
            b.rss["ttft"] = rss_mb()
        kv = kv_bytes(b, sorted({*a.prompt_lens, a.max_model_len}))
        device = {}
        if b.device.type == "cuda":
            device = dict(peak_allocated_bytes=torch.cuda.max_memory_allocated(b.device),
                          allocated_bytes=torch.cuda.memory_allocated(b.device))
        report = dict(
            benchmark="long_context_engine", label=a.label or blc.git_commit(), commit=blc.git_commit(),
            date=datetime.now(timezone.utc).isoformat(timespec="seconds"), **environment(b.device),
            backend=a.backend, dtype=a.dtype, model=b.model_summary,
            engine=dict(max_model_len=engine.scheduler_config.max_model_len, max_num_batched_tokens=chunk,
                        max_num_seqs=a.max_num_seqs, block_size=engine.cache_config.block_size,
                        enforce_eager=a.enforce_eager, async_scheduling=a.async_scheduling, numerics=a.numerics,
                        decode_graphs=engine.runner.graph_runner is not None,
                        gpu_memory_utilization=a.gpu_memory_utilization),
            model_s=b.model_s, engine_init_s=b.engine_init_s, warmup=warm,
            prefill=rows, ttft=turn, kv=kv, device_memory=device,
            max_rss_mb=rss_mb(), rss_mb_after=b.rss, wall_s=time.perf_counter() - start,
        )
        if b.random_model is not None:
            b.random_model.cleanup()
    print()
    print(markdown(report))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(report, indent=2) + "\n")
    return report


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" for _ in headers) + "|"]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def markdown(r: dict) -> str:
    e, kv = r["engine"], r["kv"]
    lines = [f"**{r['label']}**: {r['model']['name']}, {r['device']}, {r['backend']} {r['dtype']}, "
             f"max_model_len {e['max_model_len']}, chunk {e['max_num_batched_tokens']}, "
             f"block {e['block_size']}, decode graphs {'on' if e['decode_graphs'] else 'off'}"
             f"{', async' if e['async_scheduling'] else ''}; engine init {r['engine_init_s']:.1f} s", ""]
    rows = []
    for p in r["prefill"]:
        if "skipped" in p:
            rows.append([str(p["prompt_tokens"]), "-", "-", "-", p["skipped"]])
            continue
        rows.append([str(p["prompt_tokens"]), str(p["steps_to_first_token"]), f"{p['ttft_s']:.3f}",
                     f"{p['tok_s']:.0f}", f"{p['max_rss_mb']:.0f}"])
    lines += _table(["prompt tokens", "steps", "prefill s", "tok/s", "max RSS MB"], rows) + [""]
    t = r["ttft"]
    if t is not None:
        rows = []
        for name in ("first_turn", "hit", "cold"):
            x = t[name]
            rows.append([name.replace("_", " "), str(x["prompt_tokens"]), str(x["cached_tokens"]),
                         str(x["replayed_tokens"]), str(x["steps_to_first_token"]), f"{x['ttft_s'] * 1e3:.1f}"])
        lines += _table(["turn", "prompt tokens", "cached", "replayed", "steps", "TTFT ms"], rows)
        lines += ["", f"prefix hit: TTFT {t['speedup']:.1f}x faster than cold "
                  f"({t['history_len']}-token history + {t['turn_len']}-token turn)", ""]
    rows = []
    for name, p in kv["pools"].items():
        rows.append([name, str(p["rows"]), f"{p['measured_bytes'] / 2**20:.2f}", f"{p['computed_bytes'] / 2**20:.2f}",
                     f"{p['measured_per_unit']:.1f} / {p['unit']}", f"{p['computed_per_unit']:.1f} / {p['unit']}"])
    rows.append(["all, per capacity token", str(kv["capacity_tokens"]), f"{kv['measured_total_bytes'] / 2**20:.2f}",
                 f"{kv['computed_total_bytes'] / 2**20:.2f}", f"{kv['measured_bytes_per_capacity_token']:.1f}",
                 f"{kv['computed_bytes_per_capacity_token']:.1f}"])
    if "engine_device_bytes" in kv:
        rows.append(["device, engine init", str(kv["capacity_tokens"]), f"{kv['engine_device_bytes'] / 2**20:.2f}",
                     "-", f"{kv['engine_device_bytes_per_capacity_token']:.1f}", "-"])
    lines += _table(["KV pool", "rows", "measured MiB", "computed MiB", "measured B", "computed B"], rows)
    plan = kv["plan"]
    if "skipped" in plan:
        lines.append(f"deepinfer plan: not run ({plan['skipped']})")
    else:
        lines.append(f"deepinfer plan: {plan['kv_bytes'] / 2**20:.2f} MiB, {plan['compressed_bytes_per_token']:.1f} "
                     f"compressed + {plan['window_bytes_per_token']:.1f} window B/token")
    lines.append(f"{kv['layout']} entries of {kv['entry_bytes']} B; per sequence (compressed + its window + its "
                 "state slot): " + ", ".join(f"{s['bytes_per_token']:.1f} B/token at {s['context']}"
                                              for s in kv["per_sequence"]))
    peak = r["device_memory"].get("peak_allocated_bytes")
    lines += ["", f"peak host memory (ru_maxrss) {r['max_rss_mb']:.0f} MB"
              + (f"; peak device memory after the engine's profiling {peak / 2**30:.1f} GiB" if peak else "")
              + f"; wall {r['wall_s']:.1f} s"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()

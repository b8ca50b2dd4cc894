"""Prefix caching benchmark: N requests sharing a long prefix, caching on vs off (and the replay path).

Prints a table and writes JSON. Example: ``python benchmarks/bench_prefix_cache.py --prefix-len 3900``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import datetime, timezone

import torch

from deepinfer_core.entrypoints import LLM, SamplingParams
from deepinfer_core.model.cache import bytes_per_block


def _prompts(n: int, prefix_len: int, suffix_len: int, vocab: int) -> tuple[list[int], list[list[int]]]:
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(2, vocab, (prefix_len,), generator=gen).tolist()
    return prefix, [prefix + torch.randint(2, vocab, (suffix_len,), generator=gen).tolist() for _ in range(n)]


def _timed(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, float]:
    """(time until every request has its first token, total time) for one concurrent batch."""
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(f"b{time.perf_counter_ns()}-{i}", {"prompt_token_ids": p}, params)
    start, ttft, started = time.perf_counter(), None, set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs[0].token_ids:
                started.add(out.request_id)
        if ttft is None and len(started) == len(prompts):
            ttft = time.perf_counter() - start
    return ttft or time.perf_counter() - start, time.perf_counter() - start


def _evict_last_window_blocks(llm: LLM, prompts: list[list[int]]) -> None:
    """Drop the cached window blocks of each prompt's last full block, forcing the replay path."""
    from deepinfer_core.engine.sequence import Sequence

    bm = llm.llm_engine.block_manager
    for p in prompts:
        seq = Sequence("probe", 0, p, SamplingParams(), None)
        last = (len(p) - 1) // bm.block_size - 1
        block = bm.window_blocks.lookup(bm.block_hashes(seq, last + 1)[last])
        if block is not None and bm.window_blocks.ref[block] == 0:
            bm.window_blocks.lru.pop(block)
            bm.window_blocks._forget(block)
            bm.window_blocks.free.append(block)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--backend", default="cpu_ref")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=3900)
    ap.add_argument("--suffix-len", type=int, default=16)
    ap.add_argument("--gen-len", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json-out", default="bench_results/prefix_cache.json")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    params = SamplingParams(temperature=0, max_tokens=args.gen_len, ignore_eos=True)
    rows = {}
    for mode in ("off", "on", "replay"):
        llm = LLM(args.model, backend=args.backend, dtype=args.dtype, enable_prefix_caching=mode != "off",
                  cpu_threads=args.threads,
                  max_model_len=args.prefix_len + args.suffix_len + args.gen_len + 1,
                  max_num_batched_tokens=4096)
        engine = llm.llm_engine
        prefix, prompts = _prompts(args.num_requests, args.prefix_len, args.suffix_len, engine.model_config.vocab_size)
        warm_ttft, warm_total = _timed(llm, [prefix + [3]], params)  # computes (and caches) the prefix once
        if mode == "replay":
            _evict_last_window_blocks(llm, prompts)
        ttft, total = _timed(llm, prompts, params)
        stats = engine.prefix_cache_stats()
        rows[mode] = {"first_request_ttft_s": warm_ttft, "batch_ttft_s": ttft, "batch_total_s": total,
                      "hit_rate": stats["hit_rate"], "replayed_tokens": stats["replayed_tokens"]}
        comp, window = bytes_per_block(engine.model_config, engine.args.block_size, engine.dtype)
        rows["bytes_per_block"] = {"compressed": comp, "window": window, "block_size": engine.args.block_size}
    off = rows["off"]
    for mode in ("on", "replay"):
        rows[mode]["ttft_speedup_vs_off"] = off["batch_ttft_s"] / rows[mode]["batch_ttft_s"]
        rows[mode]["total_speedup_vs_off"] = off["batch_total_s"] / rows[mode]["batch_total_s"]
    print(f"{args.num_requests} requests sharing a {args.prefix_len}-token prefix (+{args.suffix_len} own tokens, "
          f"{args.gen_len} generated), {args.backend} {args.dtype}")
    header = ("mode", "batch TTFT s", "total s", "TTFT x", "total x", "hit rate", "replayed")
    print(f"{header[0]:8}" + "".join(f" {h:>{w}}" for h, w in zip(header[1:], (13, 9, 8, 8, 9, 9))))
    for mode in ("off", "on", "replay"):
        r = rows[mode]
        print(f"{mode:8} {r['batch_ttft_s']:13.3f} {r['batch_total_s']:9.3f} {r.get('ttft_speedup_vs_off', 1):8.2f} "
              f"{r.get('total_speedup_vs_off', 1):8.2f} {r['hit_rate']:9.3f} {r['replayed_tokens']:9d}")
    b = rows["bytes_per_block"]
    print(f"a cached block ({b['block_size']} tokens) costs {b['compressed']} B compressed + {b['window']} B window "
          "(window bytes only while its blocks stay cached)")
    report = {"config": vars(args), "results": rows, "torch": torch.__version__, "threads": torch.get_num_threads(),
              "machine": platform.machine(), "date": datetime.now(timezone.utc).isoformat()}
    if args.json_out:
        from pathlib import Path

        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()

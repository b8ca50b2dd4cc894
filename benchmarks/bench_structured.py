"""Structured-output overhead (xgrammar mask on vs off) and the cost of batch-invariant mode.

* structured: ``--num-requests`` prompts generate under a compact JSON schema (bounded, so every
  request ends by itself); the same prompts then generate without a constraint, each exactly as many
  tokens as its constrained run produced (``ignore_eos``), in one batch both times. Reported: generated
  tokens/s of each and the end-to-end overhead, the direct cost of the grammar (filling xgrammar's
  bitmask on the host, the ``apply_token_bitmask`` op, advancing the matchers) as a share of the
  constrained run, and the grammar compile time (first compile, then a cache hit). The end-to-end
  figure also moves with what is generated (masked logits sort faster in top-k/top-p; which experts
  the tokens route to changes the MoE's work), so it can come out either side of the direct cost.
* batch-invariant: the same unconstrained batch (prefill + decode) and a prefill-only batch with
  ``batch_invariant`` off and on.

Each timed run is repeated ``--repeats`` times after a warm-up; the best is kept. Prints a table and
writes JSON. Example: ``python benchmarks/bench_structured.py --num-requests 16``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from deepinfer_core.entrypoints import LLM, SamplingParams
from deepinfer_core.sampling.params import StructuredOutputsParams
from deepinfer_core.sampling.structured import GrammarState

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tag": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "ok", "tag"],
    "additionalProperties": False,
}


def _block(args: argparse.Namespace) -> dict:
    """The block size and torch thread count asked for (the engine sets its own count otherwise)."""
    return {k: v for k, v in (("block_size", args.block_size), ("cpu_threads", args.threads)) if v is not None}


def _prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(2, vocab, (length,), generator=gen).tolist()} for _ in range(n)]


def _run(llm: LLM, prompts: list[dict], params) -> tuple[float, list]:
    """(wall time, outputs) of one batch; prefix caching is reset first so every run does all the work."""
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, outs


def _best_interleaved(runs: dict, repeats: int) -> dict:
    """name -> (best time, outputs of the first run); the runs alternate, so load drifts hit all alike."""
    best: dict = {}
    for _ in range(repeats):
        for name, run in runs.items():
            elapsed, outs = run()
            prev = best.get(name)
            best[name] = (min(elapsed, prev[0]), prev[1]) if prev else (elapsed, outs)
    return best


def _speculative(args: argparse.Namespace) -> dict:
    if not args.speculative:
        return {}
    return {"speculative_config": {"method": "mtp", "num_speculative_tokens": args.speculative}}


def _acceptance_length(engine, run) -> float | None:
    """Mean acceptance length (tokens a verification step) of ``run()`` alone; None without speculation."""
    before = engine.spec_decode_stats()
    if before is None:
        return None
    run()
    after = engine.spec_decode_stats()
    steps = after["num_drafts"] - before["num_drafts"]
    return (steps + after["num_accepted_tokens"] - before["num_accepted_tokens"]) / max(steps, 1)


def bench_structured(args: argparse.Namespace) -> dict:
    llm = LLM(args.model, backend=args.backend, dtype=args.dtype, **_block(args), **_speculative(args))
    engine = llm.llm_engine
    prompts = _prompts(args.num_requests, args.prompt_len, engine.model_config.vocab_size)
    constraint = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    start = time.perf_counter()
    engine.structured.compile(constraint)
    first_compile = time.perf_counter() - start
    start = time.perf_counter()
    engine.structured.compile(constraint)
    cached_compile = time.perf_counter() - start

    fill = {"s": 0.0, "calls": 0}
    original = engine.structured.bitmask

    def timed_bitmask(states, drafts=None):
        t = time.perf_counter()
        out = original(states, drafts)
        fill["s"] += time.perf_counter() - t
        fill["calls"] += 1
        return out

    engine.structured.bitmask = timed_bitmask
    ops = engine.model.ops
    apply_op = ops.apply_token_bitmask

    def timed_apply(logits, bitmask):
        t = time.perf_counter()
        out = apply_op(logits, bitmask)
        fill["apply_s"] = fill.get("apply_s", 0.0) + time.perf_counter() - t
        return out

    ops.apply_token_bitmask = timed_apply
    accept = GrammarState.accept

    def timed_accept(state, token):
        t = time.perf_counter()
        ok = accept(state, token)
        fill["accept_s"] = fill.get("accept_s", 0.0) + time.perf_counter() - t
        return ok

    GrammarState.accept = timed_accept
    on_params = [SamplingParams(temperature=args.temperature, seed=i, max_tokens=args.max_tokens,
                                structured_outputs=constraint) for i in range(args.num_requests)]
    llm.generate(prompts[:2], on_params[:2], use_tqdm=False)  # warm-up
    fill.update(s=0.0, calls=0, apply_s=0.0, accept_s=0.0)
    on_once_s, on_outs = _run(llm, prompts, on_params)
    fill_s, fill_calls, apply_s, accept_s = fill["s"], fill["calls"], fill["apply_s"], fill["accept_s"]
    GrammarState.accept = accept
    counts = [len(o.outputs[0].token_ids) for o in on_outs]
    valid = sum(o.outputs[0].finish_reason == "stop" and _valid_json(o.outputs[0].text) for o in on_outs)
    off_params = [SamplingParams(temperature=args.temperature, seed=i, max_tokens=c, ignore_eos=True)
                  for i, c in enumerate(counts)]
    best = _best_interleaved({"on": lambda: _run(llm, prompts, on_params),
                              "off": lambda: _run(llm, prompts, off_params)}, args.repeats)
    on_s, off_s = best["on"][0], best["off"][0]
    acceptance = {"on": _acceptance_length(engine, lambda: _run(llm, prompts, on_params)),
                  "off": _acceptance_length(engine, lambda: _run(llm, prompts, off_params))}
    tokens = sum(counts)
    return {
        "requests": args.num_requests, "generated_tokens": tokens, "valid_outputs": valid,
        "off": {"seconds": off_s, "tokens_per_s": tokens / off_s},
        "on": {"seconds": on_s, "tokens_per_s": tokens / on_s, "bitmask_fill_s": fill_s, "bitmask_calls": fill_calls,
               "apply_token_bitmask_s": apply_s, "matcher_accept_s": accept_s},
        "overhead_pct": 100 * (on_s / off_s - 1),
        "mask_share_pct": 100 * (fill_s + apply_s + accept_s) / on_once_s,
        "compile_s": {"first": first_compile, "cached": cached_compile},
        "spec_decode": engine.spec_decode_stats(), "acceptance_length": acceptance,
    }


def _valid_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def bench_batch_invariant(args: argparse.Namespace) -> dict:
    llms = {mode: LLM(args.model, backend=args.backend, dtype=args.dtype, batch_invariant=mode == "on", **_block(args))
            for mode in ("off", "on")}
    vocab = llms["off"].llm_engine.model_config.vocab_size
    prompts = _prompts(args.num_requests, args.prompt_len, vocab, seed=1)
    long_prompts = _prompts(args.num_requests, args.prefill_len, vocab, seed=2)
    params = SamplingParams(temperature=args.temperature, seed=0, max_tokens=args.max_tokens, ignore_eos=True)
    runs = {}
    for mode, llm in llms.items():
        llm.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        runs[mode, "generate"] = lambda llm=llm: _run(llm, prompts, params)
        runs[mode, "prefill"] = lambda llm=llm: _run(llm, long_prompts, SamplingParams(max_tokens=1))
    best = _best_interleaved(runs, args.repeats)
    rows = {}
    for mode in ("off", "on"):
        gen_s, prefill_s = best[mode, "generate"][0], best[mode, "prefill"][0]
        rows[mode] = {
            "generate_s": gen_s, "generated_tokens_per_s": args.num_requests * args.max_tokens / gen_s,
            "prefill_s": prefill_s, "prefill_tokens_per_s": args.num_requests * args.prefill_len / prefill_s,
        }
    rows["generate_slowdown"] = rows["on"]["generate_s"] / rows["off"]["generate_s"]
    rows["prefill_slowdown"] = rows["on"]["prefill_s"] / rows["off"]["prefill_s"]
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the embedded tiny checkpoint)")
    ap.add_argument("--backend", default="cpu_ref")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--block-size", type=int, default=None, help="KV block size (default: the engine's)")
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--prefill-len", type=int, default=256, help="prompt length of the prefill-only batch")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--speculative", type=int, default=0, metavar="K",
                    help="structured output with K MTP drafts a step (both runs; the mask covers every draft)")
    ap.add_argument("--skip-batch-invariant", action="store_true")
    ap.add_argument("--json-out", default="bench_results/structured.json")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    report: dict = {"config": vars(args), "torch": torch.__version__, "threads": torch.get_num_threads(),
                    "machine": platform.machine(), "date": datetime.now(timezone.utc).isoformat()}
    s = report["structured"] = bench_structured(args)
    print(f"structured output: {s['requests']} requests, {s['generated_tokens']} tokens, {args.backend} {args.dtype}, "
          f"{report['threads']} thread(s); {s['valid_outputs']}/{s['requests']} outputs valid JSON")
    print(f"  {'mode':10} {'seconds':>9} {'tokens/s':>10}")
    print(f"  {'off':10} {s['off']['seconds']:9.3f} {s['off']['tokens_per_s']:10.1f}")
    print(f"  {'on':10} {s['on']['seconds']:9.3f} {s['on']['tokens_per_s']:10.1f}")
    on = s["on"]
    print(f"  end-to-end {s['overhead_pct']:+.1f}%; the grammar work itself: {s['mask_share_pct']:.1f}% of the "
          f"constrained run (bitmask fill {1e3 * on['bitmask_fill_s']:.1f} ms + apply_token_bitmask "
          f"{1e3 * on['apply_token_bitmask_s']:.1f} ms + matcher accept {1e3 * on['matcher_accept_s']:.1f} ms over "
          f"{on['bitmask_calls']} steps); compile {1e3 * s['compile_s']['first']:.1f} ms first, "
          f"{1e6 * s['compile_s']['cached']:.0f} us cached")
    if s["spec_decode"]:
        print(f"  speculative k={args.speculative}: mean acceptance length {s['acceptance_length']['on']:.2f} "
              f"constrained, {s['acceptance_length']['off']:.2f} unconstrained")
    if not args.skip_batch_invariant:
        b = report["batch_invariant"] = bench_batch_invariant(args)
        print(f"batch-invariant mode ({args.num_requests} requests; generate: {args.prompt_len}-token prompts, "
              f"{args.max_tokens} tokens each; prefill: {args.prefill_len}-token prompts)")
        print(f"  {'mode':10} {'generated tok/s':>16} {'prefill tok/s':>14}")
        for mode in ("off", "on"):
            r = b[mode]
            print(f"  {mode:10} {r['generated_tokens_per_s']:16.1f} {r['prefill_tokens_per_s']:14.1f}")
        print(f"  slowdown: generate x{b['generate_slowdown']:.2f}, prefill x{b['prefill_slowdown']:.2f}")
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()

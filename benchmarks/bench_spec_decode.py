"""Speculative decoding benchmark: MTP acceptance and per-user speed, speculation off vs on.

``--mode acceptance`` (default): the trained default model continues prompts cut from held-out text
(``data/heldout_slice.txt``) greedily with k = 1, 2, 3 drafts; reports the mean acceptance length (tokens
per verification step), the acceptance rate and the acceptance per draft position, and checks that every
run produced the tokens of the run without speculation.

``--mode speed``: per-user and total tokens/s at each batch size, speculation off (CUDA graphs where the
backend has them, and eagerly as speculation runs its steps) vs a fixed k vs
confidence-scheduled, in one run (any backend: ``--backend nvidia_sm100 --dtype bfloat16`` on a GPU).
``--force-acceptance P`` replaces verification by accepting each draft with probability P (the output is
then not the model's; it shows what the scheduler chooses at a given acceptance, e.g. with random weights).
``--virtual-clock h200-trained`` times the steps by another machine's measured step costs
(``benchmarks/step_costs.json``, read by ``deepinfer_core.testing.virtual_clock``): the tokens,
acceptance and scheduling are this run's, the seconds those the H200 would take, so the confidence
scheduler's choices can be checked on a CPU.
``--waves W`` serves batch x W requests, at most batch at once: one closed batch (W = 1) ends with its
slowest request, and speculation's requests finish over many steps (their acceptance differs), so its
last steps decode a few sequences; with more waves the batch stays full until the last one.
``--max-tokens-spread F`` gives requests different lengths in every mode (plain decode's requests
otherwise all end in one step, and the next wave's prompts all start in one step).

Prints a table and writes JSON (``--json-out``). Example (CPU):
``python benchmarks/bench_spec_decode.py --mode acceptance --max-tokens 64``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import random
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from deepinfer_core.entrypoints import LLM, SamplingParams
from deepinfer_core.spec_decode.gate import bucket
from deepinfer_core.testing.virtual_clock import StepCosts, VirtualClock, load_step_costs

HELDOUT = Path(__file__).resolve().parents[1] / "data" / "heldout_slice.txt"
#: the measured step costs of the benchmark machines, by name (--virtual-clock NAME)
STEP_COSTS = load_step_costs(Path(__file__).resolve().with_name("step_costs.json"))


def step_costs(text: str) -> StepCosts:
    """--virtual-clock: a name of :data:`STEP_COSTS` or ``P1,P64,S1,S64``."""
    return StepCosts.parse(text, STEP_COSTS)


def _spec(k: int, schedule: str = "fixed", method: str = "mtp") -> dict:
    return {"method": method, "num_speculative_tokens": k, "schedule": schedule}


def _prompts(llm: LLM, n: int, length: int) -> list[list[int]]:
    if llm.llm_engine.tokenizer is None:  # random weights: random prompts
        gen = torch.Generator().manual_seed(n * 7919 + length)
        return torch.randint(2, llm.llm_engine.model_config.vocab_size, (n, length), generator=gen).tolist()
    ids = llm.llm_engine.encode(HELDOUT.read_text())
    stride = max(1, (len(ids) - length) // max(1, n))
    return [ids[i * stride: i * stride + length] for i in range(n)]


def _request_params(params: SamplingParams, n: int, spread: float) -> list[SamplingParams]:
    """``n`` requests' parameters: ``params`` with max_tokens drawn uniformly (seeded by ``n``) from
    max_tokens x [1 - spread, 1 + spread], the same draws for every mode."""
    if not spread:
        return [params] * n
    gen = random.Random(n)
    low, high = round(params.max_tokens * (1 - spread)), round(params.max_tokens * (1 + spread))
    return [dataclasses.replace(params, max_tokens=gen.randint(max(1, low), high)) for _ in range(n)]


def _generate(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
              clock: VirtualClock | None = None) -> tuple[list[list[int]], float]:
    """The outputs and the seconds they took (by ``clock`` where given, else the wall clock)."""
    now = (lambda: clock.now) if clock is not None else time.perf_counter
    with clock.attach(llm) if clock is not None else contextlib.nullcontext():  # one clock at a time
        start = now()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], now() - start


def acceptance(args, engine_kw: dict) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    plain = LLM(args.model, **engine_kw)
    prompts = _prompts(plain, args.num_prompts, args.prompt_len)
    ref, t_plain = _generate(plain, prompts, params)
    rows = [{"k": 0, "seconds": t_plain, "mean_acceptance_length": 1.0}]
    for k in args.ks:
        llm = LLM(args.model, speculative_config=_spec(k, method=args.method), **engine_kw)
        tests = _record_tests(llm)
        got, seconds = _generate(llm, prompts, params)
        stats = llm.llm_engine.spec_decode_stats()
        per_pos = [a / v if v else 0.0 for a, v in zip(stats["accepted_per_position"], stats["verified_per_position"])]
        rows.append({"k": k, "seconds": seconds, "greedy_equal": got == ref,
                     "mean_acceptance_length": stats["mean_acceptance_length"],
                     "acceptance_rate": stats["acceptance_rate"], "acceptance_per_position": per_pos,
                     "calibration_error": calibration_error(tests), "confidence_tests": len(tests), **stats})
    print(f"{'k':>3} {'accept len':>10} {'accept rate':>11} {'per position':>24} {'ECE':>6} {'equal':>6} "
          f"{'seconds':>8}")
    for r in rows:
        pos = " ".join(f"{x:.2f}" for x in r.get("acceptance_per_position", []))
        ece = r.get("calibration_error")
        print(f"{r['k']:>3} {r['mean_acceptance_length']:>10.3f} {r.get('acceptance_rate', 0):>11.3f} {pos:>24} "
              f"{'-' if ece is None else f'{ece:.3f}':>6} {str(r.get('greedy_equal', '-')):>6} {r['seconds']:>8.2f}")
    return {"prompts": len(prompts), "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "rows": rows}


def force_acceptance(rate: float, seed: int = 0) -> None:
    """Make verification accept each draft with probability ``rate`` (benchmark only: not lossless), in
    every verification path: sampled, all-greedy, and the greedy verification captured beside the decode
    graphs (:mod:`~deepinfer_core.spec_decode.verify_graph`), where the draw is the device's default
    generator (a capture takes no other)."""
    from deepinfer_core.spec_decode import rejection_sampler, verifier, verify_graph

    gens: dict[torch.device, torch.Generator] = {}
    exact = rejection_sampler.rejection_sample

    def forced(target_probs, draft_token_ids, num_drafts, uniforms, noise, draft_probs=None, greedy=None):
        out = exact(target_probs, draft_token_ids, num_drafts, uniforms, noise, draft_probs, greedy)
        return force(out, draft_token_ids, num_drafts)

    def force(out, draft_token_ids, num_drafts):
        s, k = draft_token_ids.shape
        device = num_drafts.device
        if gens.get(device) is None:  # on the verification's device: a host draw would wait for the step
            gens[device] = torch.Generator(device).manual_seed(seed)
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        passed = torch.rand(s, k, generator=None if capturing else gens[device], device=device) < rate
        passed &= torch.arange(k, device=num_drafts.device).unsqueeze(0) < num_drafts.unsqueeze(1)
        n = passed.long().cumprod(dim=1).sum(dim=1)
        rows = torch.arange(k + 1, device=n.device).unsqueeze(0)
        tokens = torch.cat([draft_token_ids, out.output_token_ids[:, :1]], dim=1)
        last = out.output_token_ids.gather(1, out.num_accepted.unsqueeze(1))
        tokens = torch.where(rows == n.unsqueeze(1), last.expand_as(tokens), tokens)
        tokens = torch.where(rows > n.unsqueeze(1), torch.full_like(tokens, -1), tokens)
        return rejection_sampler.VerifyOutput(tokens, n)

    exact_greedy = rejection_sampler.greedy_verify

    def forced_greedy(target_logits, draft_token_ids, num_drafts):
        out = exact_greedy(target_logits, draft_token_ids, num_drafts)
        return force(out, draft_token_ids, num_drafts)

    verifier.rejection_sample = forced
    verifier.greedy_verify = forced_greedy  # the path of all-greedy batches
    verify_graph.greedy_verify = forced_greedy  # and of chained steps' verification graphs


def _trace_gate(llm) -> list[str] | None:
    """The speculation gate's decisions, one letter each: S/P speculative/plain where that mode was the
    faster one measured in the step's bucket, s/p where it was not (a probe, or nothing measured), '|N:'
    where the bucket changes to N, and '<spec/plain>' (tokens/s) where an interval begins, with the rates
    it compared."""
    gate = llm.llm_engine.drafts and llm.llm_engine.drafts.gate
    if gate is None:
        return None
    trace, decide, choose, last = [], gate.decide, gate._choose, [None]

    def chose(b, spec: float) -> bool:
        before = (b.best, b.next_probe)
        mode = choose(b, spec)
        if (b.best, b.next_probe) != before:
            trace.append(f"<{spec:.0f}/{b.rate(False):.0f}>")
        return mode

    gate._choose = chose

    def traced(num_decoding: int, decode_only: bool = True) -> bool:
        mode = decide(num_decoding, decode_only)
        key = bucket(num_decoding)
        if key != last[0]:
            trace.append(f"|{key}:")
            last[0] = key
        b = gate.buckets.get(key)
        best = b is not None and b.best == mode
        trace.append(("S" if mode else "P") if best else ("s" if mode else "p"))
        return mode

    gate.decide = traced
    return trace


def _log_steps(llm) -> list[list[list]]:
    """Every finished step of the engine, into the last run's list: [finish time (ms, perf_counter), launch
    time (ms), sequences sampled, tokens computed, speculative (it drafted), output tokens, decode only (no
    prompt chunk)]; the bench starts a list for each measured run. ``summarize_step_log.py`` reads them."""
    engine, runs = llm.llm_engine, []
    drafts = engine.drafts is not None
    finish = engine._finish

    def logged(launched, touched, pipelined=False):
        before = sum(len(s.output_token_ids) - s.num_inflight for s in launched.sampled)
        finish(launched, touched, pipelined)
        after = sum(len(s.output_token_ids) - s.num_inflight for s in launched.sampled)
        if not runs:
            return
        runs[-1].append([round(time.perf_counter() * 1e3, 3), round(launched.started * 1e3, 3),
                         len(launched.sampled), launched.num_tokens, int(drafts and launched.speculate),
                         after - before, int(launched.decode_only)])

    engine._finish = logged
    return runs


@dataclasses.dataclass
class _Mode:
    name: str
    llm: LLM
    trace: list[str] | None
    clock: VirtualClock | None
    steps: list[list[list]] | None = None  # per measured run, its steps (``_log_steps``)


def _speed_rows(args, modes: list[_Mode], batch: int, params: SamplingParams) -> list[dict]:
    """Every mode's row at one batch size: each mode's warm-up run, then the measured runs in rotation
    (repeat r starts at mode r), so that a machine's drift over the run (clocks, another tenant) falls on
    every mode alike instead of on whichever ran last."""
    runs, before = {m.name: [] for m in modes}, {}
    prompts = _prompts(modes[0].llm, batch * args.waves, args.prompt_len)  # every mode serves the same model
    requests = _request_params(params, batch * args.waves, args.max_tokens_spread)
    tokens = sum(p.max_tokens for p in requests)  # ignore_eos: every request runs to its max_tokens
    caps = [(m, m.llm.llm_engine.scheduler.config.max_num_seqs) for m in modes]
    try:
        for m in modes:
            m.llm.llm_engine.scheduler.config.max_num_seqs = batch  # later waves join as earlier requests finish
            if m.steps is not None:  # the warm-up's steps, left out of the row
                m.steps.append([])
            if not args.no_warmup:  # the measured run's shapes, so that no kernel compiles inside it
                _generate(m.llm, prompts, requests, m.clock)
            if m.trace is not None:
                m.trace.clear()
            before[m.name] = m.llm.llm_engine.spec_decode_stats()
        for r in range(args.repeats):
            for m in modes[r % len(modes):] + modes[:r % len(modes)]:
                if m.steps is not None:
                    m.steps.append([])
                runs[m.name].append(_generate(m.llm, prompts, requests, m.clock)[1])
    finally:
        for m, cap in caps:
            m.llm.llm_engine.scheduler.config.max_num_seqs = cap
    rows = []
    for m in modes:
        seconds = statistics.median(runs[m.name])
        total = tokens / seconds
        row = {"mode": m.name, "batch": batch, "requests": len(prompts), "seconds": seconds,
               "total_tok_s": total, "per_user_tok_s": total / batch, "run_seconds": runs[m.name]}
        stats, start = m.llm.llm_engine.spec_decode_stats(), before[m.name]
        if stats is not None:
            steps = stats["num_drafts"] - start["num_drafts"]
            acc = stats["num_accepted_tokens"] - start["num_accepted_tokens"]
            verified = stats["num_draft_tokens"] - start["num_draft_tokens"]
            row.update(mean_acceptance_length=1 + acc / steps if steps else 1.0,
                       drafts_verified_per_step=verified / steps if steps else 0.0)
            if "gate" in stats:  # confidence scheduling's plain steps (no drafting) among all
                plain = stats["gate"]["plain_steps"] - start["gate"]["plain_steps"]
                spec_steps = stats["gate"]["speculative_steps"] - start["gate"]["speculative_steps"]
                row["plain_step_share"] = plain / max(1, plain + spec_steps)
                row["gate"] = stats["gate"]  # what it measured per batch bucket, after the runs
            profile = m.llm.llm_engine.drafts.confidence and m.llm.llm_engine.drafts.confidence.profile
            if profile is not None:  # the decode graphs' seconds the scheduler priced steps by
                row["step_profile_ms"] = {f"{n},{q}": round(t * 1e3, 4) for (n, q), t in profile.seconds.items()}
        if m.trace is not None:
            row["gate_trace"] = "".join(m.trace)
        if m.steps is not None:
            row["step_log"] = m.steps[-args.repeats:]
        rows.append(row)
        print(f"# {m.name} batch {batch}: {total:.1f} tok/s total, {seconds:.3f} s,"  # a run cut short keeps these
              f" plain step share {row.get('plain_step_share', 0.0):.2f}", file=sys.stderr, flush=True)
    return rows


def _record_tests(llm: LLM) -> list[tuple[float, bool]]:
    """Every draft a verification tested, as (the drafter's confidence in it, accepted): a draft is tested
    when every draft before it was accepted."""
    planner, tests = llm.llm_engine.drafts, []
    accept = planner.accept

    def recorded(seq, pos, tokens, block_manager, verified=None, reserved=0):
        n = seq.num_scheduled_drafts if verified is None else verified
        accepted = len(tokens) - 1
        for j, c in enumerate(seq.draft_confidences[: min(n, accepted + 1)]):
            tests.append((float(c), j < accepted))
        return accept(seq, pos, tokens, block_manager, verified, reserved)

    planner.accept = recorded
    return tests


def calibration_error(tests: list[tuple[float, bool]], bins: int = 10) -> float | None:
    """Expected calibration error of the confidences: the tests' share-weighted gap between the mean
    confidence and the acceptance rate of each confidence bin."""
    if not tests:
        return None
    groups: dict[int, list[tuple[float, bool]]] = {}
    for c, ok in tests:
        groups.setdefault(min(bins - 1, int(c * bins)), []).append((c, ok))
    return sum(abs(statistics.fmean(c for c, _ in g) - statistics.fmean(ok for _, ok in g)) * len(g)
               for g in groups.values()) / len(tests)


def speed(args, engine_kw: dict) -> dict:
    if args.force_acceptance is not None:
        force_acceptance(args.force_acceptance)
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "seed": 0} if args.temperature else {}
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, presence_penalty=args.presence_penalty,
                            **({"temperature": 0.0} | sampling))
    # "off eager": plain decode without CUDA graphs, as speculation's steps run (on the CPU the same as "off")
    modes = [("off", None, {}), ("off eager", None, {"enforce_eager": True})]
    modes += [(f"k={k}", _spec(k, method=args.method), {}) for k in args.ks]
    modes += [(f"confidence k={max(args.ks)}", _spec(max(args.ks), "confidence", args.method), {})]
    if args.async_scheduling and args.device == "cuda":  # every step waiting for the one before (elsewhere
        # no step chains: the host moves the spans on)
        modes += [(f"k={max(args.ks)} unchained", _spec(max(args.ks), method=args.method), {"unchained": True})]
    if args.modes:
        modes = [m for m in modes if m[0] == "off" or any(m[0].startswith(w) for w in args.modes)]
    random_factory = _random_v41_llm_factory if args.method == "dspark" else _random_llm_factory
    make = random_factory(args, engine_kw) if args.random else (
        lambda spec, **kw: LLM(args.model, speculative_config=spec, **engine_kw, **kw))
    sched = {"async_scheduling": True} if args.async_scheduling else {}
    # every engine lives through the run; their KV pools hold the benchmark's sequences, not the device
    max_len = args.prompt_len + round(args.max_tokens * (1 + args.max_tokens_spread)) + 64
    engines = []
    for name, spec, extra in modes:
        unchained = extra.pop("unchained", False)
        llm = make(spec, max_num_seqs=max(args.batch_sizes), max_model_len=max_len, **sched, **extra)
        if unchained:
            llm.llm_engine.runner._chains = lambda so: False
        trace = _trace_gate(llm) if args.gate_trace else None
        clock = VirtualClock(args.virtual_clock, args.clock_jitter) if args.virtual_clock else None
        engines.append(_Mode(name, llm, trace, clock, _log_steps(llm) if args.step_log else None))
    rows = [r for batch in args.batch_sizes for r in _speed_rows(args, engines, batch, params)]
    rows.sort(key=lambda r: [m.name for m in engines].index(r["mode"]))
    base = {r["batch"]: r["per_user_tok_s"] for r in rows if r["mode"] == "off"}
    base_runs = {r["batch"]: r["run_seconds"] for r in rows if r["mode"] == "off"}
    print(f"{'mode':>16} {'batch':>5} {'per-user tok/s':>14} {'total tok/s':>11} {'speed-up':>8} {'paired':>6} "
          f"{'spread':>7} {'accept len':>10} {'verified/step':>13} {'plain steps':>11}")
    for r in rows:
        r["speedup"] = r["per_user_tok_s"] / base[r["batch"]]
        # the median of each repeat's ratio to plain decode's run of the same rotation (run side by side)
        r["paired_speedup"] = statistics.median(o / s for o, s in zip(base_runs[r["batch"]], r["run_seconds"]))
        r["spread"] = max(r["run_seconds"]) / min(r["run_seconds"]) - 1  # slowest run against the fastest
        print(f"{r['mode']:>16} {r['batch']:>5} {r['per_user_tok_s']:>14.2f} {r['total_tok_s']:>11.2f} "
              f"{r['speedup']:>8.2f} {r['paired_speedup']:>6.2f} {r['spread']:>6.1%} "
              f"{r.get('mean_acceptance_length', 1.0):>10.2f} {r.get('drafts_verified_per_step', 0.0):>13.2f} "
              f"{r.get('plain_step_share', 0.0):>11.2f}")
    return {"batch_sizes": args.batch_sizes, "max_tokens": args.max_tokens, "waves": args.waves,
            "max_tokens_spread": args.max_tokens_spread,
            "async_scheduling": args.async_scheduling, "presence_penalty": args.presence_penalty,
            "force_acceptance": args.force_acceptance, "repeats": args.repeats,
            "virtual_clock": dataclasses.asdict(args.virtual_clock) if args.virtual_clock else None,
            "clock_jitter": args.clock_jitter, "rows": rows}


def _random_llm_factory(args, engine_kw: dict):
    """Engines over one random model at V4-Flash widths (``--small``: tiny widths) with an MTP block, built
    once on the target device; its drafts are accepted at random (``--force-acceptance``)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import bench_gpu_decode as bgd

    device = engine_kw.get("device") or ("cuda" if args.backend != "cpu_ref" else "cpu")
    argv = ["--backend", args.backend, "--device", device, "--layers", str(args.layers),
            "--prompt-len", str(args.prompt_len), "--gen-len", str(args.max_tokens + 8)]
    if engine_kw.get("dtype"):
        argv += ["--dtype", engine_kw["dtype"]]
    a = bgd.parse_args(argv + ["--small"] * args.small)
    rm = bgd.RandomModel(a, torch.device(device), getattr(torch, a.dtype), mtp=True)

    def make(spec, **kw) -> LLM:
        engine = bgd.make_engine(rm.deepinfer_model(), rm.cfg_dir, backend=args.backend, seed=a.seed,
                                 speculative_config=spec, **kw)
        return LLM.from_engine(engine)

    return make


def _random_v41_llm_factory(args, engine_kw: dict):
    """Engines over one random DeepSeek-V4.1 with its DSpark stages, built once on the target device from
    the release's config (``bench_bounded_replay.model_config_dict``): ``--layers`` decoder layers (the
    release: 40), ``--experts`` routed experts in each layer and in the drafter (the release: 384 and 128;
    a batch-1 step reads only the top-k's bytes either way), no Engram tables (101 GB each); ``--small``
    divides the widths by 16 (a CPU smoke test). Its drafts are accepted at random (``--force-acceptance``)."""
    import tempfile
    from types import SimpleNamespace

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_bounded_replay as bbr
    import bench_gpu_decode as bgd

    device = torch.device(engine_kw.get("device") or ("cuda" if args.backend != "cpu_ref" else "cpu"))
    dtype = getattr(torch, engine_kw.get("dtype") or ("bfloat16" if device.type == "cuda" else "float32"))
    a = SimpleNamespace(preset="v41", layers=args.layers, experts=args.experts, shrink=16 if args.small else 1,
                        backend=args.backend, seed=0)
    longest = args.prompt_len + round(args.max_tokens * (1 + args.max_tokens_spread)) + 64
    config = bbr.model_config_dict(a, longest, drafter=True)
    cfg_dir = Path(tempfile.mkdtemp(prefix="bench-spec-v41-"))
    (cfg_dir / "config.json").write_text(json.dumps(config))
    model = bbr.build_model(a, bbr.model_config(a, longest, drafter=True), dtype, device, drafter=True)

    def make(spec, **kw) -> LLM:
        return LLM.from_engine(bgd.make_engine(model, cfg_dir, backend=args.backend, seed=0,
                                               speculative_config=spec, **kw))

    return make


def _model_name(args) -> str:
    if args.random and args.method == "dspark":
        return (f"random V4.1-width{' / 16' if args.small else ''}, {args.layers} layers, {args.experts} routed "
                "experts a layer and in the drafter, no Engram, DSpark")
    if args.random:
        return f"random {'tiny' if args.small else 'V4-Flash'}-width, {args.layers} layers + MTP"
    return args.model or "default"


def _engine_kw(args, float64: bool = False) -> dict:
    """The LLM's backend, dtype (``--dtype``; float64 by default where ``float64``), device and block size."""
    kw = {"backend": args.backend, "dtype": args.dtype or ("float64" if float64 else None)}
    for name in ("device", "block_size"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    if args.threads:
        kw["cpu_threads"] = args.threads  # the engine sets its own count otherwise
    return kw


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("acceptance", "speed"), default="acceptance")
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the embedded trained model)")
    ap.add_argument("--backend", default="cpu_ref")
    ap.add_argument("--dtype", default=None, help="default: float64 for acceptance, the backend's for speed")
    ap.add_argument("--device", default=None)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--method", choices=("mtp", "dspark"), default="mtp",
                    help="the drafter: mtp (V4's MTP layer) or dspark (V4.1's DSpark stages; --model a V4.1 "
                         "checkpoint)")
    ap.add_argument("--ks", type=_ints, default=[1, 2, 3], metavar="K,K,...")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch-sizes", type=_ints, default=[1, 8, 32, 64], metavar="B,B,...")
    ap.add_argument("--force-acceptance", type=float, default=None, metavar="P")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="speed: sample at this temperature (seeded) instead of greedily")
    ap.add_argument("--top-p", type=float, default=1.0, help="speed, with --temperature: nucleus sampling")
    ap.add_argument("--presence-penalty", type=float, default=0.0,
                    help="speed: every request's presence penalty (default 0, off)")
    ap.add_argument("--gate-trace", action="store_true",
                    help="speed: keep the confidence scheduler's gate decisions of each measured run in the JSON")
    ap.add_argument("--step-log", action="store_true",
                    help="speed: keep every step of each mode's measured runs in the JSON, a list per run "
                         "(finish and launch ms, sequences, tokens, speculative, output tokens, decode only)")
    ap.add_argument("--modes", type=lambda v: v.split(","), default=None, metavar="NAME,...",
                    help="speed: only the modes whose names start so (\"off\" always runs: the baseline)")
    ap.add_argument("--random", action="store_true",
                    help="speed mode on random weights instead of a checkpoint (pair with --force-acceptance): "
                         "V4-Flash widths with an MTP block, or with --method dspark the release's V4.1 config "
                         "with its DSpark stages")
    ap.add_argument("--layers", type=int, default=4, help="--random: decoder layers (default 4; V4.1's: 40)")
    ap.add_argument("--experts", type=int, default=8,
                    help="--random --method dspark: routed experts of each layer and of the drafter (default 8)")
    ap.add_argument("--small", action="store_true", help="--random: tiny widths (a CPU smoke test)")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="speed: every mode schedules step N+1 while step N runs (default: synchronous)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="speed: measured runs per mode and batch after the warm-up; the median counts, and "
                         "'spread' is the slowest run's time over the fastest's")
    ap.add_argument("--virtual-clock", type=step_costs, default=None, metavar="COSTS",
                    help="speed: time steps by a cost model instead of the wall clock (the model still runs): "
                         f"one of {', '.join(STEP_COSTS)} (benchmarks/step_costs.json), or 'P1,P64,S1,S64', "
                         "milliseconds a plain and a speculative decode step take at batch 1 and 64")
    ap.add_argument("--clock-jitter", type=float, default=0.0, metavar="SIGMA",
                    help="--virtual-clock: scatter each step's device time by a log-normal factor of mean 1 "
                         "and this sigma (seeded), as a real device's step times scatter")
    ap.add_argument("--waves", type=int, default=1,
                    help="speed: batch x WAVES requests, at most batch at once (continuous batching keeps the "
                         "batch full; 1: one closed batch, whose rate ends with its slowest request). "
                         "per-user tok/s is then the total over the batch")
    ap.add_argument("--max-tokens-spread", type=float, default=0.0, metavar="F",
                    help="speed: each request's max_tokens drawn from max_tokens x [1 - F, 1 + F] (seeded, the "
                         "same for every mode), so that requests end at different steps in every mode, as in "
                         "serving, not only where speculation desyncs them (default 0: all alike)")
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json-out", default=None, metavar="FILE")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    if args.waves < 1:
        ap.error("--waves must be at least 1")
    if not 0 <= args.max_tokens_spread < 1:
        ap.error("--max-tokens-spread must be in [0, 1)")
    if args.method == "dspark" and not (args.random or args.model):
        ap.error("--method dspark runs a V4.1 with DSpark stages: give --model (the embedded default has them) "
                 "or --random (the release's config with random weights)")
    if args.threads:
        torch.set_num_threads(args.threads)
    engine_kw = _engine_kw(args, float64=args.mode == "acceptance")
    dtype = engine_kw["dtype"]
    result = acceptance(args, engine_kw) if args.mode == "acceptance" else speed(args, engine_kw)
    report = {"benchmark": "spec_decode", "mode": args.mode, "backend": args.backend, "dtype": dtype,
              "temperature": args.temperature, "top_p": args.top_p,
              "model": _model_name(args), "method": args.method, "torch": torch.__version__,
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), **result}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()

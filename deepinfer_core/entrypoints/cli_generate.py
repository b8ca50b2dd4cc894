"""``deepinfer generate``: run prompts through the offline engine and print what it generated.

Also home of the engine options (``--model``, ``--backend``, ``--dtype``, ...) that every
engine-running subcommand shares: :func:`add_engine_arguments` and :func:`engine_kwargs`.
"""

from __future__ import annotations

import argparse
import enum
import json
import sys
from typing import Any

# dtype names the engine accepts (deepinfer_core.config.DTYPES; repeated here so --help imports no torch)
DTYPE_CHOICES = ("auto", "float32", "float64", "bfloat16", "float16")


class UsageError(ValueError):
    """A bad command-line value: reported on stderr, exit code 2."""


def fail(command: str, message: str) -> int:
    """Report a usage error like argparse does, without a traceback; returns the exit code 2."""
    print(f"deepinfer {command}: error: {message}", file=sys.stderr)
    return 2


# --- engine options (shared with `deepinfer bench`) -----------------------------------------------


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=None, metavar="DIR",
                       help="Hugging Face DeepSeek-V4 checkpoint folder (default: the embedded tiny model)")
    group.add_argument("--backend", default="cpu_ref",
                       help="backend name, see `deepinfer backends` (default: cpu_ref)")
    group.add_argument("--dtype", default=None, choices=DTYPE_CHOICES,
                       help="model dtype (default: float32 on CPU, bfloat16 on accelerators)")
    group.add_argument("--device", default=None, help="torch device (default: the backend's)")
    group.add_argument("--max-model-len", type=int, default=None, metavar="N",
                       help="longest sequence, prompt plus output (default: min(model max, 4096))")
    group.add_argument("--block-size", type=int, default=None, metavar="N",
                       help="KV cache block size (default: 128)")
    group.add_argument("--max-num-seqs", type=int, default=None, metavar="N",
                       help="most sequences in one step (default: 64)")
    group.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                       help="most tokens in one step (default: 2048)")
    group.add_argument("--num-blocks", type=int, default=None, metavar="N",
                       help="KV cache blocks (default: planned from the memory budget)")
    group.add_argument("--kv-cache-bytes", type=int, default=None, metavar="BYTES",
                       help="KV cache memory budget on CPU (default: 2 GiB)")
    group.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="F",
                       help="fraction of accelerator memory to use (default: 0.9)")
    group.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    group.add_argument("--no-chunked-prefill", action="store_true", help="disable chunked prefill")
    group.add_argument("--numerics", default=None, metavar="NAME",
                       help="the model's arithmetic: 'deepseek' (DeepSeek's inference code: quantised "
                            "activations and KV entries), 'transformers' (DeepSeek-V4: transformers' arithmetic) or "
                            "'unquantised' (DeepSeek-V4.1: the reference without its quantisation steps); default: "
                            "deepseek where config.json has quantization_config")
    group.add_argument("--cpu-threads", type=int, default=None, metavar="N",
                       help="torch threads for CPU ops (default: 1 for small models such as the embedded one, "
                            "else torch's count)")
    group.add_argument("--engram-placement", default=None, choices=("device", "host", "file"),
                       help="where DeepSeek-V4.1's Engram tables live: on the device, in pinned host memory read in "
                            "place, or in the checkpoint's files, memory-mapped (default: the memory plan's choice)")
    group.add_argument("--engram-shard", action="store_true",
                       help="split the Engram tables' rows over the data-parallel ranks (a lookup collective)")
    group.add_argument("--allow-reference-fallback", action="store_true",
                       help="let ops the backend lacks fall back to the reference implementations")
    group.add_argument("--data-parallel-size", "-dp", type=int, default=None, metavar="N",
                       help="attention data parallel: N rank processes, each with its own scheduler and KV "
                            "cache (default: 1)")
    group.add_argument("--enable-expert-parallel", action="store_true",
                       help="shard the routed experts over the data-parallel ranks")
    group.add_argument("--enable-eplb", action="store_true",
                       help="expert-parallel load balancing: replicate and move experts by measured load")
    group.add_argument("--num-redundant-experts", type=int, default=None, metavar="N",
                       help="EPLB: physical expert slots beyond the logical experts (default: 0)")
    group.add_argument("--speculative-config", default=None, metavar="JSON",
                       help='speculative decoding with the MTP layer, e.g. \'{"method": "mtp", '
                            '"num_speculative_tokens": 2}\' (optional "schedule": "fixed" | "confidence")')
    group.add_argument("--structured-outputs-config", default=None, metavar="JSON",
                       help='structured outputs of every request, e.g. \'{"disable_any_whitespace": true}\' '
                            "for compact JSON output (default: free whitespace between JSON tokens)")


_POSITIVE_ENGINE_INTS = (
    "max_model_len", "block_size", "max_num_seqs", "max_num_batched_tokens", "num_blocks", "kv_cache_bytes",
    "data_parallel_size", "cpu_threads",
)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``LLM(**engine_kwargs(args))``: only the options given, so EngineArgs' defaults apply otherwise."""
    kwargs: dict[str, Any] = {"model": args.model, "backend": args.backend, "dtype": args.dtype}
    for name in (*_POSITIVE_ENGINE_INTS, "device", "gpu_memory_utilization"):
        value = getattr(args, name)
        if value is None:
            continue
        if name in _POSITIVE_ENGINE_INTS and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        kwargs[name] = value
    if args.gpu_memory_utilization is not None and not 0 < args.gpu_memory_utilization <= 1:
        raise UsageError(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    if args.no_prefix_caching:
        kwargs["enable_prefix_caching"] = False
    if args.no_chunked_prefill:
        kwargs["enable_chunked_prefill"] = False
    if getattr(args, "numerics", None):
        kwargs["numerics"] = args.numerics
    if getattr(args, "engram_placement", None):
        kwargs["engram_placement"] = args.engram_placement
    if getattr(args, "engram_shard", False):
        kwargs["engram_shard"] = True
    if args.allow_reference_fallback:
        kwargs["allow_reference_fallback"] = True
    if args.enable_expert_parallel:
        kwargs["enable_expert_parallel"] = True
    if args.enable_eplb:
        kwargs["enable_eplb"] = True
    if args.num_redundant_experts is not None:
        if args.num_redundant_experts < 0:
            raise UsageError(f"--num-redundant-experts must be >= 0, got {args.num_redundant_experts}")
        kwargs["eplb_config"] = {"num_redundant_experts": args.num_redundant_experts}
    for name in ("speculative_config", "structured_outputs_config"):
        if getattr(args, name, None):
            kwargs[name] = _json_option(name, getattr(args, name))
    return kwargs


def _json_option(name: str, text: str) -> dict:
    """The JSON object of option ``--name``."""
    flag = "--" + name.replace("_", "-")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{flag} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise UsageError(f"{flag} must be a JSON object, got {text!r}")
    return value


def build_llm(args: argparse.Namespace, command: str):
    """The engine for ``args``, or ``(None, exit code)`` after reporting why it cannot be built."""
    try:
        kwargs = engine_kwargs(args)
    except UsageError as exc:
        return None, fail(command, str(exc))
    from deepinfer_core.entrypoints.llm import LLM
    from deepinfer_core.plugins import PluginError

    try:
        return LLM(**kwargs), 0
    except (ValueError, TypeError, FileNotFoundError, PluginError) as exc:
        return None, fail(command, f"cannot build the engine: {exc}")


# --- deepinfer generate ----------------------------------------------------------------------------


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt text (one request each)")
    parser.add_argument("--prompt-file", default=None, metavar="FILE",
                        help="read more prompts from FILE, one per line ('-': stdin)")
    parser.add_argument("--prompt-token-ids", action="append", default=[], metavar="IDS",
                        help="a prompt given as comma-separated token ids (repeatable)")
    add_engine_arguments(parser)
    s = parser.add_argument_group("sampling (vLLM's SamplingParams)")
    s.add_argument("--max-tokens", type=int, default=16, metavar="N",
                   help="most tokens to generate (default: 16)")
    s.add_argument("--min-tokens", type=int, default=0, metavar="N",
                   help="generate at least N tokens before EOS/stop tokens may end (default: 0)")
    s.add_argument("--temperature", type=float, default=1.0, metavar="T", help="0 is greedy (default: 1.0)")
    s.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="nucleus sampling mass (default: 1.0, off)")
    s.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="keep the K likeliest tokens (0 or -1: off)")
    s.add_argument("--min-p", type=float, default=0.0, metavar="P",
                   help="drop tokens below P times the top probability (default: 0, off)")
    s.add_argument("--repetition-penalty", type=float, default=1.0, metavar="F", help="(default: 1.0, off)")
    s.add_argument("--presence-penalty", type=float, default=0.0, metavar="F", help="in [-2, 2] (default: 0)")
    s.add_argument("--frequency-penalty", type=float, default=0.0, metavar="F",
                   help="in [-2, 2] (default: 0)")
    s.add_argument("--seed", type=int, default=None, metavar="S",
                   help="per-request sampling seed (reproducible)")
    s.add_argument("--n", type=int, default=1, metavar="N", help="completions per prompt (default: 1)")
    s.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="stop when the output contains STR; not included in the text (repeatable)")
    s.add_argument("--stop-token-id", action="append", type=int, default=[], metavar="ID",
                   help="stop at this token id (repeatable)")
    s.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="return the log-probability of each sampled token and the N likeliest")
    s.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    s.add_argument("--keep-special-tokens", action="store_true",
                   help="do not drop special tokens from the text")
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print JSON instead of text")
    out.add_argument("--progress", action="store_true", help="show a progress bar on stderr")


def sampling_params_from_args(args: argparse.Namespace):
    """SamplingParams for ``args``; UsageError names the offending option."""
    from deepinfer_core.sampling.params import SamplingParams

    try:
        return SamplingParams(
            n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
            repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty, max_tokens=args.max_tokens, min_tokens=args.min_tokens,
            stop=list(args.stop), stop_token_ids=list(args.stop_token_id), ignore_eos=args.ignore_eos,
            seed=args.seed, logprobs=args.logprobs, skip_special_tokens=not args.keep_special_tokens,
        )
    except ValueError as exc:
        # "invalid SamplingParams: temperature must be ..., got -1.0; ..." -> "--temperature must be ..."
        parts = str(exc).removeprefix("invalid SamplingParams: ").split("; ")
        flags = {"stop_token_ids": "stop-token-id"}
        named = []
        for part in parts:
            field, _, rest = part.partition(" ")
            if hasattr(args, field) or field in flags:
                part = f"--{flags.get(field, field.replace('_', '-'))} {rest}"
            named.append(part)
        raise UsageError("invalid sampling options: " + "; ".join(named)) from exc


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise UsageError(f"--prompt-token-ids wants comma-separated integers, got {text!r}") from None
    if not ids:
        raise UsageError("--prompt-token-ids got no token ids")
    return ids


def collect_prompts(args: argparse.Namespace) -> list[Any]:
    prompts: list[Any] = list(args.prompts)
    if args.prompt_file is not None:
        try:
            if args.prompt_file == "-":
                lines = sys.stdin.read().splitlines()
            else:
                with open(args.prompt_file, encoding="utf-8") as fh:
                    lines = fh.read().splitlines()
        except OSError as exc:
            raise UsageError(f"cannot read --prompt-file: {exc}") from exc
        prompts.extend(line for line in lines if line.strip())
    prompts.extend({"prompt_token_ids": _token_ids(t)} for t in args.prompt_token_ids)
    if not prompts:
        raise UsageError("no prompts: give PROMPT arguments, --prompt-file or --prompt-token-ids")
    return prompts


def output_to_dict(out: Any) -> dict[str, Any]:
    """One RequestOutput as JSON-ready data (logprobs: per generated token, {token id: logprob})."""
    return {
        "request_id": out.request_id,
        "prompt": out.prompt,
        "prompt_token_ids": list(out.prompt_token_ids),
        "outputs": [
            {
                "index": c.index,
                "text": c.text,
                "token_ids": list(c.token_ids),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "logprobs": None if c.logprobs is None
                else [{str(tok): lp for tok, lp in step.items()} for step in c.logprobs],
                "cumulative_logprob": c.cumulative_logprob,
            }
            for c in out.outputs
        ],
        "error": out.error,
    }


def format_text(results: list[Any], tokenizer: Any = None) -> str:
    """Human-readable results: one block per prompt, one line per completion (texts shown as repr)."""
    blocks = []
    for i, out in enumerate(results):
        shown = repr(out.prompt) if out.prompt is not None else f"token ids {list(out.prompt_token_ids)}"
        lines = [f"=== prompt {i + 1}/{len(results)}: {shown}"]
        if out.error:
            lines.append(f"  error: {out.error}")
        for c in out.outputs if not out.error else []:
            label = f"  [{c.index}] " if len(out.outputs) > 1 else "  "
            info = f"finish_reason={c.finish_reason}, tokens={len(c.token_ids)}"
            if c.cumulative_logprob is not None:
                info += f", cumulative_logprob={c.cumulative_logprob:.4f}"
            lines.append(f"{label}-> {c.text!r}")
            pad = " " * len(label)
            lines.append(f"{pad}   ({info})")
            if c.logprobs is not None:
                for tok, step in zip(c.token_ids, c.logprobs):
                    piece = tokenizer.decode([tok]) if tokenizer is not None else ""
                    top = ", ".join(f"{t}:{lp:.3f}" for t, lp in sorted(step.items(), key=lambda kv: -kv[1]))
                    lines.append(f"{pad}     {tok:>6} {piece!r:<12} logprob={step[tok]:.4f}  top: {top}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def run_generate(args: argparse.Namespace) -> int:
    try:
        params = sampling_params_from_args(args)
        prompts = collect_prompts(args)
    except UsageError as exc:
        return fail("generate", str(exc))
    llm, code = build_llm(args, "generate")
    if llm is None:
        return code
    try:
        results = llm.generate(prompts, params, use_tqdm=args.progress)
    except ValueError as exc:  # an invalid prompt: nothing ran
        return fail("generate", str(exc))
    if args.json:
        engine = llm.llm_engine
        doc = {
            "model": str(engine.model_config.path) if engine.model_config.path is not None else None,
            "backend": args.backend,
            "dtype": str(engine.dtype).removeprefix("torch."),
            "sampling_params": {k: v.name if isinstance(v, enum.Enum) else v for k, v in vars(params).items()
                                if not k.startswith("_")},
            "results": [output_to_dict(out) for out in results],
        }
        print(json.dumps(doc, indent=2, ensure_ascii=False))
    else:
        print(format_text(results, llm.get_tokenizer()))
    failed = [out for out in results if out.error]
    for out in failed:
        print(f"deepinfer generate: request {out.request_id} failed: {out.error}", file=sys.stderr)
    return 1 if failed else 0

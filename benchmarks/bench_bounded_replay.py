"""SWA bounded replay (issue 53): DeepSeek-V4.1's prefill with and without its late layers cut to the tail.

For every prompt length ``L`` and mode (``full``: ``bounded_replay=False``; ``mask``; ``compact``) one
sequence prefills ``L`` random tokens in chunks of ``--chunk`` through the model alone (no scheduler), its
late layers cut at ``L - keep`` (``keep = window + --backtrack``). Reported: TTFT (the whole prefill,
the last chunk's logits on the host), prefill tok/s, the speed-up over ``full``, and the model's FLOPs per
prompt token (an estimate from the config: every linear's multiply-adds for the activated experts, the
attention's window and top-k keys, the indexers' candidate scores; ``mask`` computes what ``full``
computes). With ``--quality`` also the difference to the full prefill: for each length, ``--quality-tokens``
continuation tokens teacher-forced one at a time after the prefill, their greedy agreement with the full
prefill's, the largest logprob difference and both perplexities (of random tokens on a random model: a
measure of the difference, not of the model).

With ``--model DIR`` a trained V4.1 checkpoint (``load_model``) replaces the random weights and the prompts
are real held-out text: the Python standard library's held-out split (``tools/build_corpus.py``), its
files in order, each followed by the tokenizer's eos, tokenized with the checkpoint's tokenizer, cut at
each length; the ``--quality-tokens`` continuation tokens are the text's next tokens. With ``--quality``
every mode then reports the held-out perplexity of those tokens teacher-forced after its prefill (and
its top-1 accuracy on them), the greedy agreement with the full prefill at each position and the largest
logprob difference to it. A model whose late layers carry Engram or own global KV is refused (the reason
printed and written to the report, exit status 2)::

    python benchmarks/bench_bounded_replay.py --model deepinfer_core/assets/deepseek-v41-tiny \\
        --lengths 1024,2048,3968 --chunk 512 --quality --quality-tokens 64 --threads 1

CPU (the tiny V4.1 without Engram, window 8)::

    python benchmarks/bench_bounded_replay.py --out benchmarks/results/cpu/bounded_replay.json

H200 (40 layers at V4.1-Flash widths from the release's config, ``--experts`` routed experts of which 6
are active per token as in the release, bf16, random weights, Engram and the drafter left out)::

    python benchmarks/bench_bounded_replay.py --preset v41 --backend nvidia_sm100 --device cuda \\
        --lengths 8192,32768,131072 --chunk 8192 --out benchmarks/results/h200/bounded_replay.json

Goal (issue 53): compact >= 1.7x the full prefill's tok/s at 32K and beyond.
"""

from __future__ import annotations

import argparse
import json
import math
import platform as host_platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from deepinfer_core.model.replay import replay_keep

MODES = ("full", "mask", "compact")
REPO = Path(__file__).resolve().parents[1]
RELEASE_CONFIG = Path(__file__).resolve().parents[2] / "shared" / "reference" / "deepseek-v4.1-flash" / \
    "config.transcribed.json"


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=("tiny", "v41"), default="tiny")
    ap.add_argument("--model", default=None, help="a trained V4.1 checkpoint folder instead of random weights; "
                    "prompts from the stdlib's held-out split (lengths default 1024,2048; chunk 512)")
    ap.add_argument("--numerics", default="unquantised", help="--model: load_model's numerics")
    ap.add_argument("--lengths", type=int_list, default=None, help="prompt lengths (tiny: 256,1024; v41: 8K,32K,128K)")
    ap.add_argument("--chunk", type=int, default=None, help="prefill chunk (tiny: 256; v41: 8192)")
    ap.add_argument("--backtrack", type=int, default=0, help="longest backtracking: drafts or a capture window")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--experts", type=int, default=8, help="v41 preset: routed experts held (6 active)")
    ap.add_argument("--layers", type=int, default=None, help="v41 preset: fewer layers (the release's first N)")
    ap.add_argument("--shrink", type=int, default=1, help="v41 preset: widths divided by this (a smoke run on a CPU)")
    ap.add_argument("--backend", default="cpu_ref")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="tiny: float32; v41: bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quality", action="store_true", help="also the difference to the full prefill")
    ap.add_argument("--quality-tokens", type=int, default=16)
    ap.add_argument("--label", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    tiny = a.preset == "tiny"
    if a.model:
        a.lengths = a.lengths or [1024, 2048]
        a.chunk = a.chunk or 512
    a.lengths = a.lengths or ([256, 1024] if tiny else [8192, 32768, 131072])
    a.chunk = a.chunk or (256 if tiny else 8192)
    a.dtype = a.dtype or ("float32" if tiny else "bfloat16")
    return a


# --- the model --------------------------------------------------------------------------------------

def model_config(a, longest: int, drafter: bool = False):
    """:func:`model_config_dict` as a config."""
    from deepinfer_core.models.deepseek_v41.config import DeepseekV41Config

    return DeepseekV41Config.from_dict(model_config_dict(a, longest, drafter))


def model_config_dict(a, longest: int, drafter: bool = False) -> dict:
    """The V4.1 config of the preset, Engram left out (it runs in the early layers only, the same in every
    mode; its tables at the release's size do not fit beside the weights), the v41 preset's drafter too
    unless ``drafter``: then its DSpark stages stay, with ``a.experts`` routed experts (the release: 128, 3
    active) and the last 3 layers as their targets. A config.json's contents."""
    from deepinfer_core.testing.tiny_v41 import tiny_v41_config

    if a.preset == "tiny":
        return tiny_v41_config(engram=False, max_position_embeddings=longest)
    raw = json.loads(RELEASE_CONFIG.read_text())
    text = dict(raw["text_config"])
    n = a.layers or text["num_hidden_layers"]
    text.update(n_routed_experts=a.experts, num_experts_per_tok=min(6, a.experts), engram_layer_ids=[],
                engram_num_embeddings=[], num_hidden_layers=n, compress_ratios=text["compress_ratios"][:n],
                max_position_embeddings=max(longest, text["max_position_embeddings"]))
    if drafter:
        targets = len(text["dspark_target_layer_ids"])
        text.update(dspark_target_layer_ids=list(range(n - targets, n)), dspark_n_routed_experts=a.experts,
                    dspark_num_experts_per_tok=min(text["dspark_num_experts_per_tok"], a.experts))
    else:
        text.update(num_nextn_predict_layers=0, dspark_block_size=0, dspark_target_layer_ids=[])
    for key in ("kv_source_layer_ids", "index_source_layer_ids"):
        text[key] = [i for i in text[key] if i < n]
    if a.shrink > 1:  # the release's layer structure at a fraction of its widths
        for key in ("hidden_size", "num_attention_heads", "q_lora_rank", "o_lora_rank", "moe_intermediate_size",
                    "index_n_heads"):
            text[key] //= a.shrink
        text["vocab_size"] = 4096
        text["dspark_noise_token_id"] = min(text["dspark_noise_token_id"], text["vocab_size"] - 1)
    if text["candidate_source_layer_id"] >= n:
        text["candidate_source_layer_id"] = -1
    raw = {k: v for k, v in raw.items() if k != "vision_config"}
    return {**raw, "text_config": text}


def random_params(cfg, dtype: torch.dtype, device: torch.device, seed: int,
                  drafter: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter (the drafter's too with ``drafter``) at a scale that keeps activations of order one,
    made on ``device``."""
    from deepinfer_core.model.loader import expected_shapes, parameter_dtype

    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, shape in expected_shapes(cfg, with_mtp=drafter).items():
        dt = parameter_dtype(cfg, name, dtype)
        x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32 if dt.is_floating_point else dt) \
            if dt.is_floating_point else torch.zeros(shape, dtype=dt, device=device)
        if not dt.is_floating_point:
            pass
        elif name.endswith(("norm.weight", "q_weight", "k_weight")):
            x = 1.0 + 0.1 * x
        elif "hc_" in name:
            x = x * (0.1 if name.endswith("_fn") else 0.0) + (0.5 if name.endswith("_scale") else 0.0)
        elif name.endswith("attn_sink") or name.endswith("bias"):
            x = x * (1.0 if name.endswith("attn_sink") else 0.0)
        elif len(shape) >= 2:
            x = x / math.sqrt(shape[-1])
        out[name] = x.to(dt)
    return out


def build_model(a, cfg, dtype: torch.dtype, device: torch.device, drafter: bool = False):
    from deepinfer_core.models.deepseek_v41 import ARCHITECTURE
    from deepinfer_core.models.deepseek_v41.model import DeepseekV41Model
    from deepinfer_core.plugins import build_op_table, load_backend

    params = random_params(cfg, dtype, device, a.seed, drafter)
    if ARCHITECTURE.prepare_params is not None:
        ARCHITECTURE.prepare_params(cfg, params, dtype)
    weights = ARCHITECTURE.build_weights(cfg, params, load_backend(a.backend).hook)
    ops = build_op_table(a.backend, dtype=dtype, device=device, model_config=cfg)
    return DeepseekV41Model(cfg, weights, ops, dtype, numerics="unquantised")


def load_trained(a, dtype: torch.dtype, device: torch.device):
    """The checkpoint of ``--model`` through ``load_model``."""
    from deepinfer_core.models import load_model

    return load_model(a.model, backend=a.backend, dtype=dtype, device=device, numerics=a.numerics)


def replay_refusal(cfg) -> str | None:
    """Why bounded replay cannot cut this model's late layers (None: it can)."""
    from deepinfer_core.model.errors import UnsupportedModelError
    from deepinfer_core.models.deepseek_v41.config import DeepseekV41Config
    from deepinfer_core.models.deepseek_v41.replay import replay_layers

    if not isinstance(cfg, DeepseekV41Config):
        return f"bounded replay is DeepSeek-V4.1's; this checkpoint is {type(cfg).__name__}"
    try:
        replay_layers(cfg)
    except UnsupportedModelError as exc:
        return str(exc)
    return None


def heldout_tokens(model_dir: str | Path, count: int) -> tuple[list[int], dict]:
    """The first ``count`` tokens of the stdlib's held-out split (``tools/build_corpus.py``): its files in
    order, each followed by eos, tokenized with the checkpoint's tokenizer; and where they came from."""
    from deepinfer_core.tokenizer import get_tokenizer

    sys.path.insert(0, str(REPO / "tools"))
    import build_corpus

    tok = get_tokenizer(model_dir)
    if tok is None:
        raise SystemExit(f"{Path(model_dir).name} has no tokenizer: held-out text cannot be tokenized")
    files = [f for f in build_corpus.collect() if f.split == "heldout"]
    ids: list[int] = []
    used = []
    for f, text in zip(files, build_corpus.texts(files, "heldout")):
        if len(ids) >= count:
            break
        ids.extend(tok.encode(text, add_special_tokens=False))
        ids.append(tok.eos_token_id)
        used.append(f.relpath)
    if len(ids) < count:
        raise SystemExit(f"the held-out split holds {len(ids)} tokens; {count} asked")
    return ids[:count], dict(source="Python standard library, held-out split (tools/build_corpus.py)",
                             python_version=host_platform.python_version(), files=used, tokens=count)


def block_size_of(cfg, preset: str) -> int:
    """The cache's block size: a multiple of 16 and of every compression rate (128 for the release)."""
    if preset == "v41":
        return 128
    size = 16
    for layer in range(cfg.num_hidden_layers):
        rate = cfg.compress_rate(layer)
        size = math.lcm(size, rate) if rate else size
    return size


# --- FLOPs ------------------------------------------------------------------------------------------

def layer_flops(cfg, layer: int, position: float) -> float:
    """Multiply-adds x 2 of one token at ``position`` in ``layer`` (an estimate: linears, attention over the
    window and the top-k, the indexer's candidate scores)."""
    d, h, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    linear = d * cfg.q_lora_rank + cfg.q_lora_rank * h * hd + d * hd + h * hd * cfg.o_lora_rank // cfg.o_groups \
        * 1 + cfg.o_groups * cfg.o_lora_rank * d
    moe = ((cfg.num_experts_per_tok + cfg.n_shared_experts) * 3 * d * cfg.moe_intermediate_size
           + d * cfg.n_routed_experts)
    mhc = 2 * (cfg.hc_mult * d) * (cfg.hc_mult * (2 + cfg.hc_mult))
    rate = cfg.compress_rate(layer)
    keys = min(position + 1, cfg.sliding_window) + (min(position / rate, cfg.index_topk) if rate else 0)
    attention = 2 * h * hd * keys
    index = 0.0
    if rate and layer in cfg.index_source_layer_ids:
        candidates = position / rate
        if cfg.uses_candidates(layer):
            candidates = min(candidates, cfg.candidate_topk_blocks * cfg.candidate_block_size)
        index = cfg.q_lora_rank * cfg.index_n_heads * cfg.index_head_dim + cfg.index_n_heads * cfg.index_head_dim \
            * candidates
    if layer in cfg.kv_source_layer_ids:
        index_keys = hd * cfg.index_head_dim if layer in cfg.index_source_layer_ids else 0
        linear += d * hd * (2 if rate > 1 else 1) + index_keys
    return 2.0 * (linear + moe + mhc + attention + index)


def flops_per_token(cfg, length: int, floor: int | None) -> float:
    """The prefill's FLOPs per prompt token: every layer over every position, the late layers over the
    positions from ``floor`` only (None: over all)."""
    from deepinfer_core.models.deepseek_v41.replay import replay_layers

    late = replay_layers(cfg) if floor is not None else range(0)
    total = 0.0
    step = max(1, length // 64)
    for layer in range(cfg.num_hidden_layers):
        start = floor if layer in late else 0
        positions = range(start, length, step)
        total += sum(layer_flops(cfg, layer, p) for p in positions) * (length - start) / max(len(positions), 1)
    head = 2.0 * cfg.hidden_size * cfg.vocab_size  # the last position's logits
    return (total + head) / length


# --- runs -------------------------------------------------------------------------------------------

class Prefill:
    """One sequence's prefill through the model alone, in chunks, on a fresh cache per run."""

    def __init__(self, model, a, longest: int):
        from deepinfer_core.model.cache import ModelCache

        self.model, self.a = model, a
        self.block_size = block_size_of(model.cfg, a.preset)
        self.ngram = getattr(model, "ngram_size", 0)  # an Engram model: each chunk carries its n-gram history
        blocks = -(-(longest + a.quality_tokens + 1) // self.block_size)
        self.cache = ModelCache(model.cfg, blocks, blocks, 1, self.block_size, model.dtype, model.device)
        self.table = list(range(blocks))

    def run(self, mode: str, ids: list[int], keep: int, follow: list[int] = ()) -> tuple[float, torch.Tensor]:
        """(seconds to the first token, log_softmax rows of the last prompt position and each of
        ``follow`` teacher-forced after it)."""
        from deepinfer_core.model.metadata import SeqSpan, build_forward_batch

        model = self.model
        model.bounded_replay = None if mode == "full" else mode
        floor = 0 if mode == "full" else max(0, len(ids) - keep)
        rows, pos, first = [], 0, None
        fed = list(ids) + list(follow)
        sync(model.device)
        t0 = time.perf_counter()
        for tokens in chunks(ids, self.a.chunk) + [[t] for t in follow]:
            history = fed[max(0, pos - self.ngram + 1):pos] if self.ngram else None
            span = SeqSpan(pos, len(tokens), self.table, self.table, 0, history=history, replay_from=floor)
            batch = build_forward_batch(tokens, [span], model.compressor_specs(), self.block_size,
                                        model.cfg.sliding_window, device=model.device, ngram=self.ngram)
            logits, _ = model.forward(batch, self.cache)
            pos += len(tokens)
            if pos == len(ids):
                logits = logits.float().cpu()
                first = time.perf_counter() - t0
            if pos >= len(ids):
                rows.append(torch.log_softmax(logits.double(), dim=-1))
        model.bounded_replay = None
        return first, torch.cat(rows)


def chunks(ids: list[int], size: int) -> list[list[int]]:
    return [ids[i:i + size] for i in range(0, len(ids), size)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def quality(full: torch.Tensor, cut: torch.Tensor, follow: list[int]) -> dict:
    """Greedy agreement, largest logprob difference and perplexities of the teacher-forced tokens (row i
    predicts ``follow[i]``; the last row predicts nothing)."""
    target = torch.tensor(follow)
    nll = {name: -rows[:-1].gather(1, target.unsqueeze(1)).mean().item()
           for name, rows in (("full", full), ("cut", cut))}
    return dict(greedy_agreement=(full.argmax(-1) == cut.argmax(-1)).double().mean().item(),
                max_logprob_diff=(full - cut).abs().max().item(),
                ppl_full=math.exp(nll["full"]), ppl_cut=math.exp(nll["cut"]))


def heldout_quality(full: torch.Tensor, rows: torch.Tensor, follow: list[int]) -> dict:
    """One mode's rows on real text: the held-out perplexity of ``follow`` and its top-1 accuracy on it
    (the ``len(follow)`` rows that predict a token), its greedy agreement with the full prefill at each
    of those positions and the largest logprob difference to it."""
    target = torch.tensor(follow)
    n = len(follow)
    nll = -rows[:n].gather(1, target.unsqueeze(1)).mean().item()
    return dict(ppl=math.exp(nll), top1=(rows[:n].argmax(-1) == target).double().mean().item(),
                greedy_agreement=(full[:n].argmax(-1) == rows[:n].argmax(-1)).double().mean().item(),
                max_logprob_diff=(full[:n] - rows[:n]).abs().max().item(), quality_tokens=n)


def main(argv=None) -> dict:
    a = parse_args(argv)
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    if device.type == "cpu":
        torch.set_num_threads(a.threads)
    modes = [m for m in a.modes.split(",") if m]
    longest = max(a.lengths)
    t0 = time.perf_counter()
    heldout = None
    with torch.inference_mode():
        if a.model:
            model = load_trained(a, dtype, device)
            cfg = model.cfg
            refusal = replay_refusal(cfg)
            if refusal is not None and any(m != "full" for m in modes):
                return refused(a, cfg, refusal)
            if longest + a.quality_tokens > cfg.max_position_embeddings:
                raise SystemExit(f"--lengths up to {longest} + --quality-tokens {a.quality_tokens} exceed the "
                                 f"model's max_position_embeddings ({cfg.max_position_embeddings})")
            stream, heldout = heldout_tokens(a.model, longest + a.quality_tokens)
        else:
            cfg = model_config(a, longest + a.quality_tokens + 1)
            model = build_model(a, cfg, dtype, device)
        keep = replay_keep(cfg.sliding_window, a.backtrack)
        build_s = time.perf_counter() - t0
        bench = Prefill(model, a, longest)
        gen = torch.Generator().manual_seed(a.seed + 1)
        rows = []
        for length in a.lengths:
            if a.model:  # real text: the prompt and the tokens that follow it
                ids, follow = stream[:length], stream[length:length + a.quality_tokens]
            else:
                ids = torch.randint(5, cfg.vocab_size - 8, (length,), generator=gen).tolist()
                follow = torch.randint(5, cfg.vocab_size - 8, (a.quality_tokens,), generator=gen).tolist()
            out = {}
            for mode in modes:
                bench.run(mode, ids[: min(length, a.chunk)], keep)  # warm-up
            times = {mode: [] for mode in modes}
            for _ in range(a.reps):  # modes interleaved: a neighbour's load hits each alike
                for mode in modes:
                    times[mode].append(bench.run(mode, ids, keep)[0])
            for mode in modes:
                ttft = min(times[mode])
                floor = None if mode != "compact" else max(0, length - keep)
                row = dict(length=length, mode=mode, keep=keep, chunk=a.chunk, ttft_s=ttft, tok_s=length / ttft,
                           gflops_per_token=flops_per_token(cfg, length, floor) / 1e9)
                out[mode] = row
                rows.append(row)
            for row in out.values():
                if "full" in out:
                    row["speedup"] = out["full"]["ttft_s"] / row["ttft_s"]
            if a.quality and "full" in modes and a.model:
                _, full = bench.run("full", ids, keep, follow)
                for mode in modes:
                    cut = full if mode == "full" else bench.run(mode, ids, keep, follow)[1]
                    out[mode].update(heldout_quality(full, cut, follow))
            elif a.quality and "full" in modes:
                _, full = bench.run("full", ids, keep, follow)
                for mode in (m for m in modes if m != "full"):
                    out[mode].update(quality(full, bench.run(mode, ids, keep, follow)[1], follow))
            for mode in modes:
                print(line(out[mode]), flush=True)
    report = dict(benchmark="bounded_replay", label=a.label or git_commit(), commit=git_commit(),
                  date=datetime.now(timezone.utc).isoformat(timespec="seconds"), host=host_platform.platform(),
                  torch=torch.__version__, device=str(device), backend=a.backend, dtype=a.dtype, preset=a.preset,
                  layers=cfg.num_hidden_layers, late_layers=list(range(max(cfg.kv_source_layer_ids) + 1,
                                                                      cfg.num_hidden_layers)),
                  routed_experts=cfg.n_routed_experts, window=cfg.sliding_window, keep=keep,
                  threads=torch.get_num_threads() if device.type == "cpu" else None, build_s=build_s, rows=rows)
    if a.model:
        report.update(model_fields(a, cfg), heldout=heldout, numerics=a.numerics)
    print()
    print(table(report))
    write(a, report)
    return report


def model_fields(a, cfg) -> dict:
    """What names the checkpoint of ``--model`` (its folder's name only, and what it was trained on)."""
    info = Path(a.model) / "training_info.json"
    seq_len = json.loads(info.read_text()).get("seq_len") if info.is_file() else None
    return dict(preset="model", model=Path(a.model).resolve().name, train_seq_len=seq_len,
                max_position_embeddings=cfg.max_position_embeddings)


def refused(a, cfg, reason: str) -> dict:
    """The report of a model bounded replay cannot cut: the reason, printed and written; no rows."""
    print(f"bounded replay refused for {Path(a.model).resolve().name}: {reason}", flush=True)
    report = dict(benchmark="bounded_replay", label=a.label or git_commit(), commit=git_commit(),
                  date=datetime.now(timezone.utc).isoformat(timespec="seconds"), **model_fields(a, cfg),
                  refused=reason, rows=[])
    write(a, report)
    return report


def write(a, report: dict) -> None:
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(report, indent=2) + "\n")


HEADERS = ["length", "mode", "TTFT s", "tok/s", "speed-up", "GFLOP/token", "greedy agree", "max |dlogp|"]
HELDOUT_HEADERS = ["ppl", "top-1"]  # --model: the held-out perplexity and top-1 accuracy of each mode


def cells(row: dict) -> list[str]:
    def f(key, fmt):
        return fmt.format(row[key]) if row.get(key) is not None else "-"

    out = [str(row["length"]), row["mode"], f("ttft_s", "{:.3f}"), f("tok_s", "{:.0f}"), f("speedup", "{:.2f}x"),
           f("gflops_per_token", "{:.4g}"), f("greedy_agreement", "{:.3f}"), f("max_logprob_diff", "{:.3g}")]
    if "ppl" in row:
        out += [f("ppl", "{:.3f}"), f("top1", "{:.3f}")]
    return out


def headers(row: dict) -> list[str]:
    return HEADERS + (HELDOUT_HEADERS if "ppl" in row else [])


def line(row: dict) -> str:
    return "  ".join(f"{h}={c}" for h, c in zip(headers(row), cells(row)))


def table(report: dict) -> str:
    head = headers(report["rows"][0]) if report["rows"] else HEADERS
    body = [head] + [cells(r) for r in report["rows"]]
    widths = [max(len(c[i]) for c in body) for i in range(len(head))]
    what = f"model {report['model']}" if report.get("model") else f"V4.1 {report['preset']}"
    lines = [f"{report['label']}  ({what}, {report['layers']} layers, late {report['late_layers'][0]}-"
             f"{report['late_layers'][-1]}, window {report['window']}, keep {report['keep']}, {report['device']}, "
             f"{report['dtype']})"]
    for i, c in enumerate(body):
        lines.append(" | ".join(x.rjust(w) for x, w in zip(c, widths)))
        if i == 0:
            lines.append("-+-".join("-" * w for w in widths))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(2 if main().get("refused") else 0)

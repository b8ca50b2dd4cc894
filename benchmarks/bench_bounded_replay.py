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
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from deepinfer_core.model.replay import replay_keep

MODES = ("full", "mask", "compact")
RELEASE_CONFIG = Path(__file__).resolve().parents[2] / "shared" / "reference" / "deepseek-v4.1-flash" / \
    "config.transcribed.json"


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=("tiny", "v41"), default="tiny")
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
    a.lengths = a.lengths or ([256, 1024] if tiny else [8192, 32768, 131072])
    a.chunk = a.chunk or (256 if tiny else 8192)
    a.dtype = a.dtype or ("float32" if tiny else "bfloat16")
    return a


# --- the model --------------------------------------------------------------------------------------

def model_config(a, longest: int):
    """The V4.1 config of the preset, Engram left out (it runs in the early layers only, the same in every
    mode; its tables at the release's size do not fit beside the weights), the v41 preset's drafter too."""
    from deepinfer_core.models.deepseek_v41.config import DeepseekV41Config
    from deepinfer_core.testing.tiny_v41 import tiny_v41_config

    if a.preset == "tiny":
        return DeepseekV41Config.from_dict(tiny_v41_config(engram=False, max_position_embeddings=longest))
    raw = json.loads(RELEASE_CONFIG.read_text())
    text = dict(raw["text_config"])
    n = a.layers or text["num_hidden_layers"]
    text.update(n_routed_experts=a.experts, num_experts_per_tok=min(6, a.experts), engram_layer_ids=[],
                engram_num_embeddings=[], num_nextn_predict_layers=0, dspark_block_size=0,
                dspark_target_layer_ids=[], num_hidden_layers=n, compress_ratios=text["compress_ratios"][:n],
                max_position_embeddings=max(longest, text["max_position_embeddings"]))
    for key in ("kv_source_layer_ids", "index_source_layer_ids"):
        text[key] = [i for i in text[key] if i < n]
    if a.shrink > 1:  # the release's layer structure at a fraction of its widths
        for key in ("hidden_size", "num_attention_heads", "q_lora_rank", "o_lora_rank", "moe_intermediate_size",
                    "index_n_heads"):
            text[key] //= a.shrink
        text["vocab_size"] = 4096
    if text["candidate_source_layer_id"] >= n:
        text["candidate_source_layer_id"] = -1
    raw = {k: v for k, v in raw.items() if k != "vision_config"}
    return DeepseekV41Config.from_dict({**raw, "text_config": text})


def random_params(cfg, dtype: torch.dtype, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """Every parameter at a scale that keeps activations of order one, made on ``device``."""
    from deepinfer_core.model.loader import expected_shapes, parameter_dtype

    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, shape in expected_shapes(cfg, with_mtp=False).items():
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


def build_model(a, cfg, dtype: torch.dtype, device: torch.device):
    from deepinfer_core.models.deepseek_v41 import ARCHITECTURE
    from deepinfer_core.models.deepseek_v41.model import DeepseekV41Model
    from deepinfer_core.plugins import build_op_table, load_backend

    params = random_params(cfg, dtype, device, a.seed)
    if ARCHITECTURE.prepare_params is not None:
        ARCHITECTURE.prepare_params(cfg, params, dtype)
    weights = ARCHITECTURE.build_weights(cfg, params, load_backend(a.backend).hook)
    ops = build_op_table(a.backend, dtype=dtype, device=device, model_config=cfg)
    return DeepseekV41Model(cfg, weights, ops, dtype, numerics="unquantised")


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
        self.block_size = 128 if a.preset == "v41" else 16
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
        sync(model.device)
        t0 = time.perf_counter()
        for tokens in chunks(ids, self.a.chunk) + [[t] for t in follow]:
            span = SeqSpan(pos, len(tokens), self.table, self.table, 0, replay_from=floor)
            batch = build_forward_batch(tokens, [span], model.compressor_specs(), self.block_size,
                                        model.cfg.sliding_window, device=model.device)
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


def main(argv=None) -> dict:
    a = parse_args(argv)
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    if device.type == "cpu":
        torch.set_num_threads(a.threads)
    modes = [m for m in a.modes.split(",") if m]
    longest = max(a.lengths)
    cfg = model_config(a, longest + a.quality_tokens + 1)
    keep = replay_keep(cfg.sliding_window, a.backtrack)
    t0 = time.perf_counter()
    with torch.inference_mode():
        model = build_model(a, cfg, dtype, device)
        build_s = time.perf_counter() - t0
        bench = Prefill(model, a, longest)
        gen = torch.Generator().manual_seed(a.seed + 1)
        rows = []
        for length in a.lengths:
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
            if a.quality and "full" in modes:
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
    print()
    print(table(report))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(report, indent=2) + "\n")
    return report


HEADERS = ["length", "mode", "TTFT s", "tok/s", "speed-up", "GFLOP/token", "greedy agree", "max |dlogp|"]


def cells(row: dict) -> list[str]:
    def f(key, fmt):
        return fmt.format(row[key]) if row.get(key) is not None else "-"

    return [str(row["length"]), row["mode"], f("ttft_s", "{:.3f}"), f("tok_s", "{:.0f}"), f("speedup", "{:.2f}x"),
            f("gflops_per_token", "{:.4g}"), f("greedy_agreement", "{:.3f}"), f("max_logprob_diff", "{:.3g}")]


def line(row: dict) -> str:
    return "  ".join(f"{h}={c}" for h, c in zip(HEADERS, cells(row)))


def table(report: dict) -> str:
    body = [HEADERS] + [cells(r) for r in report["rows"]]
    widths = [max(len(c[i]) for c in body) for i in range(len(HEADERS))]
    lines = [f"{report['label']}  (V4.1 {report['preset']}, {report['layers']} layers, late {report['late_layers'][0]}-"
             f"{report['late_layers'][-1]}, window {report['window']}, keep {report['keep']}, {report['device']}, "
             f"{report['dtype']})"]
    for i, c in enumerate(body):
        lines.append(" | ".join(x.rjust(w) for x, w in zip(c, widths)))
        if i == 0:
            lines.append("-+-".join("-" * w for w in widths))
    return "\n".join(lines)


if __name__ == "__main__":
    main()

"""Train the tiny DeepSeek-V4.1 that deepinfer embeds as its default model, with its DSpark drafter (issue 52).

The forward is DeepSeek's own ``inference/model.py`` of the V4.1 release, made trainable
(``tools/v41_trainable.py``); the release folder is outside this repository and passed as ``--reference``
(its ``inference/`` directory). Nothing is downloaded; everything runs on the CPU.

1. corpus: the Python standard library's ``.py`` sources split by file (``tools/build_corpus.py``), the
   tokenizer of the tiny V4 default (``deepinfer_core/assets/deepseek-v4-tiny``), so both share ids;
2. target: the ``TINY_V41`` text model (``deepinfer_core.testing.tiny_v41``) with a wider window and
   index top-k (``CONFIG_OVERRIDES``), every V4.1 feature on (KV sources and readers, ratio-2 and ratio-1
   compression, index sources and reusers, the candidate filter, Engram, mHC), no vision tower; AdamW,
   cosine schedule, routers balanced without an aux loss (bias steps, as DeepSeek-V3); the indexers keep
   their random weights (no loss reaches a top-k of indices);
3. drafter: the three DSpark stages trained on the frozen target's ``main_hidden`` (stored weights) with
   cross-entropy, total variation to the target and the confidence head against acceptance
   (``tools/dspark_train.py``);
4. save: the release's layout, unquantised (``tools/v41_storage.py``), the HF ``config.json`` with the
   text model under ``text_config``, the tokenizer, ``training_info.json``; then deepinfer's engine
   (``load_model`` + ``forward`` and the drafter, cpu_ref, float64) is asserted to reproduce the
   training-time logits on the saved weights, and DSpark's acceptance is measured by the engine's own
   speculative decoding.

Each loop's length is the smallest of its ``--steps`` bound and what its time budget fits at the step
time measured over the first ``--calibrate-steps`` steps. Logs go to ``--logs``.

    python tools/train_tiny_v41.py --reference REF/inference --out DIR                 # the default (~40 min)
    python tools/train_tiny_v41.py --reference REF/inference --out DIR --time-budget 20 \\
        --dspark-time-budget 10 --seq-len 64 --batch-size 2                            # a micro run
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

TOOLS = Path(__file__).resolve().parent
REPO = TOOLS.parent
sys.path.insert(0, str(TOOLS))
import build_corpus  # noqa: E402
import dspark_train  # noqa: E402
import train_tiny  # noqa: E402
import v41_storage  # noqa: E402
import v41_trainable  # noqa: E402

CHECKPOINT_NAME = "deepseek-v41-tiny"
V4_ASSET = REPO / "deepinfer_core" / "assets" / "deepseek-v4-tiny"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
#: against TINY_V41 (built to make every feature bite at a dozen tokens): a window of 32, index top-k 16
#: within 4 candidate blocks of 8, so a trained model sees useful context
CONFIG_OVERRIDES = dict(sliding_window=32, index_topk=16, candidate_topk_blocks=4, candidate_block_size=8)


def model_config(overrides: dict = CONFIG_OVERRIDES) -> dict:
    """The HF config.json: TINY_V41's text model with ``overrides``, unquantised, no vision."""
    from deepinfer_core.testing.tiny_v41 import tiny_v41_config

    config = tiny_v41_config(tokenizer_dir=V4_ASSET, **overrides)
    config.pop("quantization_config")
    return config


def flat_config(config: dict) -> dict:
    from deepinfer_core.models.deepseek_v41.config import DeepseekV41Config

    return DeepseekV41Config.from_dict(config).to_flat()


def load_tokenizer():
    from transformers import AutoTokenizer, PretrainedConfig

    return AutoTokenizer.from_pretrained(str(V4_ASSET), config=PretrainedConfig())


# --- loops -----------------------------------------------------------------------------------------


class Budget:
    """Steps for a loop: ``max_steps``, or fewer if the budget at the calibrated step time says so."""

    def __init__(self, max_steps: int, seconds: float, calibrate: int):
        self.planned, self.seconds, self.calibrate = max_steps, seconds, calibrate
        self.t0 = time.perf_counter()

    def after(self, step: int) -> None:
        if step + 1 == self.calibrate:
            per_step = (time.perf_counter() - self.t0) / self.calibrate
            self.planned = max(self.calibrate, min(self.planned, int(self.seconds / per_step)))


def balance(routers, counts: dict, rate: float) -> float:
    """Aux-loss-free balancing: nudge each router's bias towards the mean load; the worst max/mean load."""
    worst = 1.0
    with torch.no_grad():
        for r in routers:
            c = counts.pop(id(r), None)
            if c is None:
                continue
            r.bias.add_(rate * torch.sign(c.mean() - c))
            worst = max(worst, (c.max() / c.mean().clamp(min=1.0)).item())
    return worst


def count_routes(routers) -> dict:
    counts: dict = {}

    def hook(module, args, out):
        c = torch.bincount(out[1].flatten(), minlength=module.weight.shape[0]).float()
        counts[id(module)] = counts.get(id(module), 0) + c

    for r in routers:
        r.register_forward_hook(hook)
    return counts


def lm_loss(model: v41_trainable.TrainableV41, ids: torch.Tensor) -> torch.Tensor:
    logits, _ = model.forward(ids[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


@torch.no_grad()
def eval_lm(model, windows: torch.Tensor, batch: int) -> float:
    total = sum(lm_loss(model, windows[i : i + batch]).item() * len(windows[i : i + batch])
                for i in range(0, len(windows), batch))
    return total / len(windows)


def train_target(model, args, train, val, log, metrics) -> dict:
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad and not n.startswith("mtp.")]
    decay = [p for n, p in params if p.dim() >= 2 and "hc_" not in n and "embed" not in n]
    rest = [p for n, p in params if not (p.dim() >= 2 and "hc_" not in n and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay}, {"params": rest, "weight_decay": 0}],
                            lr=args.lr, betas=(0.9, 0.95))
    routers = model.routers(drafter=False)
    counts = count_routes(routers)
    windows = train_tiny.Windows(train, args.seq_len + 1, args.batch_size, args.seed, "cpu")
    val_windows = train_tiny.fixed_windows(val, args.seq_len + 1, args.val_windows)
    budget = Budget(args.steps, args.time_budget, args.calibrate_steps)
    best = {"val_loss": float("inf"), "step": -1, "state": None}
    curve, step, t0 = [], 0, time.perf_counter()
    while step < budget.planned:
        lr = train_tiny.lr_at(step, budget.planned, args.lr, args.warmup, args.min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr
        loss = lm_loss(model, windows.next())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in params], args.grad_clip)
        opt.step()
        load = balance(routers, counts, args.bias_update_rate)
        budget.after(step)
        step += 1
        if step % args.log_every == 0 or step == 1:
            log(f"target {step}/{budget.planned} loss {loss.item():.4f} lr {lr:.2e} max load {load:.2f}")
            metrics({"phase": "target", "step": step, "loss": loss.item(), "lr": lr, "max_load": load})
        if step % args.eval_every == 0 or step == budget.planned:
            val_loss = eval_lm(model, val_windows, args.batch_size)
            curve.append({"step": step, "train_loss": round(loss.item(), 5), "val_loss": round(val_loss, 5),
                          "elapsed_s": round(time.perf_counter() - t0, 1)})
            log(f"target {step}: val loss {val_loss:.4f}")
            metrics({"phase": "target_eval", **curve[-1]})
            if val_loss < best["val_loss"]:
                best = {"val_loss": val_loss, "step": step,
                        "state": {n: p.detach().clone() for n, p in model.named_parameters()}}
    if best["state"] is not None:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(best["state"][n])
    seconds = time.perf_counter() - t0
    return {"steps": step, "tokens": step * args.batch_size * args.seq_len, "seconds": round(seconds, 1),
            "epochs": round(step * args.batch_size * args.seq_len / train.numel(), 3),
            "best_val_loss": best["val_loss"], "best_step": best["step"], "val_curve": curve}


def dspark_batch(model, ids: torch.Tensor, cfg: dict) -> dict:
    with torch.no_grad():
        target_logits, main_hidden = model.forward(ids)
    logits, confidence, targets = dspark_train.draft_all(model.module, ids, main_hidden, cfg["dspark_block_size"],
                                                         cfg["dspark_noise_token_id"])
    return dspark_train.losses(logits, confidence, targets, target_logits, cfg["dspark_block_size"])


def eval_dspark(model, windows: torch.Tensor, batch: int, cfg: dict) -> dict:
    sums: dict = {}
    with torch.no_grad():
        for i in range(0, len(windows), batch):
            out = dspark_batch(model, windows[i : i + batch], cfg)
            for k, v in out.items():
                sums[k] = sums.get(k, 0) + v * len(windows[i : i + batch])
    return {k: (v / len(windows)).tolist() for k, v in sums.items()}


def train_dspark(model, args, train, val, cfg: dict, log, metrics) -> dict:
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad and n.startswith("mtp.")]
    opt = torch.optim.AdamW([p for _, p in params], lr=args.dspark_lr, betas=(0.9, 0.95), weight_decay=0.0)
    routers = model.routers(drafter=True)
    counts = count_routes(routers)
    windows = train_tiny.Windows(train, args.seq_len, args.batch_size, args.seed + 7, "cpu")
    val_windows = train_tiny.fixed_windows(val, args.seq_len, args.val_windows)
    budget = Budget(args.dspark_steps, args.dspark_time_budget, args.calibrate_steps)
    step, t0 = 0, time.perf_counter()
    while step < budget.planned:
        lr = train_tiny.lr_at(step, budget.planned, args.dspark_lr, args.warmup // 2, args.min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr
        out = dspark_batch(model, windows.next(), cfg)
        loss = out["ce"] + out["tv"] + out["bce"]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in params], args.grad_clip)
        opt.step()
        balance(routers, counts, args.bias_update_rate)
        budget.after(step)
        step += 1
        if step % args.log_every == 0 or step == 1:
            rec = {k: round(out[k].item(), 4) for k in ("ce", "tv", "bce")}
            log(f"dspark {step}/{budget.planned} {rec} accept/pos "
                f"{[round(v, 3) for v in out['accept_per_position'].tolist()]}")
            metrics({"phase": "dspark", "step": step, **rec})
    seconds = time.perf_counter() - t0
    val_out = eval_dspark(model, val_windows, args.batch_size, cfg)
    log(f"dspark val: {val_out}")
    return {"steps": step, "seconds": round(seconds, 1), "val": val_out}


# --- held-out figures ------------------------------------------------------------------------------


def heldout_perplexity(model, heldout: torch.Tensor, counts: torch.Tensor, args) -> dict:
    windows = train_tiny.fixed_windows(heldout, args.seq_len + 1, args.heldout_windows)
    loss = eval_lm(model, windows, args.batch_size)
    probs = (counts.double() + 1) / (counts.sum() + counts.numel())
    unigram = -probs.log()[windows[:, 1:]].mean().item()
    return {"windows": len(windows), "tokens": int(windows[:, 1:].numel()), "loss": round(loss, 5),
            "perplexity": round(math.exp(loss), 3), "unigram_perplexity": round(math.exp(unigram), 3)}


def engine_acceptance(out: Path, heldout: torch.Tensor, tok, prompts: int, max_tokens: int, k: int) -> dict:
    """Greedy generation with DSpark by the engine (cpu_ref, float32) from held-out prompts, against the
    same generation without it: the outputs must match; the acceptance per block position."""
    from deepinfer_core import LLM, SamplingParams

    texts = [tok.decode(heldout[i * 400 : i * 400 + 48].tolist()) for i in range(prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    plain = LLM(model=str(out), backend="cpu_ref", dtype="float32")
    want = [o.outputs[0].token_ids for o in plain.generate(texts, params)]
    spec = LLM(model=str(out), backend="cpu_ref", dtype="float32",
               speculative_config={"method": "dspark", "num_speculative_tokens": k})
    got = [o.outputs[0].token_ids for o in spec.generate(texts, params)]
    assert got == want, "greedy with DSpark differs from greedy without"
    stats = spec.llm_engine.spec_decode_stats()
    return {"prompts": prompts, "max_tokens": max_tokens, **{k2: v for k2, v in stats.items()}}


# --- verification ----------------------------------------------------------------------------------


def verify_engine(out: Path, model, sample: torch.Tensor, cfg: dict, log) -> dict:
    """The engine (cpu_ref, float64, unquantised) against the training-time forward on the saved weights, in
    float64: every position's logits, and the drafter's block logits and confidences after each position of
    a decode. Leaves ``model`` in float64."""
    from deepinfer_core.models import load_model
    from deepinfer_core.testing.model_runner import SimpleRunner

    train_tiny.ensure_deepinfer()
    ids = sample.tolist()
    twin = model
    twin.module.double()
    with torch.no_grad():
        theirs, hidden = twin.forward(sample.unsqueeze(0), widen=True)
    engine = load_model(out, dtype=torch.float64, numerics="unquantised")
    runner = SimpleRunner(engine, 1, len(ids) + 8, block_size=32)
    prefill = len(ids) // 2
    logits, batch, main_hidden = runner.forward({0: ids[:prefill]}, all_logits=True)
    engine.dspark.seed(main_hidden, batch, runner.cache)
    ours, drafts = [logits[0]], []
    for i in range(prefill, len(ids) - 1):
        logits, batch, main_hidden = runner.forward({0: [ids[i]]}, all_logits=True)
        engine.dspark.seed(main_hidden, batch, runner.cache)
        ours.append(logits[0])
        rows = batch.window_rows()[batch.logits_indices]
        drafts.append(engine.dspark.draft(torch.tensor([ids[i + 1]]), torch.tensor([i]), rows, runner.cache))
    ours = torch.cat(ours).double()
    theirs = theirs[0, : len(ours)].double()
    main_rel = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    assert main_rel <= 1e-9, f"engine logits differ from the training-time forward: {main_rel:.3e} of the scale"
    k = cfg["dspark_block_size"]
    with torch.no_grad(), twin.mode(widen=True):
        block_logits, confidence, _ = dspark_train.draft_all(twin.module, sample.unsqueeze(0), hidden, k,
                                                             cfg["dspark_noise_token_id"])
    draft_rel, conf_abs, compared = 0.0, 0.0, 0
    for step, (drafted, d_logits, d_conf) in enumerate(drafts):
        p = prefill + step
        if p > len(ids) - 2 - k:
            break
        # teacher-forced positions: those whose previous drafted token is the data token
        same = [j for j in range(k) if j == 0 or drafted[0, j].item() == ids[p + 1 + j]]
        same = same[: next((n for n, j in enumerate(same) if j != n), len(same))]
        for j in same:
            ref_l = block_logits[0, p, j]
            draft_rel = max(draft_rel, ((d_logits[0, j].double() - ref_l).abs().max() / ref_l.abs().max()).item())
            conf_abs = max(conf_abs, abs(d_conf[0, j].item() - confidence[0, p, j].item()))
            compared += 1
    assert draft_rel <= 1e-9 and conf_abs <= 1e-9, (draft_rel, conf_abs)
    info = {"tokens": len(ids), "main_logits_max_rel": main_rel, "main_top1_agreement":
            (ours.argmax(-1) == theirs.argmax(-1)).double().mean().item(), "draft_positions_compared": compared,
            "draft_logits_max_rel": draft_rel, "confidence_logits_max_abs": conf_abs}
    log(f"verify: {info}")
    return info


# --- main ------------------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reference", type=Path, required=True,
                    help="the DeepSeek-V4.1 release's inference/ folder (model.py, engram.py, ...)")
    ap.add_argument("--out", type=Path, default=REPO / "deepinfer_core" / "assets" / CHECKPOINT_NAME)
    ap.add_argument("--logs", type=Path, help="metrics and token counts (default: <out>-logs beside <out>)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engram-layer-ids", type=lambda v: [int(x) for x in v.split(",")], default=None,
                    help="the Engram layers (default TINY_V41's 1,5; 1,3 puts both before the last KV source, "
                         "4, so bounded replay can cut the late layers)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5000, help="upper bound on target steps")
    ap.add_argument("--time-budget", type=float, default=1800.0, help="seconds for the target's loop")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--bias-update-rate", type=float, default=1e-3)
    ap.add_argument("--dspark-steps", type=int, default=3000)
    ap.add_argument("--dspark-time-budget", type=float, default=480.0)
    ap.add_argument("--dspark-lr", type=float, default=2e-3)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--val-windows", type=int, default=16)
    ap.add_argument("--heldout-windows", type=int, default=32)
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--calibrate-steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--accept-prompts", type=int, default=8)
    ap.add_argument("--accept-tokens", type=int, default=32)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    clock = train_tiny.Clock()
    out: Path = args.out
    logs: Path = args.logs or out.parent / f"{out.name}-logs"
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} exists and is not empty; choose another --out or remove it")
    logs.mkdir(parents=True, exist_ok=True)
    metrics_file = open(logs / "train_metrics.jsonl", "w")

    def log(msg: str) -> None:
        print(f"[{clock():7.1f}s] {msg}", flush=True)

    def metrics(rec: dict) -> None:
        metrics_file.write(json.dumps(rec) + "\n")
        metrics_file.flush()

    train_tiny.ensure_deepinfer()
    ref = v41_trainable.harness(args.reference)
    from tokenizers import Tokenizer

    # 1. corpus and the V4 default's tokenizer
    files = build_corpus.collect()
    manifest = build_corpus.manifest(files)
    split_texts = {s: build_corpus.texts(files, s) for s in ("train", "val", "heldout")}
    tok = Tokenizer.from_file(str(V4_ASSET / "tokenizer.json"))
    eos_id = tok.token_to_id(train_tiny.EOS)
    streams = {s: train_tiny.encode_stream(tok, t, eos_id) for s, t in split_texts.items()}
    counts = torch.bincount(streams["train"], minlength=tok.get_vocab_size())
    log("corpus: " + ", ".join(f"{s} {len(split_texts[s])} files / {streams[s].numel()} tokens" for s in streams))

    # 2. target
    overrides = dict(CONFIG_OVERRIDES)
    if args.engram_layer_ids is not None:
        overrides["engram_layer_ids"] = args.engram_layer_ids
    config = model_config(overrides)
    flat = flat_config(config)
    cfg_text = config["text_config"]
    model = v41_trainable.TrainableV41(ref, flat, load_tokenizer(), args.seq_len + 1, args.batch_size, args.seed)
    n_target = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("mtp."))
    n_drafter = sum(p.numel() for n, p in model.named_parameters() if n.startswith("mtp."))
    log(f"model: target {n_target / 1e6:.2f}M, drafter {n_drafter / 1e6:.2f}M parameters; {overrides}")
    target_info = train_target(model, args, streams["train"], streams["val"], log, metrics)
    log(f"target: {target_info['steps']} steps in {target_info['seconds']:.0f}s, best val loss "
        f"{target_info['best_val_loss']:.4f} at step {target_info['best_step']}")

    from deepinfer_core.models.deepseek_v41.config import DeepseekV41Config
    from deepinfer_core.models.deepseek_v41.manifest import manifest as v41_manifest

    man = v41_manifest(DeepseekV41Config.from_dict(config))
    v41_storage.round_to_storage(model.module, v41_storage.stored_tensors(model.module, man))
    heldout = heldout_perplexity(model, streams["heldout"], counts, args)
    log(f"held-out: {heldout}")

    # 3. drafter on the frozen, stored target
    for n, p in model.named_parameters():
        if not n.startswith("mtp."):
            p.requires_grad_(False)
    dspark_info = train_dspark(model, args, streams["train"], streams["val"], cfg_text, log, metrics)

    # 4. save, verify, measure
    tensors = v41_storage.stored_tensors(model.module, man)
    v41_storage.round_to_storage(model.module, tensors)
    v41_storage.write_checkpoint(out, tensors, config)
    for f in TOKENIZER_FILES:
        shutil.copy(V4_ASSET / f, out / f)
    sample = streams["val"][: min(96, args.seq_len + 1)]
    verify = verify_engine(out, model, sample, cfg_text, log)
    acceptance = engine_acceptance(out, streams["heldout"], tok, args.accept_prompts, args.accept_tokens,
                                   cfg_text["dspark_block_size"])
    log(f"engine acceptance: {acceptance}")
    info = {
        "name": CHECKPOINT_NAME,
        "seq_len": args.seq_len,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                 if k not in ("out", "logs", "reference")},
        "config_overrides": overrides,
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "device": "cpu", "threads": args.threads,
        "parameters": {"target": n_target, "drafter": n_drafter},
        "tokenizer": "deepseek-v4-tiny's (shared ids)",
        "corpus": {"python_version": manifest["python_version"], "split_rule": manifest["split_rule"],
                   "totals": manifest["totals"],
                   "train_files_sha256": hashlib.sha256("\n".join(
                       f"{f['path']} {f['sha256']}" for f in manifest["files"] if f["split"] == "train").encode()
                   ).hexdigest(),
                   "tokens": {s: int(v.numel()) for s, v in streams.items()}},
        "target": target_info,
        "heldout": heldout,
        "dspark": dspark_info,
        "dspark_engine_greedy": acceptance,
        "verify": verify,
        "wall_seconds": round(clock(), 1),
    }
    (out / "training_info.json").write_text(json.dumps(info, indent=1) + "\n")
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    log(f"saved {out.name}/ ({size / 1e6:.2f} MB); model.safetensors sha256 "
        f"{train_tiny.sha256_file(out / 'model.safetensors')}")
    metrics_file.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Perplexity baseline of the trained tiny DeepSeek-V4 (issue 9), written per backend as JSON.

Two evaluation sets, both cut into chunks of the training sequence length (each chunk starts a fresh
sequence at position 0; every token after the first is predicted exactly once):

* the stored slice ``data/heldout_slice.txt`` (a few KB of a held-out stdlib file; machine independent):
  float64, the regression baseline that ``tests/models/test_trained_model.py`` recomputes;
* the held-out split of *this* machine's stdlib (``tools/build_corpus.py``): ``--heldout-tokens`` worth of
  evenly spaced windows, float32, informative only (it depends on the Python version).

Rows: deepinfer's engine (``load_model`` + ``SimpleRunner``, all logits), transformers'
``DeepseekV4ForCausalLM`` on the same folder (as is, and with the CSA indexer's top-k ties broken
towards the earlier entry like the engine), a unigram model (train-split token counts, add-one
smoothing), the untrained model (same config, random init), and the MTP module's top-1 accuracy on
token t+2 (the engine's ``drafter.forward``).

    python tools/eval_perplexity.py --model deepinfer_core/assets/deepseek-v4-tiny \\
        --json-out data/perplexity_baseline_cpu_ref.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

TOOLS = Path(__file__).resolve().parent
REPO = TOOLS.parent
sys.path.insert(0, str(TOOLS))

DEFAULT_SLICE = REPO / "data" / "heldout_slice.txt"
DEFAULT_MODEL = REPO / "deepinfer_core" / "assets" / "deepseek-v4-tiny"


# --- inputs ----------------------------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def chunk_len(model_dir: Path, default: int = 512) -> int:
    """The training sequence length recorded with the checkpoint (the model's evaluated context)."""
    info = Path(model_dir) / "training_info.json"
    return int(json.loads(info.read_text()).get("seq_len", default)) if info.is_file() else default


def tokenize(model_dir: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return tok(text, add_special_tokens=False)["input_ids"]


def chunks(ids: list[int], length: int) -> list[tuple[list[int], list[int]]]:
    """(inputs, targets) pairs: inputs ids[s:s+L], targets the next tokens; s = 0, L, 2L, ..."""
    out = []
    for s in range(0, len(ids) - 1, length):
        inp = ids[s : min(s + length, len(ids) - 1)]
        out.append((inp, ids[s + 1 : s + 1 + len(inp)]))
    return out


def display_path(path: Path) -> str:
    """Repo-relative when inside the repo, else the file name: no machine paths in outputs."""
    try:
        return Path(path).resolve().relative_to(REPO).as_posix()
    except ValueError:
        return Path(path).name


# --- scorers ---------------------------------------------------------------------------------------


def _block_size(cfg) -> int:
    size = 16
    for rate in cfg.compress_rates.values():
        size = math.lcm(size, int(rate))
    return size


def _nll(logits: torch.Tensor, targets: list[int]) -> float:
    logp = torch.log_softmax(logits.double() if logits.dtype != torch.float64 else logits, dim=-1)
    return float(-logp[torch.arange(len(targets)), torch.tensor(targets)].sum())


@torch.no_grad()
def engine_scores(model, pairs, with_mtp: bool = False) -> dict:
    """Sum of NLL over every target with deepinfer's engine; MTP top-1 hits for t+2 if asked."""
    from deepinfer_core.model.metadata import SeqSpan, build_forward_batch
    from deepinfer_core.testing.model_runner import SimpleRunner

    nll, count, hits, mtp_count = 0.0, 0, 0, 0
    block = _block_size(model.cfg)
    for inp, tgt in pairs:
        runner = SimpleRunner(model, 1, len(inp), block_size=block)
        if not with_mtp:
            logits = runner.step({0: inp}, all_logits=True)[0]
        else:
            spans = [SeqSpan(0, len(inp), runner.table(0), runner.table(0), 0)]
            batch = build_forward_batch(inp, spans, model.compressor_specs(), block, model.cfg.sliding_window,
                                        logits_indices=list(range(len(inp))), device=model.device)
            logits, streams = model.forward(batch, runner.cache)
            # MTP at t: streams_t and token t+1 (= targets[t]) -> token t+2 (= targets[t+1])
            n = len(inp) - 1
            if n > 0:
                spans = [SeqSpan(0, n, runner.table(0), runner.table(0), 0)]
                mbatch = build_forward_batch(inp[:n], spans, model.compressor_specs(), block,
                                             model.cfg.sliding_window, logits_indices=list(range(n)),
                                             device=model.device)
                nxt = torch.tensor(tgt[:n], device=model.device)
                draft, _ = model.drafter.forward(mbatch, runner.cache, streams[:n], nxt)
                hits += int((draft.argmax(-1).cpu() == torch.tensor(tgt[1 : n + 1])).sum())
                mtp_count += n
        nll += _nll(logits.cpu(), tgt)
        count += len(tgt)
    out = {"nll": nll, "tokens": count, "ppl": math.exp(nll / count)}
    if with_mtp:
        out.update(mtp_top1=hits / max(mtp_count, 1), mtp_predicted=mtp_count)
    return out


class StableIndexerTies:
    """Make transformers' CSA indexer score in the model dtype and break top-k ties like the engine.

    transformers scores in float32 and leaves ``topk`` tie order to torch; entries whose score is exactly
    0 (ReLU) often tie at the k-th place. The engine's catalogue breaks ties towards the earlier entry.
    """

    def __init__(self, model):
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Indexer

        self.handles, self.scores = [], {}
        for module in model.modules():
            if isinstance(module, DeepseekV4Indexer):
                self.handles.append(module.scorer.register_forward_hook(self._score(id(module))))
                self.handles.append(module.register_forward_hook(self._topk))

    def _score(self, key):
        def hook(scorer, args, out):
            q, keys, hidden = args
            dots = torch.matmul(q, keys.transpose(-1, -2).unsqueeze(1))  # [B, S, H, T]
            weights = scorer.weights_proj(hidden) * scorer.weights_scaling  # [B, S, H]
            scores = (torch.relu(dots) * scorer.softmax_scale * weights.unsqueeze(-1)).sum(dim=2)
            self.scores[key] = scores
            return scores
        return hook

    def _topk(self, indexer, args, out):
        scores = self.scores.pop(id(indexer), None)
        if scores is None or scores.shape[-1] == 0:
            return out
        position_ids = args[2]
        threshold = (position_ids + 1) // indexer.compress_rate
        entries = torch.arange(scores.shape[-1], device=scores.device)
        future = entries.view(1, 1, -1) >= threshold.unsqueeze(-1)
        order = torch.sort(scores.masked_fill(future, float("-inf")), dim=-1, descending=True, stable=True)
        picked = order.indices[..., : out.shape[-1]]
        return torch.where(picked >= threshold.unsqueeze(-1), torch.full_like(picked, -1), picked)

    def remove(self):
        for h in self.handles:
            h.remove()


@torch.no_grad()
def hf_scores(model, pairs, stable_ties: bool = False) -> dict:
    patch = StableIndexerTies(model) if stable_ties else None
    try:
        nll, count = 0.0, 0
        for inp, tgt in pairs:
            logits = model(input_ids=torch.tensor([inp], device=model.device), use_cache=False).logits[0]
            nll += _nll(logits.cpu(), tgt)
            count += len(tgt)
    finally:
        if patch is not None:
            patch.remove()
    return {"nll": nll, "tokens": count, "ppl": math.exp(nll / count)}


def unigram_scores(counts: list[int], pairs) -> dict:
    c = torch.tensor(counts, dtype=torch.float64)
    logp = torch.log((c + 1) / (c.sum() + c.numel()))
    targets = torch.tensor([t for _, tgt in pairs for t in tgt])
    nll = float(-logp[targets].sum())
    return {"nll": nll, "tokens": targets.numel(), "ppl": math.exp(nll / targets.numel())}


def load_hf(model_dir: Path, dtype: torch.dtype):
    from transformers import AutoConfig, DeepseekV4ForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    config._experts_implementation = "eager"
    model = DeepseekV4ForCausalLM.from_pretrained(str(model_dir), config=config, dtype=torch.float32)
    return model.to(dtype).eval()


def untrained_model(model_dir: Path, dtype: torch.dtype):
    """Same config, transformers' random init with the training seed (what training started from)."""
    from train_tiny import init_model
    from transformers import AutoConfig

    info = Path(model_dir) / "training_info.json"
    seed = json.loads(info.read_text()).get("seed", 0) if info.is_file() else 0
    config = AutoConfig.from_pretrained(str(model_dir))
    config._experts_implementation = "eager"
    return init_model(config, seed).to(dtype).eval()


def train_counts(model_dir: Path, counts_file: Path | None, vocab_size: int) -> tuple[list[int], str]:
    if counts_file is not None and counts_file.is_file():
        return json.loads(counts_file.read_text()), display_path(counts_file)
    import build_corpus
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    files = build_corpus.collect()
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for text in build_corpus.texts(files, "train"):
        ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        counts += torch.bincount(torch.tensor(ids), minlength=vocab_size)
    return counts.tolist(), f"train split of this machine's stdlib (python {platform.python_version()})"


def heldout_pairs(model_dir: Path, limit: int, length: int) -> tuple[list, dict]:
    """Evenly spaced windows of ``length + 1`` tokens over this machine's whole held-out split.

    The split's files are tokenised and joined with eos (as in training); ``limit // length`` windows
    are taken at a fixed stride, so every held-out file is sampled, deterministically.
    """
    import build_corpus
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    files = build_corpus.collect()
    held = [f for f in files if f.split == "heldout"]
    ids: list[int] = []
    for text in build_corpus.texts(files, "heldout"):
        ids.extend(tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
    n = max(1, min(limit // length, (len(ids) - 1) // length))
    stride = (len(ids) - 1 - length) // max(1, n - 1) if n > 1 else 0
    pairs = []
    for i in range(n):
        w = ids[i * stride : i * stride + length + 1]
        pairs.append((w[:-1], w[1:]))
    return pairs, {"python_version": platform.python_version(), "files": len(held), "split_tokens": len(ids),
                   "windows": n, "stride": stride}


# --- main ------------------------------------------------------------------------------------------


def evaluate_set(name, model_dir, pairs, length, dtype, args, counts, log, hf_device="cpu",
                 stable_ties=True) -> dict:
    from deepinfer_core.models import load_model

    res: dict = {"predicted": sum(len(t) for _, t in pairs), "chunk_len": length,
                 "dtype": str(dtype).replace("torch.", "")}
    t0 = time.perf_counter()
    engine = load_model(model_dir, backend=args.backend, dtype=dtype, device=args.device)
    res["engine"] = engine_scores(engine, pairs, with_mtp=engine.has_mtp)
    log(f"{name}: engine ({args.backend}, {res['dtype']}) ppl {res['engine']['ppl']:.6f}"
        + (f", MTP top-1 {res['engine']['mtp_top1']:.4f}" if engine.has_mtp else "")
        + f" [{time.perf_counter() - t0:.1f}s]")
    del engine
    if not args.skip_transformers:
        t0 = time.perf_counter()
        hf = load_hf(model_dir, dtype).to(hf_device)
        res["transformers"] = hf_scores(hf, pairs)
        res["transformers"]["device"] = str(hf_device)
        msg = f"{name}: transformers ({hf_device}) ppl {res['transformers']['ppl']:.6f}"
        if stable_ties:
            res["transformers_stable_ties"] = hf_scores(hf, pairs, stable_ties=True)
        del hf
        for key in ("transformers", "transformers_stable_ties"):
            if key in res:
                res[key]["rel_diff_vs_engine"] = abs(res[key]["ppl"] / res["engine"]["ppl"] - 1)
        msg += f" (rel diff {res['transformers']['rel_diff_vs_engine']:.2e})"
        if stable_ties:
            msg += (f", with the engine's indexer tie-break {res['transformers_stable_ties']['ppl']:.6f} "
                    f"(rel diff {res['transformers_stable_ties']['rel_diff_vs_engine']:.2e})")
        log(msg + f" [{time.perf_counter() - t0:.1f}s]")
    if counts is not None:
        res["unigram"] = unigram_scores(counts, pairs)
    if not args.skip_untrained:
        t0 = time.perf_counter()
        res["untrained"] = hf_scores(untrained_model(model_dir, torch.float32).to(hf_device), pairs)
        log(f"{name}: untrained ppl {res['untrained']['ppl']:.2f} [{time.perf_counter() - t0:.1f}s]")
    return res


def print_table(result: dict) -> None:
    sets = [k for k in ("slice", "heldout") if k in result]
    rows = [("engine (" + result["backend"] + ")", "engine", "ppl"),
            ("transformers", "transformers", "ppl"),
            ("transformers, engine tie-break", "transformers_stable_ties", "ppl"),
            ("unigram (add-one)", "unigram", "ppl"),
            ("untrained (random init)", "untrained", "ppl"),
            ("MTP top-1 accuracy (t+2)", "engine", "mtp_top1")]
    head = f"{'':34s}" + "".join(f"{s + ' (' + result[s]['dtype'] + ')':>24s}" for s in sets)
    print(head)
    print("-" * len(head))
    for label, key, field in rows:
        cells = []
        for s in sets:
            v = result[s].get(key, {}).get(field)
            cells.append(f"{v:>24.6f}" if isinstance(v, float) else f"{'-':>24s}")
        print(f"{label:34s}" + "".join(cells))
    for s in sets:
        print(f"{s}: {result[s]['predicted']} predicted tokens in chunks of {result[s]['chunk_len']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--backend", default="cpu_ref")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--slice", type=Path, default=DEFAULT_SLICE)
    ap.add_argument("--counts", type=Path, help="train_token_counts.json written by train_tiny.py "
                    "(default: recount this machine's train split)")
    ap.add_argument("--heldout-tokens", type=int, default=16384, help="cap on the held-out split (0: skip it)")
    ap.add_argument("--hf-device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="device of the transformers / untrained rows on the held-out split (the slice: cpu)")
    ap.add_argument("--json-out", type=Path, help="default: data/perplexity_baseline_<backend>.json")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--skip-untrained", action="store_true")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    from train_tiny import ensure_deepinfer
    from transformers import AutoConfig
    from transformers import __version__ as tf_version

    ensure_deepinfer()

    model_dir = args.model
    config = AutoConfig.from_pretrained(str(model_dir))
    length = chunk_len(model_dir)
    counts, counts_source = train_counts(model_dir, args.counts, config.vocab_size)
    info = json.loads((model_dir / "training_info.json").read_text()) if (model_dir / "training_info.json").is_file() \
        else {}
    result: dict = {
        "backend": args.backend,
        "model": {
            "name": model_dir.name,
            "safetensors_sha256": sha256_file(model_dir / "model.safetensors"),
            "tokenizer_sha256": sha256_file(model_dir / "tokenizer.json"),
            "chunk_len": length,
            "trained_on_python": info.get("corpus", {}).get("python_version"),
        },
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "transformers": tf_version},
        "unigram_counts": counts_source,
    }
    slice_text = args.slice.read_text(encoding="utf-8")
    slice_ids = tokenize(model_dir, slice_text)
    meta = args.slice.with_suffix(".json")
    result["slice"] = {
        "file": display_path(args.slice),
        "sha256": hashlib.sha256(slice_text.encode()).hexdigest(),
        "source": json.loads(meta.read_text()) if meta.is_file() else None,
        "tokens": len(slice_ids),
        **evaluate_set("slice", model_dir, chunks(slice_ids, length), length, torch.float64, args, counts, log),
    }
    if args.heldout_tokens > 0:
        pairs, source = heldout_pairs(model_dir, args.heldout_tokens, length)
        result["heldout"] = {**source, **evaluate_set("heldout", model_dir, pairs, length, torch.float32, args,
                                                      counts, log, hf_device=args.hf_device, stable_ties=False)}
    out = args.json_out or REPO / "data" / f"perplexity_baseline_{args.backend}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print()
    print_table(result)
    log(f"wrote {display_path(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What Engram adds to the engine's own V4.1 decode step, per table placement, on one device.

    python benchmarks/bench_engram_step.py --backend nvidia_sm100 --device cuda --rows 40000000 \\
        --batches 1,16,64,256 --out engram_step.json

The release's config cut to its first ``--layers`` layers (16: both Engram layers, 1 and 14, and the KV
sources before them), ``--experts`` routed experts held, random weights, and its two Engram tables at about
``--rows`` E4M3 rows each (264 B a row with its E8M0 scales; the release's are 384 M rows, 101 GB each: the
hash layout's vocabulary is scaled so that its rows come near ``--rows``). The tables are written to a
safetensors file (``--dir``) and placed by the loader's own :func:`place_tables`:

- ``none``: the Engram layers left out: the step the others are compared with;
- ``device``: the tables in device memory;
- ``host``: in pinned host memory, read in place by the lookup kernel over unified addressing;
- ``file``: views of the file's mapping.

For each, an engine over the same weights (CUDA graphs where the device has them; each step's lookups
start on a side stream at the step's start and are joined in their layers) decodes ``--batches`` greedy
sequences; reported: the median decode step (every sequence decoding, ``--steps`` of them, timed from the
host: a synchronous engine's step returns once the device is done), and its difference to ``none`` in ms
and in percent. The issue's goal: ``host`` adds at most 5% to the batch-64 step. Prints a table and writes
JSON (``--out``).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_bounded_replay as bbr  # noqa: E402
import bench_gpu_decode as bgd  # noqa: E402

PLACEMENTS = ("none", "device", "host", "file")
#: the release's tokenizer maps its 129,280 ids onto this many compressed ids
COMPRESSED_VOCAB = 99_092


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="cpu_ref")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on an accelerator, float32 on the CPU")
    ap.add_argument("--layers", type=int, default=16, help="the release's first N layers (Engram at 1 and 14)")
    ap.add_argument("--experts", type=int, default=8, help="routed experts held (6 active)")
    ap.add_argument("--shrink", type=int, default=1, help="widths divided by this (a smoke run on a CPU)")
    ap.add_argument("--rows", type=int, default=40_000_000, help="rows of each table, about")
    ap.add_argument("--batches", type=lambda v: [int(x) for x in v.split(",")], default=[1, 16, 64, 256])
    ap.add_argument("--placements", type=lambda v: v.split(","), default=list(PLACEMENTS))
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per batch")
    ap.add_argument("--warmup", type=int, default=3, help="decode steps run before timing")
    ap.add_argument("--dir", default=None, help="where the tables' file is written (default: a temp dir)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    unknown = set(a.placements) - set(PLACEMENTS)
    if unknown:
        ap.error(f"unknown placements {sorted(unknown)}; choose from {PLACEMENTS}")
    return a


def config_dict(a) -> tuple[dict, object]:
    """The cut release config with its Engram layers (those below ``--layers``) and tables of about
    ``--rows`` rows; and the hash layout they were sized by."""
    from deepinfer_core.models.deepseek_v41.engram_hash import EngramHashLayout

    longest = a.prompt_len + a.warmup + a.steps + 64
    ns = SimpleNamespace(preset="v41", layers=a.layers, experts=a.experts, shrink=a.shrink, backend=a.backend,
                         seed=a.seed)
    config = bbr.model_config_dict(ns, longest)
    text = config["text_config"]
    release = json.loads(bbr.RELEASE_CONFIG.read_text())["text_config"]
    layers = [layer for layer in release["engram_layer_ids"] if layer < a.layers]
    if not layers:
        raise SystemExit(f"--layers {a.layers} holds no Engram layer (the release's: {release['engram_layer_ids']})")
    columns = release["engram_n_heads"] * (release["engram_max_ngram_size"] - 1)
    compressed = min(COMPRESSED_VOCAB, text["vocab_size"])
    token_map = [i if i < compressed else 5 for i in range(text["vocab_size"])]
    layout = EngramHashLayout.build(layer_ids=layers, max_ngram_size=release["engram_max_ngram_size"],
                                    n_heads=release["engram_n_heads"], vocab_size=max(a.rows // columns, 64),
                                    token_map=token_map, pad_token_id=release["engram_pad_token_id"])
    text.update(engram_layer_ids=layers, engram_num_embeddings=list(layout.num_rows),
                engram_vocab_size=max(a.rows // columns, 64), engram_compressed_vocab_size=compressed)
    return config, layout


def write_tables(path: Path, cfg, seed: int) -> dict[str, SimpleNamespace]:
    """One safetensors file of every Engram table (random E4M3 rows, unit E8M0 scales), as the loader's
    entries (canonical name -> ``file``, ``key``)."""
    from deepinfer_core.models.deepseek_v41.engram_placement import table_names
    from deepinfer_core.quant.fp4 import E8M0_DTYPE

    gen = torch.Generator().manual_seed(seed)
    tensors, entries = {}, {}
    for name, rows in zip(table_names(cfg), cfg.engram_num_embeddings):
        hd = cfg.engram_head_dim
        weight = torch.empty((rows, hd), dtype=torch.uint8)
        for start in range(0, rows, 1 << 22):  # E4M3 codes of magnitude below 1.0, both signs
            chunk = weight[start:start + (1 << 22)]
            chunk.copy_(torch.randint(0, 0x38, chunk.shape, dtype=torch.uint8, generator=gen))
            chunk.bitwise_or_(torch.randint(0, 2, chunk.shape, dtype=torch.uint8, generator=gen) << 7)
        scale_name = name.removesuffix(".weight") + ".scale"
        tensors[name] = weight.view(torch.float8_e4m3fn)
        tensors[scale_name] = torch.full((rows, -(-hd // 32)), 127, dtype=torch.uint8).view(E8M0_DTYPE)
        entries[name] = SimpleNamespace(file=path, key=name)
        entries[scale_name] = SimpleNamespace(file=path, key=scale_name)
    save_file(tensors, str(path))
    return entries


class Models:
    """The random weights (made once on the device) and, per placement, a model over them."""

    def __init__(self, a, config: dict, layout, table_file: Path, device: torch.device, dtype: torch.dtype):
        from deepinfer_core.models.deepseek_v41 import ARCHITECTURE
        from deepinfer_core.models.deepseek_v41.config import DeepseekV41Config
        from deepinfer_core.models.deepseek_v41.engram_hash import EngramHasher
        from deepinfer_core.models.deepseek_v41.engram_placement import table_names

        self.a, self.device, self.dtype, self.arch = a, device, dtype, ARCHITECTURE
        self.cfg = DeepseekV41Config.from_dict(config)
        small = dict(config, text_config=dict(config["text_config"], engram_num_embeddings=[1] * len(
            self.cfg.engram_layer_ids)))  # the tables come from the file: one row each here
        self.params = bbr.random_params(DeepseekV41Config.from_dict(small), dtype, device, a.seed)
        self.stub_tables = {name: self.params.pop(name) for name in table_names(self.cfg)}  # for "none"
        if ARCHITECTURE.prepare_params is not None:
            ARCHITECTURE.prepare_params(self.cfg, self.params, dtype)
        self.entries = write_tables(table_file, self.cfg, a.seed)
        self.hasher = EngramHasher(layout).to(device)

    def model(self, placement: str):
        from deepinfer_core.models.deepseek_v41.engram_placement import place_tables
        from deepinfer_core.models.deepseek_v41.model import DeepseekV41Model
        from deepinfer_core.plugins import build_op_table, load_backend

        params = dict(self.params)
        if placement != "none":
            params.update(place_tables(self.cfg, self.entries, placement, self.device))
        else:  # float tables of one row: the layers are dropped below
            params.update(self.stub_tables)
        weights = self.arch.build_weights(self.cfg, params, load_backend(self.a.backend).hook)
        ops = build_op_table(self.a.backend, dtype=self.dtype, device=self.device, model_config=self.cfg)
        if placement == "none":
            for block in weights.layers:
                block.engram = None
        return DeepseekV41Model(self.cfg, weights, ops, self.dtype, numerics="unquantised",
                                engram_hash=None if placement == "none" else self.hasher)


def residences(model) -> list[str]:
    """Where each Engram table's rows are."""
    from deepinfer_core.model.mapped import residence

    return [residence(b.engram.table.weight) for b in model.weights.layers if b.engram is not None]


def run_placement(a, models: Models, placement: str, cfg_dir: Path, device: torch.device,
                  where: dict[str, list[str]]) -> list[dict]:
    """An engine over ``placement``'s model: a row per batch size (``where``: its tables' residence)."""
    model = models.model(placement)
    where[placement] = residences(model)
    engine = bgd.make_engine(model, cfg_dir, backend=a.backend, seed=a.seed, **bgd.host_pools(device),
                             max_num_seqs=max(a.batches), max_num_batched_tokens=max(max(a.batches) * a.prompt_len,
                                                                                     2048))
    rows = []
    for batch in a.batches:
        times = bgd.decode_steps(engine, batch, a, models.cfg.vocab_size)
        rows.append({"placement": placement, "batch": batch, "step_ms": statistics.median(times), "steps_ms": times})
        print(f"{placement:>6} batch {batch:>4}: {rows[-1]['step_ms']:.3f} ms a decode step")
    return rows


def main(argv=None) -> dict:
    from deepinfer_core.models.deepseek_v41.engram_placement import table_bytes

    a = parse_args(argv)
    device = torch.device(a.device)
    dtype = getattr(torch, a.dtype or ("float32" if device.type == "cpu" else "bfloat16"))
    config, layout = config_dict(a)
    if a.dir:
        Path(a.dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        cfg_dir = Path(tmp) / "config"
        cfg_dir.mkdir()
        (cfg_dir / "config.json").write_text(json.dumps(config))
        t0 = time.perf_counter()
        models = Models(a, config, layout, Path(tmp) / "engram.safetensors", device, dtype)
        print(f"weights and tables in {time.perf_counter() - t0:.1f} s: {len(models.cfg.engram_layer_ids)} tables "
              f"of {list(models.cfg.engram_num_embeddings)} rows")
        rows, where, failed = [], {}, {}
        for placement in a.placements:
            try:
                rows += run_placement(a, models, placement, cfg_dir, device, where)
            except Exception as exc:  # one placement's failure (e.g. a capture the engine refused) ends only it
                failed[placement] = f"{type(exc).__name__}: {exc}"
                print(f"{placement}: failed: {failed[placement]}")
            gc.collect()  # the next engine sizes its pools from the memory left free
            if device.type == "cuda":
                torch.cuda.empty_cache()
    base = {r["batch"]: r["step_ms"] for r in rows if r["placement"] == "none"}
    for r in rows:
        if r["batch"] in base:
            r["added_ms"] = r["step_ms"] - base[r["batch"]]
            r["added_pct"] = 100 * r["added_ms"] / base[r["batch"]]
    report = {"benchmark": "engram_step", "backend": a.backend, "device": str(device), "dtype": str(dtype),
              "torch": torch.__version__, "layers": a.layers, "routed_experts": a.experts, "shrink": a.shrink,
              "engram_layers": list(models.cfg.engram_layer_ids),
              "table_rows": list(models.cfg.engram_num_embeddings),
              "table_bytes": table_bytes(models.cfg),
              "residence": where, "failed": failed, "steps": a.steps, "prompt_len": a.prompt_len, "rows": rows}
    print(table(report))
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=2))
    return report


def table(report: dict) -> str:
    lines = [f"{'placement':>9} | {'batch':>5} | {'step ms':>8} | {'added ms':>8} | {'added %':>7}",
             "-" * 50]
    for r in report["rows"]:
        added = f"{r['added_ms']:>8.3f} | {r['added_pct']:>6.1f}%" if "added_ms" in r else f"{'-':>8} | {'-':>7}"
        lines.append(f"{r['placement']:>9} | {r['batch']:>5} | {r['step_ms']:>8.3f} | {added}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

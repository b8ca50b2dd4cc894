"""The sweep: one random V4-Flash-width model, every engine configuration's decode (batch sizes) and
prefill (chunk sizes) with per-step floors, the same workloads through transformers, and the report."""

from __future__ import annotations

import gc
import importlib.util
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from benchmarks import bench_gpu_decode as bgd
from benchmarks.gpu_sweep.costs import ModelCost, measure_matmul_flops
from benchmarks.gpu_sweep.engine_runs import (
    EngineConfig,
    fill_floors,
    run_decode,
    run_prefill,
    summarize_decode,
    summarize_prefill,
)
from benchmarks.gpu_sweep.hf_runs import hf_decode, hf_prefill

DEFAULT_CONFIGS = ("graphs+async", "graphs", "eager+async", "eager")
DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DEFAULT_CHUNKS = (512, 2048, 8192)
MODES = ("decode", "prefill")


@dataclass
class SweepOptions:
    out: Path
    modes: tuple[str, ...] = MODES
    configs: tuple[str, ...] = DEFAULT_CONFIGS
    fp8: bool = False  # add a +fp8 variant of every config (when deepinfer_core.quant.fp8 exists)
    batch_sizes: tuple[int, ...] = DEFAULT_BATCHES
    prompt_len: int = 256
    gen_len: int = 64
    chunk_sizes: tuple[int, ...] = DEFAULT_CHUNKS
    prefill_len: int | None = None  # prompt of the prefill runs (default: the largest chunk)
    decode_batched_tokens: int = 8192  # max_num_batched_tokens of the decode engines
    warmup_steps: int = 3  # decode steps per batch size left out of the medians
    hf: bool = True
    model_argv: list[str] = field(default_factory=list)  # bench_gpu_decode's model options (--small, --layers...)
    library_set: str | None = None  # the --libraries set this process runs (the others made unimportable)


def fp8_available() -> bool:
    return importlib.util.find_spec("deepinfer_core.quant.fp8") is not None


def engine_configs(opts: SweepOptions, log: Callable[[str], None]) -> list[EngineConfig]:
    """The configs to run, bf16 first (FP8 weights are built once, after the bf16 engines are gone)."""
    configs = [EngineConfig(name) for name in opts.configs]
    if opts.fp8:
        if fp8_available():
            configs += [EngineConfig(c.name + "+fp8") for c in configs if not c.fp8]
        else:
            log("--fp8: deepinfer_core.quant.fp8 is not importable; FP8 configs skipped")
    unique = list(dict.fromkeys(configs))
    return sorted(unique, key=lambda c: c.fp8)


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _error(exc: BaseException) -> str:
    lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
    return "".join(lines[-6:]).strip()


class Sweep:
    """Holds the random model, the device rates and the prompts; runs configs one after another."""

    def __init__(self, opts: SweepOptions, log: Callable[[str], None] = print):
        from benchmarks.gpu_sweep.libraries import hidden_here, library_status
        from deepinfer_core.benchmark import machine_info

        self.opts, self.log = opts, log
        a = bgd.parse_args(opts.model_argv)
        self.prefill_len = opts.prefill_len or max(opts.chunk_sizes)
        self.batches = sorted(set(opts.batch_sizes))
        chunks = -(-self.batches[-1] * opts.prompt_len // opts.decode_batched_tokens)
        self.decode_len = opts.prompt_len + opts.gen_len + chunks + 2
        a.prompt_len, a.gen_len = max(self.decode_len, self.prefill_len + 2), 0  # sizes max_position_embeddings
        self.a = a
        self.device, self.dtype = torch.device(a.device), getattr(torch, a.dtype)
        log(f"building the random model ({a.layers} layers, hidden {a.hidden}, {a.experts} experts) on {a.device}")
        self.rm = bgd.RandomModel(a, self.device, self.dtype)
        self.bandwidth = bgd.measure_copy_bandwidth(self.device)
        self.matmul_flops = measure_matmul_flops(self.device, self.dtype)
        log(f"copy bandwidth {self.bandwidth / 1e9:.0f} GB/s, {a.dtype} matmul {self.matmul_flops / 1e12:.1f} TFLOP/s")
        gen = torch.Generator().manual_seed(a.seed)
        vocab = self.rm.cfg.vocab_size
        self.decode_prompts = {b: torch.randint(2, vocab, (b, opts.prompt_len), generator=gen).tolist()
                               for b in self.batches}
        self.prefill_prompts = torch.randint(2, vocab, (2, self.prefill_len), generator=gen).tolist()
        self.report: dict[str, Any] = {
            "environment": machine_info() | bgd.environment(self.device) | {
                "copy_bandwidth_gb_s": self.bandwidth / 1e9, "matmul_tflops": self.matmul_flops / 1e12,
                "matmul_dtype": a.dtype, "model_init_s": self.rm.init_s},
            "model": bgd.model_summary(a, self.rm),
            "options": {
                "modes": list(opts.modes), "configs": [], "batch_sizes": self.batches,
                "prompt_len": opts.prompt_len, "gen_len": opts.gen_len, "chunk_sizes": sorted(opts.chunk_sizes),
                "prefill_len": self.prefill_len, "decode_batched_tokens": opts.decode_batched_tokens,
                "warmup_steps": opts.warmup_steps, "hf": opts.hf,
            },
            "method": {
                "decode": "per batch size, the steps where every sequence decodes one token; wall = time between "
                          "engine.step() returns (no synchronisation inside the loop); forward = CUDA events around "
                          "runner.execute; sampling = CUDA events around the sampler call; other = wall - forward "
                          "- sampling (scheduling, batch building, outputs); medians after warmup_steps",
                "floor": "max(bandwidth floor, compute floor); bandwidth floor = (attention + shared expert + "
                         "every routed expert any token picked + LM head + embedding rows + KV attended) bytes "
                         "over the copy bandwidth; compute floor = matmul + attention FLOPs over the matmul rate",
                "routing": "recorded: seen in that step; borrowed: the same step of a config that saw it (graph "
                           "replays do not show it); expected: uniform routing",
                "prefill": "one prompt of prefill_len tokens in chunks of max_num_batched_tokens, after a warm-up "
                           "prompt; transformers: one forward over the first `chunk` tokens of the same prompt",
                "transformers": "decode step = (generate(gen_len) - generate(1)) / (gen_len - 1), greedy",
            },
            "configs": {},
            "transformers": {"decode": [], "prefill": []},
            # DeepSeek's kernel libraries as this process found them, and what served each op (per model)
            "libraries": library_status(),
            "library_set": {"name": opts.library_set, "hidden": list(hidden_here())},
            "ops": {},
        }

    # --- engine configs ---------------------------------------------------------------------------

    def engine(self, model: Any, config: EngineConfig, **args: Any) -> Any:
        return bgd.make_engine(model, self.rm.cfg_dir, backend=self.a.backend, seed=self.a.seed,
                               **args, **config.engine_args())

    def run_config(self, model: Any, cost: ModelCost, config: EngineConfig) -> dict[str, Any]:
        result: dict[str, Any] = {"engine_args": config.engine_args(), "decode": [], "prefill": []}
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        if "decode" in self.opts.modes:
            self.decode(model, cost, config, result)
        if "prefill" in self.opts.modes:
            self.prefill(model, cost, config, result)
        if self.device.type == "cuda":
            result["peak_mem_gb"] = torch.cuda.max_memory_allocated(self.device) / 1e9
        return result

    def decode(self, model: Any, cost: ModelCost, config: EngineConfig, result: dict[str, Any]) -> None:
        try:
            engine = self.engine(model, config, max_model_len=self.decode_len, max_num_seqs=self.batches[-1],
                                 max_num_batched_tokens=self.opts.decode_batched_tokens)
        except Exception as exc:  # e.g. graphs not supported yet: recorded, the sweep goes on
            result["error"] = _error(exc)
            self.log(f"{config.name}: engine failed to build:\n{result['error']}")
            return
        stop = None
        for b in self.batches:
            if stop:
                result["decode"].append({"batch": b, "error": stop})
                continue
            try:
                rows = run_decode(engine, cost, b, self.decode_prompts[b], self.opts.gen_len, f"{config.name}-b{b}")
                result["decode"].append({"batch": b, "steps": rows})
            except torch.OutOfMemoryError as exc:
                result["decode"].append({"batch": b, "error": f"out of memory: {exc}"})
                stop = f"skipped: out of memory at batch {b}"
            except Exception as exc:
                result["decode"].append({"batch": b, "error": _error(exc)})
                stop = f"skipped: batch {b} failed"
                self.log(f"{config.name} decode b={b} failed:\n{_error(exc)}")
        del engine
        free_device_memory()

    def prefill(self, model: Any, cost: ModelCost, config: EngineConfig, result: dict[str, Any]) -> None:
        for chunk in sorted(self.opts.chunk_sizes):
            row: dict[str, Any] = {"chunk": chunk}
            try:
                engine = self.engine(model, config, max_model_len=self.prefill_len + 2, max_num_seqs=1,
                                     max_num_batched_tokens=chunk)
                runs = run_prefill(engine, cost, self.prefill_prompts, f"{config.name}-c{chunk}")
                row["steps"] = runs[-1]
                del engine
            except Exception as exc:
                row["error"] = _error(exc)
                self.log(f"{config.name} prefill chunk={chunk} failed:\n{row['error']}")
            result["prefill"].append(row)
            free_device_memory()

    # --- transformers -----------------------------------------------------------------------------

    def transformers(self, cost: ModelCost) -> None:
        out, hf, device = self.report["transformers"], self.rm.hf_model, self.device
        if "decode" in self.opts.modes:
            stop = None
            for b in tqdm(self.batches, desc="transformers decode"):
                if stop:
                    out["decode"].append({"batch": b, "error": stop})
                    continue
                try:
                    out["decode"].append({"batch": b} | hf_decode(hf, b, self.decode_prompts[b], self.opts.gen_len,
                                                                  device))
                except torch.OutOfMemoryError as exc:
                    out["decode"].append({"batch": b, "error": f"out of memory: {exc}"})
                    stop = f"skipped: out of memory at batch {b}"
                free_device_memory()
        if "prefill" in self.opts.modes:
            for chunk in tqdm(sorted(self.opts.chunk_sizes), desc="transformers prefill"):
                try:
                    res = hf_prefill(hf, self.prefill_prompts[1][:chunk], cost, device, self.bandwidth,
                                     self.matmul_flops)
                    out["prefill"].append({"chunk": chunk} | res)
                except torch.OutOfMemoryError as exc:
                    out["prefill"].append({"chunk": chunk, "error": f"out of memory: {exc}"})
                free_device_memory()

    # --- the whole sweep --------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        configs = engine_configs(self.opts, self.log)
        self.report["options"]["configs"] = [c.name for c in configs]
        costs: dict[bool, ModelCost] = {}
        model, model_fp8 = None, False
        for config in tqdm(configs, desc="engine configs"):
            if model is None or model_fp8 != config.fp8:
                model = None
                free_device_memory()
                try:
                    model, model_fp8 = self.build_model(config.fp8), config.fp8
                except Exception as exc:
                    self.report["configs"][config.name] = {"engine_args": config.engine_args(), "decode": [],
                                                           "prefill": [], "error": _error(exc)}
                    self.log(f"{config.name}: the model failed to build:\n{_error(exc)}")
                    continue
            if config.fp8 not in costs:
                costs[config.fp8] = ModelCost(model)
            self.report["configs"][config.name] = self.run_config(model, costs[config.fp8], config)
        model = None
        free_device_memory()
        bf16_cost = costs.get(False) or ModelCost(self.rm.deepinfer_model())
        if self.opts.hf:
            self.transformers(bf16_cost)
        self.finish({False: bf16_cost} | costs)
        if self.device.type == "cuda":
            self.report["environment"]["peak_mem_gb"] = torch.cuda.max_memory_allocated(self.device) / 1e9
        return self.report

    def build_model(self, fp8: bool) -> Any:
        """The deepinfer model on the shared weights, or on an FP8 copy of them; records its op table."""
        from benchmarks.gpu_sweep.libraries import op_labels

        if not fp8:
            model = self.rm.deepinfer_model()
        else:
            from deepinfer_core.quant.fp8 import quantize_params_fp8

            model = self.rm.deepinfer_model(quantize_params_fp8)
        self.report["ops"]["fp8" if fp8 else "default"] = op_labels(model.ops)
        return model

    def finish(self, costs: dict[bool, ModelCost]) -> None:
        """Floors (borrowing routing across configs for graph replays), summaries and transformers ratios."""
        cfgs = self.report["configs"]
        seen: dict[tuple[bool, int], list[list[int] | None]] = {}
        for name, res in cfgs.items():
            for row in res["decode"]:
                unique = [r["unique_experts"] for r in row.get("steps", [])]
                if unique and all(u is not None for u in unique):
                    seen.setdefault((EngineConfig(name).fp8, row["batch"]), unique)
        hf_tok = {r["batch"]: r.get("tok_s") for r in self.report["transformers"]["decode"]}
        hf_pre = {r["chunk"]: r.get("tok_s") for r in self.report["transformers"]["prefill"]}
        for name, res in cfgs.items():
            fp8 = EngineConfig(name).fp8
            cost = costs.get(fp8) or costs[False]
            for row in res["decode"]:
                if "steps" not in row:
                    continue
                b = row["batch"]
                fill_floors(row["steps"], cost, self.bandwidth, self.matmul_flops,
                            seen.get((fp8, b)) or seen.get((not fp8, b)))
                row["summary"] = summarize_decode(row["steps"], b, self.opts.warmup_steps)
                if hf_tok.get(b) and row["summary"].get("tok_s"):
                    row["summary"]["engine_over_transformers"] = row["summary"]["tok_s"] / hf_tok[b]
            for row in res["prefill"]:
                if "steps" not in row:
                    continue
                fill_floors(row["steps"], cost, self.bandwidth, self.matmul_flops)
                row["summary"] = summarize_prefill(row["steps"], self.matmul_flops)
                if hf_pre.get(row["chunk"]):
                    row["summary"]["engine_over_transformers"] = row["summary"]["tok_s"] / hf_pre[row["chunk"]]

    def close(self) -> None:
        self.rm.cleanup()

"""The same workloads through transformers: greedy ``generate`` for decode, one forward for prefill."""

from __future__ import annotations

import statistics
import time
from types import SimpleNamespace
from typing import Any

import torch

from benchmarks.bench_gpu_decode import run_hf, sync
from benchmarks.gpu_sweep.costs import ModelCost, StepShape, floors


def hf_decode(hf_model: Any, batch: int, prompts: list[list[int]], gen_len: int,
              device: torch.device) -> dict[str, Any]:
    """Per-step decode time estimated as (generate(gen_len) - generate(1)) / (gen_len - 1)."""
    res = run_hf(hf_model, SimpleNamespace(gen_len=gen_len), batch, prompts, device)
    step = res["decode_step_ms_est"] / 1e3
    if step <= 0:
        return res | {"error": "generate(gen_len) was not slower than generate(1); raise --gen-len"}
    return res | {"step_ms": step * 1e3, "tok_s": batch / step, "per_user_tok_s": 1 / step}


@torch.no_grad()
def hf_prefill(hf_model: Any, prompt: list[int], cost: ModelCost, device: torch.device, bandwidth: float,
               matmul_flops: float, reps: int = 3) -> dict[str, Any]:
    """One forward over the whole prompt (transformers has no chunking), last-position logits only."""
    ids = torch.tensor([prompt], device=device)

    def forward() -> float:
        sync(device)
        t0 = time.perf_counter()
        hf_model(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=1)
        sync(device)
        return time.perf_counter() - t0

    forward()  # warm-up
    wall = statistics.median(forward() for _ in range(reps))
    shape = StepShape([(0, len(prompt))], 1)
    flops = cost.flops(shape)
    floor = floors(cost.weight_bytes(len(prompt), cost.expected_unique_experts(len(prompt))),
                   cost.kv_bytes(shape), flops, bandwidth, matmul_flops)
    return {"tokens": len(prompt), "time_ms": wall * 1e3, "tok_s": len(prompt) / wall,
            "tflops": flops / wall / 1e12, "matmul_fraction": flops / wall / matmul_flops,
            "floor_ms": floor["floor_s"] * 1e3, "step_over_floor": wall / floor["floor_s"]}

"""Batch-invariant mode on the GPU (``pytest -m gpu backends/nvidia_sm100/tests/gpu/test_gpu_batch_invariance.py``).

* Ops at V4-Flash-like widths (``invariance_cases.FLASH``): every op the mode resolves to a
  batch-invariant implementation, plus the default kernels declared invariant by construction, gives
  for rows of batches of random sizes exactly (``torch.equal``) what it gives for the row alone.
* The engine on a random model at V4-Flash widths (hidden 4096, 64 heads of 512, 4 mHC streams; few
  layers and experts): a request alone and at a random place inside random batches gives identical
  tokens and bit-identical logprobs, with CUDA graphs and eagerly.
* The default mode is only reported (``-rP``): how many single-op rows differ there.
"""

from __future__ import annotations

import random

import pytest
import torch
from gpu_support import BACKEND, gpu_marks
from invariance_cases import FLASH, ROW_ARGS, VARIANTS, base_op, row_differences

from deepinfer_core.entrypoints.llm import LLM
from deepinfer_core.ops.catalogue import CATALOGUE
from deepinfer_core.plugins import build_op_table
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.testing.tiny_model import build_tiny_checkpoint

pytestmark = gpu_marks()

PROVIDER = f"deepinfer.backends:{BACKEND}"
NOT_INVARIANT_BY_DEFAULT = sorted(op for op, spec in CATALOGUE.items() if not spec.batch_invariant)
OPS = sorted({*ROW_ARGS, *VARIANTS})
#: batch sizes: 2 and random ones up to 300 (decode batches and prefill chunks; fixed seed)
SIZES = [2, *sorted(random.Random(7).sample(range(3, 300), 4))]
#: the FP8 / FP4 expert stacks at fewer experts (their weights are made and quantised on the CPU)
FEW_EXPERTS = {**FLASH, "E": 8}
#: a random model at V4-Flash widths, few layers and experts
FLASH_MODEL = dict(hidden_size=4096, num_attention_heads=64, head_dim=512, q_lora_rank=1024, o_groups=8,
                   o_lora_rank=1024, n_routed_experts=16, num_experts_per_tok=6, moe_intermediate_size=512,
                   index_n_heads=64, index_head_dim=128, index_topk=64, sliding_window=128, hc_mult=4,
                   partial_rotary_factor=0.125, vocab_size=4096)


def _widths(op: str) -> dict:
    return FEW_EXPERTS if op in ("moe_experts_fp8", "moe_experts_fp4") else FLASH


@pytest.fixture(scope="module")
def tables():
    return {dtype: build_op_table(BACKEND, dtype=dtype, device=torch.device("cuda"), batch_invariant=True)
            for dtype in (torch.bfloat16, torch.float32)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("op", OPS)
def test_op_row_equals_the_row_alone(op, dtype, tables):
    table = tables[dtype]
    impl = table.chosen[base_op(op)]
    assert impl.provider == PROVIDER and (impl.batch_invariant or CATALOGUE[base_op(op)].batch_invariant), op
    bad = row_differences(op, getattr(table, base_op(op)), dtype, SIZES, widths=_widths(op), device="cuda",
                          rows_checked=6)
    assert not bad, f"{op}: (batch size, row) differing from alone: {bad[:8]}"


def test_every_op_the_mode_needs_is_declared(tables):
    for op in NOT_INVARIANT_BY_DEFAULT:
        impl = tables[torch.bfloat16].chosen[op]
        assert impl.provider == PROVIDER and impl.batch_invariant, op


def test_report_default_mode_row_differences(record_property):
    """Why the mode exists on the GPU: the same comparison with the default table (reported only)."""
    table = build_op_table(BACKEND, dtype=torch.bfloat16, device=torch.device("cuda"))
    lines = []
    for op in sorted(set(NOT_INVARIANT_BY_DEFAULT) & set(ROW_ARGS)):
        bad = row_differences(op, getattr(table, op), torch.bfloat16, SIZES, widths=_widths(op), device="cuda",
                              rows_checked=6)
        lines.append(f"{op:18s} default ({table.provider(op)}): {len(bad)} of {6 * len(SIZES)} rows differ")
    print("\n".join(lines))
    record_property("default_mode_row_differences", lines)


# --- the engine ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def flash_path(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("flash_widths"), "tiny", with_mtp=False, **FLASH_MODEL)


def _random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(2, FLASH_MODEL["vocab_size"]) for _ in range(length)]


def _other_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(temperature=rng.choice([0.0, 0.7, 1.2]), top_k=rng.choice([0, 5, 50]),
                          top_p=rng.choice([1.0, 0.9]), seed=rng.choice([None, rng.randrange(10**6)]),
                          max_tokens=rng.randint(1, 24), ignore_eos=True, logprobs=rng.choice([None, 3]))


def _same_logprobs(a: list[dict], b: list[dict]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        keys = sorted(x)
        if x.keys() != y.keys() or not torch.equal(torch.tensor([x[t] for t in keys], dtype=torch.float64),
                                                   torch.tensor([y[t] for t in keys], dtype=torch.float64)):
            return False
    return True


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_request_alone_equals_it_inside_random_batches(flash_path, enforce_eager):
    rng = random.Random(11 + enforce_eager)
    kw = dict(backend=BACKEND, dtype="bfloat16", batch_invariant=True, block_size=128, max_model_len=1024,
              max_num_batched_tokens=256, kv_cache_bytes=1 << 30, enforce_eager=enforce_eager)
    alone_llm = LLM(str(flash_path), **kw)
    batch_llm = LLM(str(flash_path), **kw)
    ops = batch_llm.llm_engine.model.ops
    assert all(ops.chosen[op].batch_invariant for op in NOT_INVARIANT_BY_DEFAULT)
    for k in range(3):
        target = _random_prompt(rng, rng.randint(150, 400))  # longer than the budget: chunked prefill
        params = SamplingParams(temperature=0.7, seed=100 + k, max_tokens=16, ignore_eos=True, logprobs=5)
        alone = alone_llm.generate([{"prompt_token_ids": target}], params, use_tqdm=False)[0].outputs[0]
        others = [_random_prompt(rng, rng.randint(1, 300)) for _ in range(rng.randint(2, 48))]
        other_params = [_other_params(rng) for _ in others]
        pos = rng.randint(0, len(others))
        outs = batch_llm.generate([{"prompt_token_ids": p} for p in others[:pos] + [target] + others[pos:]],
                                  other_params[:pos] + [params] + other_params[pos:], use_tqdm=False)
        assert all(o.error is None for o in outs)
        inside = outs[pos].outputs[0]
        where = f"batch of {len(outs)}, position {pos}"
        assert inside.token_ids == alone.token_ids, where
        assert _same_logprobs(alone.logprobs, inside.logprobs), where

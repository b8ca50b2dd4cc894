"""Run as a script by ``test_nvidia_batch_invariance.py`` in a fresh process with the nvidia backend on the
CPU under Triton's interpreter (the switches must be set before triton is first imported).

``ops SIZES``: per op and dtype, the batch-invariant table's conformance to cpu_ref and the rows that
differ inside batches of the given sizes from alone. ``engine SEED PROMPTS``: the tiny engine's requests
alone and inside random batches. Prints one ``RESULTS <json>`` line.
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))  # invariance_cases

import invariance_cases as cases  # noqa: E402
from deepinfer_nvidia_sm100 import invariant_ops  # noqa: E402

from deepinfer_core.entrypoints.llm import LLM  # noqa: E402
from deepinfer_core.plugins import build_op_table  # noqa: E402
from deepinfer_core.sampling.params import SamplingParams  # noqa: E402
from deepinfer_core.testing import conformance as conf  # noqa: E402
from deepinfer_core.testing.tiny_model import build_tiny_checkpoint  # noqa: E402

BACKEND = "nvidia_sm100"


def check_ops(sizes: list[int]) -> dict:
    reference = conf.reference_op_table()
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        table = build_op_table(BACKEND, dtype=dtype, device=torch.device("cpu"), batch_invariant=True)
        for name in sorted({*cases.ROW_ARGS, *cases.VARIANTS, *invariant_ops.ALL_OPS}):
            key, op = f"{name}/{str(dtype).removeprefix('torch.')}", cases.base_op(name)
            try:
                results = conf.check_op(op, table, reference, "tiny", dtype, backend=BACKEND)
                bad = [str(r) for r in results if not r.passed or r.fallback]
                rows = cases.row_differences(name, getattr(table, op), dtype, sizes) if op in cases.ROW_ARGS else []
                impl = table.chosen[op]
                out[key] = {"conform": bool(results) and not bad, "message": "\n\n".join(bad)[:4000],
                            "rows": rows, "declared": impl.batch_invariant, "provider": impl.provider}
            except Exception:
                out[key] = {"conform": False, "message": traceback.format_exc(), "rows": [], "declared": False,
                            "provider": ""}
    return out


def check_build() -> dict:
    """The tiny engine in batch-invariant mode: which implementation serves each op."""
    path = build_tiny_checkpoint(Path(tempfile.mkdtemp()), "tiny")
    llm = LLM(str(path), backend=BACKEND, dtype="float32", batch_invariant=True, block_size=16)
    chosen = llm.llm_engine.model.ops.chosen
    return {op: {"provider": impl.provider, "declared": impl.batch_invariant,
                 "invariant_ops": impl.fn is invariant_ops.ALL_OPS.get(op)} for op, impl in chosen.items()}


def _params(rng: random.Random) -> SamplingParams:
    return SamplingParams(temperature=rng.choice([0.0, 0.7, 1.2]), top_k=rng.choice([0, 5]),
                          seed=rng.choice([None, rng.randrange(10**6)]), max_tokens=rng.randint(1, 8),
                          ignore_eos=True, logprobs=rng.choice([None, 3]))


def check_engine(seed: int, prompts: int) -> dict:
    """Each target alone, then at a random place in a batch of 2..12 random requests: its tokens and
    the float64 values of its logprobs, both ways."""
    rng = random.Random(seed)
    path = build_tiny_checkpoint(Path(tempfile.mkdtemp()), "tiny")
    kw = dict(backend=BACKEND, dtype="float32", batch_invariant=True, block_size=16, max_num_batched_tokens=32)
    alone_llm, batch_llm = LLM(str(path), **kw), LLM(str(path), **kw)
    ops = batch_llm.llm_engine.model.ops
    out = {"providers": sorted({ops.provider(op) for op in ops.chosen}), "runs": []}
    for k in range(prompts):
        target = [rng.randrange(2, 384) for _ in range(rng.randint(20, 50))]
        params = SamplingParams(temperature=0.7, seed=1000 + k, max_tokens=6, ignore_eos=True, logprobs=5)
        alone = alone_llm.generate([{"prompt_token_ids": target}], params, use_tqdm=False)[0].outputs[0]
        others = [[rng.randrange(2, 384) for _ in range(rng.randint(1, 40))] for _ in range(rng.randint(2, 12))]
        other_params = [_params(rng) for _ in others]
        pos = rng.randint(0, len(others))
        batch = others[:pos] + [target] + others[pos:]
        outs = batch_llm.generate([{"prompt_token_ids": p} for p in batch],
                                  other_params[:pos] + [params] + other_params[pos:], use_tqdm=False)
        inside = outs[pos].outputs[0]
        same = alone.token_ids == inside.token_ids and len(alone.logprobs) == len(inside.logprobs) and all(
            a.keys() == b.keys() and torch.equal(torch.tensor([a[t] for t in sorted(a)], dtype=torch.float64),
                                                 torch.tensor([b[t] for t in sorted(a)], dtype=torch.float64))
            for a, b in zip(alone.logprobs, inside.logprobs))
        out["runs"].append({"batch": len(batch), "position": pos, "same": same, "steps": len(alone.logprobs)})
    return out


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    if argv[0] == "ops":
        result = {"ops": check_ops([int(s) for s in argv[1].split(",")]), "build": check_build()}
    else:
        result = check_engine(int(argv[1]), int(argv[2]))
    print("RESULTS " + json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])

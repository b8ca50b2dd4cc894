"""One rank of a torchrun-launched expert-parallel engine (run by tests/parallel/test_torchrun.py):
``python -m torch.distributed.run --standalone --nproc-per-node N tests/torchrun_rank.py MODEL OUT``.

Rank ``r`` generates prompts ``r, r + N, ...`` (unequal work: a rank idles while the others finish) and
writes its tokens and logprobs to ``OUT/rank{r}.json``."""

from __future__ import annotations

import json
import os
import sys

import torch

from deepinfer_core.entrypoints.llm import LLM
from deepinfer_core.sampling.params import SamplingParams

LENGTHS = [5, 40, 12, 70, 3, 21]
MAX_TOKENS = [12, 4, 9, 6, 15, 3]


def prompts() -> list[list[int]]:
    return [torch.randint(2, 384, (n,), generator=torch.Generator().manual_seed(1000 + i)).tolist()
            for i, n in enumerate(LENGTHS)]


def params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=1) for m in MAX_TOKENS]


def main(model: str, out: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    llm = LLM(model=model, dtype="float64", block_size=16, max_num_batched_tokens=32, data_parallel_size=world,
              enable_expert_parallel=True, distributed_executor_backend="external_launcher",
              distributed_timeout_s=120, enable_eplb=True,
              eplb_config={"num_redundant_experts": 2, "step_interval": 5})
    engine = llm.llm_engine
    mine = list(range(rank, len(LENGTHS), world))
    outs = llm.generate([prompts()[i] for i in mine], [params()[i] for i in mine], use_tqdm=False)
    engine.shutdown()  # meets the other rank's steps until it is done too
    counters = engine.rank_counters()
    result = {"rank": rank, "requests": mine, "tokens": [o.outputs[0].token_ids for o in outs],
              "logprobs": [[lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs],
              "local_experts": list(engine.executor.driver_worker.ep_dispatcher.local_experts),
              "counters": counters, "eplb_steps": engine.eplb_stats()["steps"]}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

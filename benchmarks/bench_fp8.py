"""Block-FP8 weights: accuracy against bf16 on the embedded tiny checkpoint (nvidia_sm100 in bfloat16 on a
GPU, cpu_ref in float32 elsewhere).

Through ``LLM``, greedy: free-running token agreement per prompt, and, teacher-forced on the bf16 model's
own tokens, the per-step logit cosine and top-1 agreement. The FP8 kernels' times are the nvidia
backend's benchmark ``backends/nvidia_sm100/benchmarks/bench_fp8_kernels.py``.

    python benchmarks/bench_fp8.py --out fp8.json
"""

from __future__ import annotations

import argparse
import json

import torch

from deepinfer_core.entrypoints.llm import LLM
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.testing.model_runner import SimpleRunner

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import os, sys", "for i in range(10):", "class Node:",
           'print("hello', "DeepSeek-V4 compresses", "    if i % 2 == 0:", "sliding windows keep",
           "    def walk(self):", "The lazy dog", "a, b = b, a + b"]


def _logits(model, ids: list[int]) -> torch.Tensor:
    return SimpleRunner(model, 1, len(ids), block_size=128).step({0: ids}, all_logits=True)[0].double()


def accuracy(backend: str, dtype: str, max_tokens: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    base = LLM(backend=backend, dtype=dtype, max_num_seqs=len(PROMPTS))
    want = base.generate(PROMPTS, params, use_tqdm=False)
    fp8 = LLM(backend=backend, dtype=dtype, max_num_seqs=len(PROMPTS), quantization="fp8")
    got = fp8.generate(PROMPTS, params, use_tqdm=False)
    per_prompt, cos, top1 = [], [], []
    for a, b in zip(want, got):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        first = next((i for i, (u, v) in enumerate(zip(ta, tb)) if u != v), len(ta))
        ids = list(a.prompt_token_ids) + list(ta)
        n = len(a.prompt_token_ids)
        la = _logits(base.llm_engine.model, ids)[n - 1 : -1]
        lb = _logits(fp8.llm_engine.model, ids)[n - 1 : -1]
        c = torch.nn.functional.cosine_similarity(la, lb, dim=-1)
        t = (la.argmax(-1) == lb.argmax(-1)).double()
        cos.append(c)
        top1.append(t)
        per_prompt.append({"prompt": a.prompt, "first_divergence": first,
                           "free_running_agreement": sum(u == v for u, v in zip(ta, tb)) / len(ta),
                           "cosine_mean": c.mean().item(), "top1_agreement": t.mean().item()})
    cos, top1 = torch.cat(cos), torch.cat(top1)
    return {"backend": backend, "dtype": dtype, "max_tokens": max_tokens, "prompts": per_prompt,
            "cosine_mean": cos.mean().item(), "cosine_min": cos.min().item(),
            "top1_agreement": top1.mean().item(),
            "identical_completions": sum(p["first_divergence"] == max_tokens for p in per_prompt)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    result: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__}
    backend, dtype = ("nvidia_sm100", "bfloat16") if cuda else ("cpu_ref", "float32")
    acc = accuracy(backend, dtype, args.max_tokens)
    result["accuracy"] = acc
    print(f"accuracy ({backend}, {dtype}, {len(PROMPTS)} prompts x {args.max_tokens} tokens): "
          f"logit cosine mean {acc['cosine_mean']:.5f} min {acc['cosine_min']:.5f}, teacher-forced top-1 "
          f"agreement {acc['top1_agreement']:.4f}, identical completions "
          f"{acc['identical_completions']}/{len(PROMPTS)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

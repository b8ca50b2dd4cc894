"""Offline batched inference: build an engine, generate for a few prompts, print the results.

    python examples/offline_inference.py                 # the embedded tiny model on cpu_ref, DSpark drafting
    python examples/offline_inference.py --model DIR     # a DeepSeek-V4 or V4.1 checkpoint folder

With no ``--model`` the engine uses the embedded default checkpoint: a 3.8M-parameter DeepSeek-V4.1
(every V4.1 feature on, Engram included) trained on the Python standard library's source, shipped in the
package (nothing is downloaded), and drafts with its DSpark stages: blocks of 3 tokens proposed at once and
verified losslessly. Its output looks like Python, and every part of the engine (scheduler, paged caches,
backend ops, drafter, rejection sampler, detokenizer) runs for real.
"""

import argparse

from deepinfer_core import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the embedded tiny model)")
    parser.add_argument("--backend", default="cpu_ref", help="backend name (default: cpu_ref)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--dspark", type=int, default=None, metavar="K",
                        help="draft K tokens a step with a V4.1 checkpoint's DSpark stages (default: 3 for the "
                        "embedded model, off for --model; 0: off)")
    args = parser.parse_args()
    k = args.dspark if args.dspark is not None else (3 if args.model is None else 0)
    spec = {"method": "dspark", "num_speculative_tokens": k} if k else None

    prompts = [
        "def fibonacci(n):",
        "The quick brown fox",
        "DeepSeek-V4 compresses its attention cache:",
        'print("hello',
    ]
    # vLLM's defaults and meanings; a fixed seed makes the sampled output reproducible
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=args.max_tokens, seed=0)

    llm = LLM(model=args.model, backend=args.backend, speculative_config=spec)
    outputs = llm.generate(prompts, sampling_params)

    for output in outputs:
        completion = output.outputs[0]
        print(f"Prompt: {output.prompt!r}")
        print(f"Generated text: {completion.text!r}  ({len(completion.token_ids)} tokens, "
              f"finish_reason={completion.finish_reason})")
        print("-" * 60)
    if spec:
        stats = llm.llm_engine.spec_decode_stats()
        print(f"DSpark: {stats['mean_acceptance_length']:.2f} tokens per verification step, accepted per "
              f"position {stats['accepted_per_position']} of {stats['verified_per_position']}")


if __name__ == "__main__":
    main()

"""A tour of SamplingParams: greedy, temperature/top-p/seed, top-k, min-p, penalties, stop strings,
several completions per prompt (n > 1) and logprobs.

    python examples/sampling_options.py [--model DIR] [--backend NAME]

Uses the embedded tiny random model by default, so the texts are gibberish; what to look at is how
each option changes the output (reproducibility, lengths, finish reasons, logprobs).
"""

import argparse

from deepinfer_core import LLM, SamplingParams


def show(title: str, outputs, tokenizer=None) -> None:
    print(f"== {title}")
    for out in outputs:
        print(f"  prompt {out.prompt!r}")
        for c in out.outputs:
            line = f"    [{c.index}] {c.text!r}  finish_reason={c.finish_reason}"
            if c.stop_reason is not None:
                line += f" stop_reason={c.stop_reason!r}"
            if c.cumulative_logprob is not None:
                line += f" cumulative_logprob={c.cumulative_logprob:.3f}"
            print(line)
            for tok, step in zip(c.token_ids, c.logprobs or []):
                piece = tokenizer.decode([tok]) if tokenizer is not None else ""
                top = ", ".join(f"{t}:{lp:.2f}" for t, lp in sorted(step.items(), key=lambda kv: -kv[1]))
                print(f"        token {tok:>4} {piece!r:<10} logprob {step[tok]:.3f}   candidates {top}")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the embedded tiny model)")
    parser.add_argument("--backend", default="cpu_ref", help="backend name (default: cpu_ref)")
    args = parser.parse_args()

    llm = LLM(model=args.model, backend=args.backend)
    tok = llm.get_tokenizer()
    prompt = "def fibonacci(n):"

    def run(title: str, params: SamplingParams, prompts=(prompt,)) -> list:
        outputs = llm.generate(list(prompts), params, use_tqdm=False)
        show(title, outputs, tok if params.logprobs is not None else None)
        return outputs

    # greedy: temperature 0 always picks the likeliest token, so two runs agree
    a = run("greedy (temperature=0)", SamplingParams(temperature=0.0, max_tokens=12))
    b = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    print(f"   greedy is deterministic: {a[0].outputs[0].token_ids == b[0].outputs[0].token_ids}\n")

    # sampling: temperature reshapes the distribution, top_p keeps the smallest set with 95% of the mass;
    # a per-request seed makes the sample reproducible
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=12)
    a = run("temperature=0.8, top_p=0.95, seed=1234", params)
    b = llm.generate([prompt], params, use_tqdm=False)
    print(f"   same seed, same sample: {a[0].outputs[0].token_ids == b[0].outputs[0].token_ids}\n")

    # top_k keeps the k likeliest tokens; min_p drops tokens below min_p x the top token's probability
    run("top_k=5", SamplingParams(temperature=1.0, top_k=5, seed=7, max_tokens=12))
    run("min_p=0.1", SamplingParams(temperature=1.0, min_p=0.1, seed=7, max_tokens=12))

    # penalties discourage tokens already in the prompt/output (vLLM's semantics); compared with plain
    # greedy decoding over 20 tokens, the penalised run avoids the token that greedy repeats
    plain = run("greedy, 20 tokens", SamplingParams(temperature=0.0, max_tokens=20))[0].outputs[0].token_ids
    penalised = run("greedy + repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5",
                    SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5,
                                   frequency_penalty=0.5, max_tokens=20))[0].outputs[0].token_ids
    where = next((i for i, (x, y) in enumerate(zip(plain, penalised)) if x != y), None)
    print(f"   greedy repeats tokens: {len(set(plain)) < len(plain)}; "
          f"penalised run first differs at position {where}\n")

    # stop strings end the output where they first appear (the stop string itself is not returned);
    # here we stop at a letter of the greedy continuation, so the stop is sure to trigger
    greedy = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    text = greedy[0].outputs[0].text
    stop = next((ch for ch in text[2:] if ch.isascii() and ch.isalpha()), None)
    run(f"stop=[{stop!r}]", SamplingParams(temperature=0.0, max_tokens=12, stop=[stop] if stop else None))

    # stop_token_ids / ignore_eos / min_tokens control token-level stopping
    run("ignore_eos=True, max_tokens=6", SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=6))

    # n > 1: several independent completions of one prompt
    run("n=3, temperature=1.0, seed=0", SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=8))

    # logprobs=N: the sampled token's log-probability plus the N likeliest candidates at each step
    run("logprobs=3", SamplingParams(temperature=0.0, logprobs=3, max_tokens=4))

    # invalid values are rejected when SamplingParams is built
    try:
        SamplingParams(temperature=-1.0)
    except ValueError as exc:
        print(f"== invalid parameters raise ValueError:\n  {exc}")


if __name__ == "__main__":
    main()

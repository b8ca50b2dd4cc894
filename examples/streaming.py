"""Streaming: ``LLM.stream()`` yields the growing output of one request after every engine step.

    python examples/streaming.py [--model DIR] [--backend NAME] [PROMPT]

Each yielded RequestOutput holds the whole text so far, so printing the new suffix each time shows the
generation token by token.
"""

import argparse
import sys

from deepinfer_core import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt", nargs="?", default="The quick brown fox")
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the embedded tiny model)")
    parser.add_argument("--backend", default="cpu_ref", help="backend name (default: cpu_ref)")
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()

    llm = LLM(model=args.model, backend=args.backend)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=0, max_tokens=args.max_tokens)

    print(f"Prompt: {args.prompt!r}")
    print("Streamed: ", end="", flush=True)
    shown = ""
    final = None
    for output in llm.stream(args.prompt, params):
        text = output.outputs[0].text
        # the text is re-decoded each step, so print only what was appended (repr keeps odd bytes visible)
        new = text[len(shown):] if text.startswith(shown) else text
        shown = text
        sys.stdout.write(repr(new)[1:-1])
        sys.stdout.flush()
        final = output
    print()
    if final is not None:
        c = final.outputs[0]
        print(f"Done: {len(c.token_ids)} tokens, finish_reason={c.finish_reason}")
        print(f"Full text: {c.text!r}")


if __name__ == "__main__":
    main()

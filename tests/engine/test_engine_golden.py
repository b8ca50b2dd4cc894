"""Golden engine runs: greedy float64 generation equals transformers' full-forward argmax at every step.

For each tiny config the same 16 prompts (1..70 tokens: shorter and longer than the sliding window,
across compression-rate and block boundaries) are generated in batches of 1, 4 and 16, with chunked
prefill off, on with the default budget and on with budgets of 8 and 13 tokens (chunks that end
mid-window, mid-compression-window and mid-block), and with pools so small that sequences are
preempted and recomputed. Every run's tokens are checked against ``DeepseekV4ForCausalLM`` fed the
prompt plus the generated tokens once (argmax of positions len(prompt)-1 .. end-1); the checks are
cached per (prompt, tokens), so a run that agrees with an earlier one costs no extra forward.

Every variant runs on "tiny" by default; "tiny_hc4" and "tiny_hc1" run the 16-request batch and a
few variants by default and the rest under ``-m slow``.
"""

from __future__ import annotations

import engine_fixtures
import pytest
from engine_fixtures import greedy, hf_argmax, make_prompt, run_tokens

# the shared fixtures, bound here so that pytest finds them in this module
make_llm = engine_fixtures.make_llm
one_torch_thread = engine_fixtures.one_torch_thread
tiny_path = engine_fixtures.tiny_path

CONFIGS = ["tiny", "tiny_hc4", "tiny_hc1"]
LENGTHS = [1, 2, 4, 7, 8, 9, 12, 16, 17, 24, 31, 33, 40, 48, 64, 70]
MAX_TOKENS = 10
_CHECKED: set[tuple[str, tuple[int, ...], tuple[int, ...]]] = set()


def prompts_of(lengths: list[int]) -> list[list[int]]:
    return [make_prompt(n, seed=i) for i, n in enumerate(lengths)]


PROMPTS = prompts_of(LENGTHS)


def assert_hf_greedy(path, prompts: list[list[int]], outputs: list[list[int]]) -> None:
    for prompt, tokens in zip(prompts, outputs):
        assert len(tokens) == MAX_TOKENS
        key = (str(path), tuple(prompt), tuple(tokens))
        if key in _CHECKED:
            continue
        expected = hf_argmax(path, prompt, tokens)
        first_bad = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), None)
        assert first_bad is None, (
            f"prompt of {len(prompt)} tokens: step {first_bad} generated {tokens[first_bad]}, "
            f"transformers' argmax is {expected[first_bad]} (engine {tokens}, transformers {expected})"
        )
        _CHECKED.add(key)


def cases(variants: dict[str, object], fast: dict[str, set[str]]) -> list:
    """(config, variant) pairs; those not in ``fast[config]`` are marked slow (run with -m slow)."""
    return [
        pytest.param(config, value, id=f"{config}-{name}",
                     marks=() if name in fast.get(config, set()) else pytest.mark.slow)
        for config in CONFIGS
        for name, value in variants.items()
    ]


@pytest.mark.parametrize("config", CONFIGS)
def test_batch_of_16_default(config, tiny_path, make_llm):
    path = tiny_path(config)
    llm = make_llm(path, dtype="float64")
    outs = run_tokens(llm, PROMPTS, greedy(MAX_TOKENS))
    assert_hf_greedy(path, PROMPTS, outs)


SMALL_BATCHES = {"1": [1], "9": [9], "70": [70], "4a": [1, 16, 33, 70], "4b": [8, 17, 24, 64]}


@pytest.mark.parametrize("config, lengths", cases(SMALL_BATCHES, {
    "tiny": {"1", "70", "4a", "4b"}, "tiny_hc4": {"4a"}, "tiny_hc1": {"4b"}}))
def test_small_batches(config, lengths, tiny_path, make_llm):
    path = tiny_path(config)
    prompts = [PROMPTS[LENGTHS.index(n)] for n in lengths]
    llm = make_llm(path, dtype="float64")
    assert_hf_greedy(path, prompts, run_tokens(llm, prompts, greedy(MAX_TOKENS)))


CHUNKING = {
    "unchunked": dict(enable_chunked_prefill=False),
    "chunk13": dict(enable_chunked_prefill=True, max_num_batched_tokens=13),
    "chunk8-3seqs": dict(enable_chunked_prefill=True, max_num_batched_tokens=8, max_num_seqs=3),
}


@pytest.mark.parametrize("config, engine_args", cases(CHUNKING, {
    "tiny": set(CHUNKING), "tiny_hc4": {"chunk13"}, "tiny_hc1": {"unchunked", "chunk13"}}))
def test_chunked_prefill(config, engine_args, tiny_path, make_llm):
    path = tiny_path(config)
    llm = make_llm(path, dtype="float64", **engine_args)
    outs = run_tokens(llm, PROMPTS, greedy(MAX_TOKENS))
    assert_hf_greedy(path, PROMPTS, outs)
    engine = llm.llm_engine
    if engine_args.get("max_num_batched_tokens"):
        # chunks really were cut: at least as many steps as the prompt tokens need
        assert engine.num_steps >= sum(LENGTHS) // engine_args["max_num_batched_tokens"]


PREEMPTION = {
    # 80 tokens per sequence = 5 blocks of 16: 10 compressed blocks hold two of the longest
    "blocks10": dict(num_blocks=10, num_window_blocks=8),
    # a window pool of 3 blocks: a 70-token prompt must be prefilled in chunks that fit it, even
    # with a token budget that would take it whole
    "window3": dict(num_window_blocks=3),
    "blocks9-window3-chunk13": dict(num_blocks=9, num_window_blocks=3, max_num_batched_tokens=13),
    "blocks7-unchunked-5seqs": dict(num_blocks=7, num_window_blocks=6, enable_chunked_prefill=False,
                                    max_num_seqs=5),
}


@pytest.mark.parametrize("config, engine_args", cases(PREEMPTION, {
    "tiny": set(PREEMPTION), "tiny_hc4": {"blocks10"}, "tiny_hc1": {"blocks9-window3-chunk13"}}))
def test_preemption(config, engine_args, tiny_path, make_llm):
    """Preempted sequences are recomputed and continue with exactly the tokens of an unpreempted run."""
    path = tiny_path(config)
    llm = make_llm(path, dtype="float64", **engine_args)
    outs = run_tokens(llm, PROMPTS, greedy(MAX_TOKENS))
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert_hf_greedy(path, PROMPTS, outs)

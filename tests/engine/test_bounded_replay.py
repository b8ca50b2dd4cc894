"""Bounded replay in the engine (float64, cpu_ref): generation under prefix caching, preemption, chunked
prefill, async scheduling and speculative decoding equals the same generation without them; ``mask``
equals ``compact`` (with structured output too); prompts no longer than the keep equal the full prefill,
longer ones differ from it (the approximation: not bit-identical, as vLLM's and TRT-LLM's are not); models
that cannot be cut are refused, or left on the full prefill by default.

The tiny V4.1 here has its Engram layers at 1 and 3, before its last KV source (4), as the release does
(1 and 14, before 20): window 8, so the keep is 8 plus the longest backtracking.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.model.errors import UnsupportedModelError
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.testing.tiny_v41 import build_tiny_v41
from tests.engine_fixtures import greedy, make_llm, make_prompt, one_torch_thread, tiny_path  # noqa: F401

WINDOW = 8
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=6, ignore_eos=True, seed=11, logprobs=2)
PROMPTS = [make_prompt(n, seed=n, vocab_size=3900) for n in (5, 8, 9, 23, 40, 57)]


@pytest.fixture(scope="module")
def late(tmp_path_factory):
    """The tiny V4.1 whose layers after the last KV source carry no Engram."""
    return build_tiny_v41(tmp_path_factory.mktemp("replay") / "v41", seed=0, engram_layer_ids=[1, 3])


def generate(llm, prompts, params, one_by_one: bool = False):
    if one_by_one:
        outs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in prompts]
    else:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert all(o.error is None for o in outs)
    return outs


def assert_same(a, b, tol: float = 1e-9):
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for lx, ly in zip(x.outputs[0].logprobs or [], y.outputs[0].logprobs or []):
            assert lx.keys() == ly.keys()
            assert all(abs(lx[t] - ly[t]) <= tol for t in lx), (lx, ly)


def test_the_default_is_compact_with_the_window_and_the_drafters_as_keep(late, make_llm):  # noqa: F811
    """The checkpoint has DSpark stages: the keep counts their capture window, drafting or not."""
    llm = make_llm(late, dtype="float64")
    assert llm.llm_engine.model.bounded_replay == "compact"
    assert llm.llm_engine.scheduler_config.replay_keep == 2 * WINDOW


def test_mask_equals_compact(late, make_llm):  # noqa: F811
    compact = make_llm(late, dtype="float64", bounded_replay="compact", max_num_batched_tokens=12)
    mask = make_llm(late, dtype="float64", bounded_replay="mask", max_num_batched_tokens=12)
    for params in (greedy(6, logprobs=3), SAMPLED):
        assert_same(generate(compact, PROMPTS, params), generate(mask, PROMPTS, params))


def test_chunked_prefill_equals_whole_prompts(late, make_llm):  # noqa: F811
    whole = make_llm(late, dtype="float64", max_num_batched_tokens=512)
    chunked = make_llm(late, dtype="float64", max_num_batched_tokens=7)
    for params in (greedy(6, logprobs=2), SAMPLED):
        assert_same(generate(whole, PROMPTS, params), generate(chunked, PROMPTS, params))


def test_prefix_caching_on_equals_off(late, make_llm):  # noqa: F811
    """Prompts sharing prefixes of every length: a hit restores global KV and the early layers' window, never
    past the floor, and the tail is recomputed."""
    base = make_prompt(70, 3, vocab_size=3900)
    family = [base[:n] + make_prompt(k, 50 + n, vocab_size=3900) for n, k in
              ((9, 2), (16, 0), (17, 5), (31, 1), (32, 3), (48, 0), (63, 4), (70, 0))]
    off = make_llm(late, dtype="float64", enable_prefix_caching=False, max_num_batched_tokens=40)
    on = make_llm(late, dtype="float64", enable_prefix_caching=True, max_num_batched_tokens=40)
    for params in (greedy(5, logprobs=2), SAMPLED):
        assert_same(generate(off, family, params, one_by_one=True), generate(on, family, params, one_by_one=True))
    stats = on.llm_engine.prefix_cache_stats()
    assert stats["hit_tokens"] > 0
    again = generate(on, [base], greedy(3), one_by_one=True)[0]
    assert again.num_cached_tokens == (len(base) - WINDOW) // 16 * 16  # the hit stops at the floor


def test_preemption_equals_none(late, make_llm):  # noqa: F811
    """A preempted sequence keeps its floor: its recompute runs the late layers over the same positions."""
    roomy = make_llm(late, dtype="float64", max_num_batched_tokens=24)
    tight = make_llm(late, dtype="float64", max_num_batched_tokens=24, num_blocks=7, num_window_blocks=8,
                     enable_prefix_caching=False)
    params = greedy(24, logprobs=2)
    assert_same(generate(roomy, PROMPTS[2:], params), generate(tight, PROMPTS[2:], params))
    assert tight.llm_engine.scheduler.num_preemptions > 0


def test_async_scheduling_equals_sync(late, make_llm):  # noqa: F811
    sync = make_llm(late, dtype="float64", max_num_batched_tokens=16)
    overlapped = make_llm(late, dtype="float64", max_num_batched_tokens=16, async_scheduling=True)
    assert_same(generate(sync, PROMPTS, greedy(6, logprobs=2)), generate(overlapped, PROMPTS, greedy(6, logprobs=2)))


def test_speculative_decoding_is_lossless_under_bounded_replay(late, make_llm):  # noqa: F811
    """The keep is the window plus DSpark's capture window (8 + 8) with speculation on or off: the output and
    the logprobs equal plain decoding's, which are not the full prefill's."""
    spec = make_llm(late, dtype="float64", max_num_batched_tokens=24,
                    speculative_config={"method": "dspark", "num_speculative_tokens": 2})
    plain = make_llm(late, dtype="float64", max_num_batched_tokens=24)
    assert spec.llm_engine.scheduler_config.replay_keep == plain.llm_engine.scheduler_config.replay_keep == 2 * WINDOW
    full = make_llm(late, dtype="float64", max_num_batched_tokens=24, bounded_replay=False)
    params = greedy(8, logprobs=3)
    drafted, reference = generate(spec, PROMPTS, params), generate(plain, PROMPTS, params)
    assert_same(drafted, reference)
    first = [o.outputs[0].logprobs[0] for o in generate(full, PROMPTS, params)]
    moved = [max(abs(a[t] - b.outputs[0].logprobs[0][t]) for t in a.keys() & b.outputs[0].logprobs[0].keys())
             for a, b, p in zip(first, reference, PROMPTS) if len(p) > 2 * WINDOW]
    assert moved and min(moved) > 1e-9, moved  # the cut applies on the drafting engine's prefill too


def test_difference_to_the_full_prefill(late, make_llm):  # noqa: F811
    """Prompts within the keep are the full prefill exactly; longer ones are not (on this random model the
    first token's logprobs move by up to ~0.1 nats; the benchmark reports greedy agreement)."""
    full = make_llm(late, dtype="float64", bounded_replay=False)
    cut = make_llm(late, dtype="float64", bounded_replay="compact")
    params = greedy(4, logprobs=5)
    keep = cut.llm_engine.scheduler_config.replay_keep  # the window and the DSpark stages' capture window
    short = [p for p in PROMPTS if len(p) <= keep]
    assert_same(generate(full, short, params), generate(cut, short, params), tol=1e-12)
    long = [p for p in PROMPTS if len(p) > keep]
    diffs = []
    for a, b in zip(generate(full, long, params), generate(cut, long, params)):
        first_a, first_b = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        diffs.append(max(abs(first_a[t] - first_b[t]) for t in first_a.keys() & first_b.keys()))
    assert min(diffs) > 1e-9, diffs


def test_models_that_cannot_be_cut(tiny_path, make_llm):  # noqa: F811
    """V4 has no bounded replay: asked for, a clear error; the default tiny V4.1 carries Engram at layer 5,
    after its last KV source: asked for, refused saying so; by default its prefill stays full."""
    with pytest.raises(ValueError, match="bounded_replay=False"):
        make_llm(tiny_path("tiny"), bounded_replay="mask")
    with pytest.raises(UnsupportedModelError, match=r"layers \[5\] carry Engram"):
        make_llm(tiny_path("v41"), bounded_replay="compact")
    with pytest.raises(ValueError, match="one of"):
        make_llm(tiny_path("v41"), bounded_replay="sometimes")
    default = make_llm(tiny_path("v41"), dtype="float64")
    assert default.llm_engine.scheduler_config.replay_keep == 0
    assert default.llm_engine.model.bounded_replay is None
    v4 = make_llm(tiny_path("tiny"), dtype="float64")
    assert v4.llm_engine.scheduler_config.replay_keep == 0
    assert torch.get_num_threads() == 1


def test_structured_output_under_bounded_replay(late, make_llm):  # noqa: F811
    """A grammar masks the sampled rows only: the constrained outputs are valid and equal between the modes."""
    params = SamplingParams(temperature=0.0, max_tokens=12, structured_outputs={"regex": "[0-9]{2,6}"})
    outs = {mode: generate(make_llm(late, dtype="float64", bounded_replay=mode, max_num_batched_tokens=16),
                           PROMPTS, params) for mode in ("compact", "mask")}
    assert_same(outs["compact"], outs["mask"])
    for out in outs["compact"]:
        text = out.outputs[0].text
        assert text.isdigit() and 2 <= len(text) <= 6, text

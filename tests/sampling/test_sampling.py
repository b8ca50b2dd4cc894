"""SamplingParams validation, the Sampler on hand-made logits, and sampling through the engine.

Engine runs use the tiny checkpoint in float64 (so batch composition cannot move a logit) with
block_size 16; every engine is checked after every step and drained at the end of each test.
"""

from __future__ import annotations

import math
import re

import engine_fixtures
import pytest
import torch
from engine_fixtures import (
    assert_drained,
    check_every_step,
    greedy,
    hf_log_softmax,
    make_prompt,
    run_tokens,
    token_prompts,
)

from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.entrypoints.llm import LLM
from deepinfer_core.sampling.params import SamplingParams

# the shared fixtures, bound here so that pytest finds them in this module
make_llm = engine_fixtures.make_llm
one_torch_thread = engine_fixtures.one_torch_thread
tiny_path = engine_fixtures.tiny_path

VOCAB = 384
EOS = 1

# --- SamplingParams ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(n=0), "n"),
        (dict(n=1.5), "n"),
        (dict(temperature=-1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        (dict(top_p=0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=-0.1), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(min_p=2), "min_p"),
        (dict(min_p=-0.5), "min_p"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-4), "max_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=5, max_tokens=3), "min_tokens"),
        (dict(stop=""), "stop"),
        (dict(stop=["ok", ""]), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(seed="7"), "seed"),
        (dict(logprobs=-1), "logprobs"),
    ],
    ids=lambda v: v if isinstance(v, str) else repr(v),
)
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"(?:: |; ){re.escape(field)}\b"):
        SamplingParams(**kwargs)


def test_valid_sampling_params_are_normalised():
    p = SamplingParams(top_k=-1, stop="x", stop_token_ids=None, max_tokens=None, min_tokens=4)
    assert p.top_k == 0 and p.stop == ["x"] and p.stop_token_ids == [] and p.max_tokens is None
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy
    assert SamplingParams(presence_penalty=0.5).has_penalties and not SamplingParams().has_penalties


# --- the Sampler on hand-made logits ----------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_path):
    llm = LLM(str(tiny_path("tiny")), block_size=16, dtype="float64")
    check_every_step(llm.llm_engine)
    return llm


@pytest.fixture(autouse=True)
def _drained_after(request):
    yield
    if "llm" in request.fixturenames:
        assert_drained(request.getfixturevalue("llm").llm_engine)


def seq_with(params: SamplingParams, prompt=(5,), outputs=(), seed=0) -> Sequence:
    seq = Sequence("r", 0, list(prompt), params, torch.Generator().manual_seed(seed))
    seq.output_token_ids = list(outputs)
    return seq


def sample(llm, logits_rows, seqs):
    logits = torch.tensor(logits_rows, dtype=torch.float64)
    return llm.llm_engine.sampler(logits, seqs).to_host().tolists(seqs)


def row(values: dict[int, float], base: float = 0.0) -> list[float]:
    r = [base] * VOCAB
    for t, v in values.items():
        r[t] = v
    return r


def test_greedy_top_k_1_tiny_top_p_and_min_p_1_pick_the_argmax(llm):
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(6, VOCAB, generator=gen, dtype=torch.float64).tolist()
    argmax = torch.tensor(rows).argmax(-1).tolist()
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=1.3, top_k=1),
                   SamplingParams(temperature=0.9, top_p=1e-9), SamplingParams(temperature=2.0, min_p=1.0)):
        for seed in range(4):
            tokens, _ = sample(llm, rows, [seq_with(params, seed=seed + 10 * i) for i in range(6)])
            assert tokens == argmax, params


def test_top_k_top_p_min_p_only_sample_allowed_tokens(llm):
    probs = {10: 0.4, 11: 0.3, 12: 0.2, 13: 0.06, 14: 0.04}
    logits = row({t: math.log(p) for t, p in probs.items()}, base=-1e9)
    cases = [(dict(top_k=2), {10, 11}), (dict(top_p=0.65), {10, 11}), (dict(top_p=0.75), {10, 11, 12}),
             (dict(min_p=0.45), {10, 11, 12}), (dict(min_p=0.7), {10, 11}), (dict(), set(probs))]
    for kwargs, allowed in cases:
        params = SamplingParams(temperature=1.0, **kwargs)
        seqs = [seq_with(params, seed=s) for s in range(200)]
        tokens, _ = sample(llm, [logits] * len(seqs), seqs)
        assert set(tokens) == allowed, kwargs  # all allowed ones show up in 200 draws, nothing else


def test_temperature_sharpens_and_flattens(llm):
    logits = row({10: 1.0, 11: 0.0}, base=-1e9)

    def share_of_10(temperature):
        seqs = [seq_with(SamplingParams(temperature=temperature), seed=s) for s in range(400)]
        tokens, _ = sample(llm, [logits] * len(seqs), seqs)
        return tokens.count(10) / len(tokens)

    # p(10) = sigmoid(1 / T): 0.99995 at T=0.1, 0.731 at T=1, 0.525 at T=10
    assert share_of_10(0.1) > 0.98
    assert 0.62 < share_of_10(1.0) < 0.84
    assert 0.4 < share_of_10(10.0) < 0.65


@pytest.mark.parametrize(
    "kwargs, prompt, outputs, expected",
    [
        # token 5 (logit 2.0) against token 6 (1.5): penalties on 5 flip the choice past 0.5
        (dict(presence_penalty=0.6), (7,), (5,), 6),
        (dict(presence_penalty=0.4), (7,), (5,), 5),
        (dict(frequency_penalty=0.3), (7,), (5, 5), 6),  # 2.0 - 2 * 0.3 = 1.4
        (dict(frequency_penalty=0.2), (7,), (5, 5), 5),  # 1.6
        (dict(presence_penalty=2.0), (5,), (), 5),  # presence/frequency count outputs only
        (dict(repetition_penalty=1.5), (5,), (), 6),  # 2.0 / 1.5 = 1.33: prompt tokens count too
        (dict(repetition_penalty=1.2), (5,), (), 5),  # 1.67
        (dict(presence_penalty=-0.6), (7,), (6,), 6),  # negative: encourages repeats
        (dict(repetition_penalty=0.5), (7,), (6,), 6),  # below 1: encourages (1.5 / 0.5 = 3.0)
    ],
)
def test_penalties_move_logits_as_specified(llm, kwargs, prompt, outputs, expected):
    logits = row({5: 2.0, 6: 1.5}, base=-5.0)
    tokens, _ = sample(llm, [logits], [seq_with(SamplingParams(temperature=0, **kwargs), prompt, outputs)])
    assert tokens == [expected]


def test_repetition_penalty_multiplies_negative_logits(llm):
    # all logits negative: a seen token at -1.0 becomes -3.0 with penalty 3, so -2.0 wins
    logits = row({5: -1.0, 6: -2.0}, base=-50.0)
    tokens, _ = sample(llm, [logits], [seq_with(SamplingParams(temperature=0, repetition_penalty=3.0), (5,))])
    assert tokens == [6]


def test_min_tokens_masks_eos_and_stop_tokens(llm):
    logits = row({EOS: 5.0, 9: 4.0, 7: 3.0}, base=-5.0)
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[9])
    assert sample(llm, [logits], [seq_with(p, outputs=[3])])[0] == [7]  # 1 < 2: EOS and 9 masked
    assert sample(llm, [logits], [seq_with(p, outputs=[3, 3])])[0] == [EOS]  # reached: nothing masked
    p = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)
    assert sample(llm, [logits], [seq_with(p)])[0] == [EOS]  # EOS is an ordinary token with ignore_eos


def test_logprobs_are_the_models_and_include_the_sample(llm):
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(VOCAB, generator=gen, dtype=torch.float64)
    logits[EOS] = logits.max() + 0.5  # the most likely token, but masked by min_tokens below
    raw = torch.log_softmax(logits, -1)
    top3 = raw.topk(3).indices.tolist()
    assert top3[0] == EOS
    params = SamplingParams(temperature=5.0, logprobs=3, presence_penalty=1.0, min_tokens=2)
    seqs = [seq_with(params, outputs=[top3[0]], seed=s) for s in range(40)]
    tokens, logprobs = sample(llm, [logits.tolist()] * 40, seqs)
    assert any(t not in top3 for t in tokens)  # a hot temperature samples outside the top 3
    assert EOS not in tokens
    for tok, lp in zip(tokens, logprobs):
        assert set(lp) == set(top3) | {tok} and len(lp) in (3, 4)
        for t, v in lp.items():  # before temperature, penalties and min_tokens masking
            assert v == pytest.approx(float(raw[t]), abs=1e-12)
    _, logprobs = sample(llm, [logits.tolist()], [seq_with(SamplingParams(logprobs=0), seed=1)])
    assert len(logprobs[0]) == 1
    assert sample(llm, [logits.tolist()], [seq_with(SamplingParams(), seed=1)])[1] == [None]


# --- through the engine -----------------------------------------------------------------------

PROMPTS = [make_prompt(n, seed=200 + i) for i, n in enumerate([3, 11, 26, 5, 40, 17])]


def outputs(llm, prompts, params):
    outs = llm.generate(token_prompts(prompts), params, use_tqdm=False)
    assert all(o.finished and o.error is None for o in outs)
    return outs


def test_greedy_is_deterministic_and_filters_at_their_limit_equal_it(llm):
    base = run_tokens(llm, PROMPTS[:3], greedy(8))
    assert run_tokens(llm, PROMPTS[:3], greedy(8)) == base
    for kwargs in (dict(top_k=1), dict(top_p=1e-9), dict(min_p=1.0)):
        params = SamplingParams(temperature=0.8, seed=4, max_tokens=8, ignore_eos=True, **kwargs)
        assert run_tokens(llm, PROMPTS[:3], params) == base, kwargs


def test_seeded_sampling_reproduces_across_runs_restarts_and_batches(llm, tiny_path, make_llm):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True)
    alone = run_tokens(llm, [PROMPTS[1]], params)[0]
    assert run_tokens(llm, [PROMPTS[1]], params)[0] == alone
    restarted = make_llm(tiny_path("tiny"), dtype="float64")
    assert run_tokens(restarted, [PROMPTS[1]], params)[0] == alone
    others = [SamplingParams(temperature=0.7, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=99, max_tokens=14, ignore_eos=True),
              greedy(3), SamplingParams(temperature=1.5, top_k=5, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True, n=2)]
    mixed = [PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[3], PROMPTS[4], PROMPTS[5]]
    together = outputs(llm, mixed, [others[0], others[1], params, others[2], others[3], others[4]])
    assert together[2].outputs[0].token_ids == alone
    # a different seed gives a different sample (the model is not that sure of itself)
    other_seed = SamplingParams(temperature=1.0, seed=4321, max_tokens=10, ignore_eos=True)
    assert run_tokens(llm, [PROMPTS[1]], other_seed)[0] != alone


def test_seeded_sampling_survives_preemption(llm, tiny_path, make_llm):
    """A preempted sequence keeps its tokens and its generator: recomputing changes nothing."""
    params = [SamplingParams(temperature=1.0, seed=50 + i, max_tokens=10, ignore_eos=True, top_k=20,
                             presence_penalty=0.5) for i in range(len(PROMPTS))]
    roomy = run_tokens(llm, PROMPTS, params)
    tight = make_llm(tiny_path("tiny"), dtype="float64", num_blocks=6, num_window_blocks=6,
                     max_num_batched_tokens=16)
    assert run_tokens(tight, PROMPTS, params) == roomy
    assert tight.llm_engine.scheduler.num_preemptions > 0


def test_unseeded_sampling_follows_the_engine_seed(tiny_path, make_llm):
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    first = run_tokens(make_llm(tiny_path("tiny"), dtype="float64", seed=3), PROMPTS[:2], params)
    again = run_tokens(make_llm(tiny_path("tiny"), dtype="float64", seed=3), PROMPTS[:2], params)
    assert first == again


def test_n_returns_n_independent_completions(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    out = outputs(llm, [PROMPTS[0]], params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    again = outputs(llm, [PROMPTS[0]], params)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_presence_and_frequency_penalties_through_the_engine(llm):
    prompts = PROMPTS[:3]
    base = run_tokens(llm, prompts, greedy(12))
    repeat = run_tokens(llm, prompts, greedy(12, frequency_penalty=-2.0))
    assert sum(len(set(t)) for t in repeat) < sum(len(set(t)) for t in base)  # negative: repeats
    assert all(len(set(t)) < len(t) for t in repeat)
    for kwargs in (dict(presence_penalty=2.0), dict(frequency_penalty=2.0), dict(repetition_penalty=3.0)):
        for tokens in run_tokens(llm, prompts, greedy(12, **kwargs)):
            assert len(set(tokens)) == len(tokens), kwargs  # nothing repeats


def test_max_tokens_finishes_with_length(llm):
    out = outputs(llm, [PROMPTS[2]], greedy(5))[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length" and out.stop_reason is None


def test_stop_token_ids_and_min_tokens(llm):
    g = run_tokens(llm, [PROMPTS[3]], greedy(12))[0]
    x = g[0]
    # stops at once on a stop token
    out = outputs(llm, [PROMPTS[3]], greedy(12, stop_token_ids=[x]))[0].outputs[0]
    assert out.token_ids == [x] and out.finish_reason == "stop" and out.stop_reason == x
    # min_tokens=3: x is masked for the first three tokens
    masked = outputs(llm, [PROMPTS[3]], greedy(12, stop_token_ids=[x], min_tokens=3))[0].outputs[0]
    assert len(masked.token_ids) >= 3 and x not in masked.token_ids[:3]
    if masked.finish_reason == "stop":
        assert masked.token_ids[-1] == x and x not in masked.token_ids[:-1]
    # a second stop token z that greedy picks right after min_tokens: stop happens exactly there
    a = masked.token_ids
    z = a[3]
    if z not in a[:3] and z != x:
        out = outputs(llm, [PROMPTS[3]], greedy(12, stop_token_ids=[x, z], min_tokens=3))[0].outputs[0]
        assert out.token_ids == a[:4] and out.finish_reason == "stop" and out.stop_reason == z
    # stop token text is not shown
    j = next(j for j in range(1, len(g)) if g[j] not in g[:j])
    out = outputs(llm, [PROMPTS[3]], greedy(12, stop_token_ids=[g[j]]))[0].outputs[0]
    assert out.token_ids == g[: j + 1]
    assert out.text == llm.get_tokenizer().decode(g[:j], skip_special_tokens=True)


def test_eos_stops_unless_ignored_or_before_min_tokens(tiny_path, make_llm):
    llm = make_llm(tiny_path("tiny"), dtype="float64")
    g = run_tokens(llm, [PROMPTS[0]], greedy(6))[0]
    engine = llm.llm_engine
    # make the greedy second token the model's EOS
    eos = g[1]
    assert eos not in g[:1]
    engine.model_config.hf_config.eos_token_id = eos
    engine.sampler.eos = [eos]
    out = outputs(llm, [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=6))[0].outputs[0]
    assert out.token_ids == g[:2] and out.finish_reason == "stop" and out.stop_reason is None
    assert out.text == llm.get_tokenizer().decode(g[:1], skip_special_tokens=True)
    out = outputs(llm, [PROMPTS[0]], greedy(6))[0].outputs[0]  # greedy() sets ignore_eos
    assert out.token_ids == g and out.finish_reason == "length"
    out = outputs(llm, [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=6, min_tokens=3))[0].outputs[0]
    assert out.token_ids[0] == g[0] and eos not in out.token_ids[:3]
    assert out.finish_reason == "length" or out.token_ids.index(eos) >= 3


@pytest.fixture(scope="module")
def readable(llm):
    """(prompt, greedy tokens, their text) for the first prompt whose 12 greedy tokens decode to whole
    characters only (random tokens of a byte-level vocabulary often end mid-character)."""
    tok = llm.get_tokenizer()
    for prompt, g in zip(PROMPTS, run_tokens(llm, PROMPTS, greedy(12))):
        texts = [tok.decode(g[:k], skip_special_tokens=True) for k in range(len(g) + 1)]
        if not any("\ufffd" in t for t in texts) and all(texts[-1].startswith(t) for t in texts):
            return prompt, g, texts
    pytest.fail("no prompt decodes to whole characters")


def test_stop_strings(llm, readable):
    prompt, g, texts = readable
    full = texts[-1]
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    out = outputs(llm, [prompt], greedy(12, stop=["never-appears", stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[: full.index(stop)] and stop not in out.text
    k = len(out.token_ids)
    assert out.token_ids == g[:k]
    assert stop in texts[k] and stop not in texts[k - 1]  # stopped at the token that completed it


def test_stop_string_before_min_tokens_is_passed_over(llm, readable):
    prompt, g, texts = readable
    stop = texts[2][-1]  # completed by the second token, while min_tokens=4 holds stops back
    out = outputs(llm, [prompt], greedy(12, stop=stop, min_tokens=4))[0].outputs[0]
    assert out.token_ids == g[: len(out.token_ids)] and len(out.token_ids) >= 4
    # only an occurrence that ends in the 4th token's text or later counts
    full = texts[-1]
    cut = full.find(stop, len(texts[3]) - len(stop) + 1)
    assert out.text == (full if cut < 0 else full[:cut])
    assert out.finish_reason == ("length" if cut < 0 else "stop")


def test_logprobs_match_transformers(llm, tiny_path):
    path = tiny_path("tiny")
    params = [greedy(6, logprobs=3), SamplingParams(temperature=1.5, seed=11, max_tokens=6, ignore_eos=True,
                                                   logprobs=2)]
    outs = outputs(llm, PROMPTS[1:3], params)
    for prompt, out, p in zip(PROMPTS[1:3], outs, params):
        comp = out.outputs[0]
        ref = hf_log_softmax(path, prompt, comp.token_ids)
        assert len(comp.logprobs) == len(comp.token_ids)
        for step, (tok, lp) in enumerate(zip(comp.token_ids, comp.logprobs)):
            assert tok in lp and len(lp) in (p.logprobs, p.logprobs + 1)
            top = set(ref[step].topk(p.logprobs).indices.tolist())
            assert set(lp) == top | {tok}
            for t, v in lp.items():
                assert abs(v - float(ref[step, t])) < 1e-6
        total = sum(lp[t] for t, lp in zip(comp.token_ids, comp.logprobs))
        assert comp.cumulative_logprob == pytest.approx(total)

"""Lossless rejection sampling: the tokens that verification emits follow the target's distribution.

Chi-square goodness-of-fit tests with fixed seeds at significance 0.001 (critical values of the chi-square
distribution: 16.27 for 3 degrees of freedom, 20.52 for 5): the rejection sampler alone on a 6-token
vocabulary with general and one-hot (greedy) drafts, at the first and the second output position; and
the engine end to end on a tiny model whose sampling is restricted to 4 tokens (top_k=4), with and without
a penalty. Seeded requests reproduce exactly.
"""

from __future__ import annotations

import engine_fixtures
import pytest
import torch
from engine_fixtures import make_prompt, token_prompts
from spec_fixtures import spec

from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.spec_decode.rejection_sampler import greedy_verify, rejection_sample, verify_noise

make_llm = engine_fixtures.make_llm
one_torch_thread = engine_fixtures.one_torch_thread
tiny_path = engine_fixtures.tiny_path

CRITICAL = {3: 16.27, 5: 20.52}  # chi-square quantiles at 1 - 0.001


def chi_square(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=len(probs)).double()
    expected = probs.double() * len(samples)
    return float(((counts - expected) ** 2 / expected).sum())


P0 = torch.tensor([0.35, 0.25, 0.15, 0.12, 0.08, 0.05], dtype=torch.float64)
P1 = torch.tensor([0.05, 0.10, 0.40, 0.05, 0.30, 0.10], dtype=torch.float64)
Q0 = torch.tensor([0.10, 0.40, 0.10, 0.20, 0.10, 0.10], dtype=torch.float64)
Q1 = torch.tensor([0.30, 0.10, 0.10, 0.30, 0.10, 0.10], dtype=torch.float64)


@pytest.mark.parametrize("drafts_kind", ["sampled_from_q", "greedy_one_hot"])
def test_rejection_sampler_is_lossless(drafts_kind):
    n, v = 40000, 6
    gen = torch.Generator().manual_seed(11)
    target = torch.stack([P0, P1, P0]).expand(n, 3, v)
    uniforms, noise = verify_noise(list(range(n)), [0] * n, 3, v, torch.device("cpu"))
    if drafts_kind == "sampled_from_q":
        q = torch.stack([Q0, Q1]).expand(n, 2, v)
        drafts = torch.stack([torch.multinomial(Q0, n, True, generator=gen),
                              torch.multinomial(Q1, n, True, generator=gen)], dim=1)
    else:
        q, drafts = None, torch.tensor([[1, 3]]).expand(n, 2)  # deliberately unlikely drafts
    out = rejection_sample(target, drafts, torch.full((n,), 2), uniforms, noise, q)
    assert chi_square(out.output_token_ids[:, 0], P0) < CRITICAL[5]
    second = out.num_accepted >= 1  # position 1 exists: draft 1 passed
    assert 0.05 * n < int(second.sum()) < 0.95 * n
    assert chi_square(out.output_token_ids[second, 1], P1) < CRITICAL[5]
    third = out.num_accepted >= 2
    assert chi_square(out.output_token_ids[third, 2], P0) < CRITICAL[5] or int(third.sum()) < 50
    # a wrong sampler fails the same test: drafts always accepted would follow q, not p
    if q is not None:
        assert chi_square(drafts[:, 0], P0) > CRITICAL[5]


def test_greedy_rows_are_exact_match():
    logits = torch.tensor([[[0.1, 2.0, 0.3], [1.0, 0.0, 0.2], [0.0, 0.0, 5.0]]], dtype=torch.float64)
    uniforms, noise = verify_noise([0], [0], 3, 3, torch.device("cpu"))
    out = rejection_sample(logits, torch.tensor([[1, 2]]), torch.tensor([2]), uniforms, noise,
                           greedy=torch.tensor([True]))
    assert out.num_accepted.tolist() == [1]  # draft 1 = argmax of row 0; draft 2 != argmax of row 1 (0)
    assert out.output_token_ids.tolist() == [[1, 0, -1]]


def test_all_greedy_fast_path_equals_the_rejection_sampler():
    """``greedy_verify`` (no probabilities, no noise) gives the rejection sampler's greedy verdicts, for
    drafts right and wrong at every offset and draft counts below K."""
    gen = torch.Generator().manual_seed(0)
    s, k, vocab = 64, 3, 11
    logits = torch.randn(s, k + 1, vocab, generator=gen, dtype=torch.float64)
    argmax = logits.argmax(dim=-1)
    wrong = torch.rand(s, k, generator=gen) < 0.3
    drafts = torch.where(wrong, (argmax[:, :k] + 1) % vocab, argmax[:, :k])
    num_drafts = torch.randint(0, k + 1, (s,), generator=gen)
    uniforms, noise = verify_noise(list(range(s)), [0] * s, k + 1, vocab, torch.device("cpu"))
    slow = rejection_sample(torch.softmax(logits, dim=-1), drafts, num_drafts, uniforms, noise,
                            greedy=torch.ones(s, dtype=torch.bool))
    fast = greedy_verify(logits, drafts, num_drafts)
    assert torch.equal(fast.num_accepted, slow.num_accepted) and torch.equal(fast.output_token_ids,
                                                                              slow.output_token_ids)
    assert set(fast.num_accepted.tolist()) == {0, 1, 2, 3}


def _top4(llm, prompt):
    """The engine's top-4 tokens after ``prompt`` and their probabilities renormalised (top_k=4, T=1)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=4, ignore_eos=True)
    lp = llm.generate(token_prompts([prompt]), params, use_tqdm=False)[0].outputs[0].logprobs[0]
    top = sorted(lp.items(), key=lambda kv: -kv[1])[:4]
    probs = torch.tensor([x for _, x in top], dtype=torch.float64).exp()
    return [t for t, _ in top], probs / probs.sum()


@pytest.mark.parametrize("config, method", [("tiny", "mtp"), pytest.param("v41", "dspark", marks=pytest.mark.slow)])
def test_engine_sampling_with_speculation_matches_the_target(config, method, tiny_path, make_llm):
    """Token 2 of 2000 seeded requests of 3 tokens (temperature 1, top_k 4), verified against a draft the target
    gives about a quarter of its mass, among the requests whose token 1 was the likeliest: distributed
    as the target's conditional distribution (V4 with MTP, V4.1 with DSpark)."""
    path = tiny_path(config)
    prompt = make_prompt(6, seed=77)
    plain = make_llm(path, dtype="float64")
    tokens0, _ = _top4(plain, prompt)
    first = tokens0[0]
    tokens1, p1 = _top4(plain, prompt + [first])
    draft = tokens1[1]
    speculative = {"speculative_config": {"method": method, "num_speculative_tokens": 1}}
    llm = make_llm(path, dtype="float64", max_num_seqs=256, max_num_batched_tokens=4096, **speculative)
    planner = llm.llm_engine.drafts
    offer = planner.offer
    planner.offer = lambda seq, drafts, confs: offer(seq, [draft], [0.5])
    n = 2000
    params = [SamplingParams(temperature=1.0, top_k=4, max_tokens=3, ignore_eos=True, seed=s) for s in range(n)]
    outs = llm.generate(token_prompts([prompt] * n), params, use_tqdm=False)
    pairs = [o.outputs[0].token_ids for o in outs]
    seconds = torch.tensor([tokens1.index(t[1]) for t in pairs if t[0] == first])
    assert len(seconds) > 300
    stats = llm.llm_engine.spec_decode_stats()
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    assert chi_square(seconds, p1) < CRITICAL[3], (torch.bincount(seconds, minlength=4), p1 * len(seconds))


def _penalised_top4(llm, prompt, outputs, counted, frequency):
    """The top-4 tokens after ``prompt + outputs`` with a frequency penalty on the tokens ``counted`` and
    their probabilities renormalised (top_k=4, T=1), from the engine's raw logprobs."""
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=20, ignore_eos=True)
    lp = llm.generate(token_prompts([prompt + outputs]), params, use_tqdm=False)[0].outputs[0].logprobs[0]
    top = sorted(((t, x - frequency * counted.count(t)) for t, x in lp.items()), key=lambda kv: -kv[1])[:4]
    probs = torch.tensor([x for _, x in top], dtype=torch.float64).exp()
    return [t for t, _ in top], probs / probs.sum()


def test_engine_sampling_with_penalties_counts_the_accepted_drafts(tiny_path, make_llm):
    """Token 3 of 2000 seeded requests (temperature 1, top_k 4, frequency_penalty -1.5, which favours
    repeats), verified in the step that accepted draft 1 as token 2, among the requests whose tokens 1
    and 2 were the likeliest: distributed as the target's penalised distribution with that draft counted
    as an output (without it, draft 1 is not among the target's top 4 there)."""
    path, frequency = tiny_path("tiny"), -1.5
    prompt = make_prompt(6, seed=5)
    plain = make_llm(path, dtype="float64")
    first = _penalised_top4(plain, prompt, [], [], frequency)[0][0]
    second = _penalised_top4(plain, prompt, [first], [first], frequency)[0][0]
    tokens, probs = _penalised_top4(plain, prompt, [first, second], [first, second], frequency)
    assert second in tokens and second not in _penalised_top4(plain, prompt, [first, second], [first], frequency)[0]
    llm = make_llm(path, dtype="float64", max_num_seqs=256, max_num_batched_tokens=4096, **spec(2))
    planner = llm.llm_engine.drafts
    offer = planner.offer
    planner.offer = lambda seq, drafts, confs: offer(seq, [second, tokens[1]], [0.5, 0.5])
    n = 2000
    params = [SamplingParams(temperature=1.0, top_k=4, max_tokens=3, ignore_eos=True, seed=s,
                             frequency_penalty=frequency) for s in range(n)]
    outs = llm.generate(token_prompts([prompt] * n), params, use_tqdm=False)
    thirds = torch.tensor([tokens.index(t[2]) for t in (o.outputs[0].token_ids for o in outs)
                           if t[:2] == [first, second]])
    assert len(thirds) > 150
    assert chi_square(thirds, probs) < CRITICAL[3], (torch.bincount(thirds, minlength=4), probs * len(thirds))


def test_seeded_requests_reproduce(make_llm):
    """Same seed: the same tokens, alone or in a batch, in a fresh engine; another seed: other tokens."""
    text = open("data/heldout_slice.txt").read()
    llm = make_llm(None, dtype="float64", block_size=32, **spec(2))
    prompt = llm.llm_engine.encode(text)[:40]
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=20, ignore_eos=True, seed=7)
    alone = llm.generate(token_prompts([prompt]), params, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True, seed=s) for s in (1, 2)]
    batch = llm.generate(token_prompts([prompt, prompt[:30], prompt]), [others[0], others[1], params],
                         use_tqdm=False)
    assert batch[2].outputs[0].token_ids == alone
    assert batch[0].outputs[0].token_ids != alone
    fresh = make_llm(None, dtype="float64", block_size=32, **spec(2))
    assert fresh.generate(token_prompts([prompt]), params, use_tqdm=False)[0].outputs[0].token_ids == alone
    assert llm.llm_engine.spec_decode_stats()["num_accepted_tokens"] > 0


def test_verification_noise_is_the_host_hash_of_each_position():
    """The seeds of each row's noise and acceptance uniform, hashed on the device from the positions, are
    the host's ``noise_seed`` / ``accept_seed`` of that output position (negative and 64-bit bases too)."""
    from deepinfer_core.sampling.random import as_int64, exponential_noise, noise_seed
    from deepinfer_core.spec_decode.rejection_sampler import accept_seed

    bases, firsts, rows, vocab = [0, 7, -3, (1 << 64) - 5, 123456789123456789], [0, 5, 1, 1000, 77], 4, 11
    uniforms, noise = verify_noise(bases, firsts, rows, vocab, torch.device("cpu"))
    for s, (base, first) in enumerate(zip(bases, firsts)):
        seeds = torch.tensor([as_int64(noise_seed(base, first + j)) for j in range(rows)])
        assert torch.equal(noise[s], exponential_noise(seeds, vocab))
        useeds = torch.tensor([as_int64(accept_seed(base, first + j)) for j in range(rows - 1)])
        assert torch.equal(uniforms[s], exponential_noise(useeds, 1)[:, 0].neg().exp())

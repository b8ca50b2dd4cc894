"""Speculative decoding with the MTP layer: greedy output equals output without speculation, token for
token (float64, cpu_ref), on the golden tiny configs (random MTP weights: drafts mostly rejected; and an
oracle drafter that places acceptances and rejections anywhere) and on the trained default model (real
acceptance), across batches with chunked prefill, preemption, aborts, prefix hits, stop strings, stop
tokens and max_tokens landing inside a draft.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import engine_fixtures
import pytest
from engine_fixtures import greedy, make_prompt, run_tokens, token_prompts
from spec_fixtures import oracle_drafts, spec

from deepinfer_core.sampling.params import SamplingParams

make_llm = engine_fixtures.make_llm
one_torch_thread = engine_fixtures.one_torch_thread
tiny_path = engine_fixtures.tiny_path

CONFIGS = ["tiny", "tiny_hc4", "tiny_hc1"]
LENGTHS = [1, 2, 4, 7, 8, 9, 12, 16, 17, 24, 31, 33, 40, 48, 64, 70]
PROMPTS = [make_prompt(n, seed=i) for i, n in enumerate(LENGTHS)]
MAX_TOKENS = 10
_REF: dict = {}


def reference(make_llm, path, prompts, max_tokens=MAX_TOKENS + 4, **engine_args):
    """Greedy outputs without speculation (cached per checkpoint, prompts and length)."""
    key = (str(path), tuple(map(tuple, prompts)), max_tokens)
    if key not in _REF:
        llm = make_llm(path, dtype="float64", **engine_args)
        _REF[key] = dict(zip(map(tuple, prompts), run_tokens(llm, prompts, greedy(max_tokens))))
    return _REF[key]


def mixed(seq, m, j):
    """A deterministic mix of rejection points: every accepted length 0..k occurs."""
    return (seq.seq_id * 7 + m * 3 + j * 5) % 4 == 0


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("k", [1, 3])
def test_mtp_drafts_greedy_equal(config, k, tiny_path, make_llm):
    path = tiny_path(config)
    ref = reference(make_llm, path, PROMPTS)
    llm = make_llm(path, dtype="float64", **spec(k))
    outs = run_tokens(llm, PROMPTS, greedy(MAX_TOKENS))
    assert outs == [ref[tuple(p)][:MAX_TOKENS] for p in PROMPTS]
    stats = llm.llm_engine.spec_decode_stats()
    assert stats["num_draft_tokens"] > 0 and stats["num_proposed_tokens"] >= stats["num_draft_tokens"]


VARIANTS = {
    "default": {},
    "chunk13": dict(max_num_batched_tokens=13),
    "chunk8-3seqs": dict(max_num_batched_tokens=8, max_num_seqs=3),
    "unchunked": dict(enable_chunked_prefill=False),
    "preempt-blocks10": dict(num_blocks=10, num_window_blocks=8),
    "preempt-blocks9-window3-chunk13": dict(num_blocks=9, num_window_blocks=3, max_num_batched_tokens=13),
}


# slow: tiny's chunk8-3seqs (3-sequence cap), unchunked (whole prefills), preempt-blocks10 (preemption, full window)
SLOW_ORACLE_VARIANTS = ("chunk8-3seqs", "unchunked", "preempt-blocks10")
ORACLE_CASES = [
    pytest.param("tiny", v, marks=pytest.mark.slow) if v in SLOW_ORACLE_VARIANTS else pytest.param("tiny", v)
    for v in VARIANTS] + [
    pytest.param(c, v) for c in CONFIGS[1:] for v in ("default", "preempt-blocks9-window3-chunk13")]


@pytest.mark.parametrize("config, variant", ORACLE_CASES)
def test_oracle_drafts_greedy_equal(config, variant, tiny_path, make_llm):
    """Accepted and rejected drafts at every offset, through chunking and preemption."""
    path = tiny_path(config)
    ref = reference(make_llm, path, PROMPTS)
    llm = make_llm(path, dtype="float64", **spec(3), **VARIANTS[variant])
    oracle_drafts(llm, ref, mixed)
    outs = run_tokens(llm, PROMPTS, greedy(MAX_TOKENS))
    assert outs == [ref[tuple(p)][:MAX_TOKENS] for p in PROMPTS]
    engine = llm.llm_engine
    stats = engine.spec_decode_stats()
    assert stats["num_accepted_tokens"] > 0 and stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    assert len(stats["accepted_per_position"]) == 3 and stats["accepted_per_position"][2] > 0
    if variant.startswith("preempt"):
        assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 4, 5, 6, 7])
def test_max_tokens_inside_a_draft(max_tokens, tiny_path, make_llm):
    """All drafts right: the length limit falls on every offset of a verification."""
    path = tiny_path("tiny")
    prompts = PROMPTS[:4]
    ref = reference(make_llm, path, prompts)
    llm = make_llm(path, dtype="float64", **spec(3))
    oracle_drafts(llm, ref)
    outs = run_tokens(llm, prompts, greedy(max_tokens))
    assert outs == [ref[tuple(p)][:max_tokens] for p in prompts]


def test_stop_token_inside_accepted_drafts(tiny_path, make_llm):
    """A stop token among accepted drafts ends the sequence there; later accepted tokens are dropped."""
    path = tiny_path("tiny")
    prompts = PROMPTS[4:8]
    ref = reference(make_llm, path, prompts)
    for i, p in enumerate(prompts):
        stop = ref[tuple(p)][3 + i]
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, stop_token_ids=[stop])
        plain = make_llm(path, dtype="float64")
        expected = plain.generate(token_prompts([p]), params, use_tqdm=False)[0].outputs[0]
        llm = make_llm(path, dtype="float64", **spec(3))
        oracle_drafts(llm, ref)
        got = llm.generate(token_prompts([p]), params, use_tqdm=False)[0].outputs[0]
        assert (got.token_ids, got.finish_reason, got.stop_reason) == (
            expected.token_ids, expected.finish_reason, expected.stop_reason)
        assert got.finish_reason == "stop"


def test_aborts_leave_the_others_unchanged(tiny_path, make_llm):
    path = tiny_path("tiny")
    ref = reference(make_llm, path, PROMPTS)
    llm = make_llm(path, dtype="float64", **spec(2))
    oracle_drafts(llm, ref, mixed)
    engine = llm.llm_engine
    rids = [engine.add_request(None, {"prompt_token_ids": p}, greedy(MAX_TOKENS)) for p in PROMPTS]
    aborted = {rids[1]: 1, rids[5]: 2, rids[9]: 0, rids[15]: 3}
    check_the_others_unchanged(run_with_aborts(engine, aborted), aborted, rids, ref)


def run_with_aborts(engine, aborted: dict[str, int], before_abort: Callable[[], None] = lambda: None) -> dict:
    """Step ``engine`` to the end, aborting each request of ``aborted`` at its step (``before_abort`` just
    before); the finished requests' tokens."""
    done, step = {}, 0
    while engine.has_unfinished_requests():
        for rid, at in aborted.items():
            if at == step:
                before_abort()
                engine.abort_request(rid)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        step += 1
    return done


def check_the_others_unchanged(done: dict, aborted: dict[str, int], rids: list[str], ref: dict) -> None:
    for rid, p in zip(rids, PROMPTS):
        if rid not in aborted:
            assert done[rid] == ref[tuple(p)][:MAX_TOKENS]
    assert not set(aborted) & set(done), "an aborted request produced a final output"


def check_prefix_hits_on_speculated_outputs(make_llm, path, build, install_oracle) -> None:
    """A prompt that continues an earlier request's prompt and speculated output hits the blocks the
    accepted tokens completed, and still generates exactly the reference (``build`` makes the engine
    under test, ``install_oracle`` forces its drafts)."""
    first = [make_prompt(40, seed=50)]
    ref1 = reference(make_llm, path, first, max_tokens=30)
    second = [first[0] + ref1[tuple(first[0])][:20]]
    ref2 = reference(make_llm, path, second)
    llm = build(path, dtype="float64", **spec(3))
    install_oracle(llm, {**ref1, **ref2}, mixed)
    assert run_tokens(llm, first, greedy(30)) == [ref1[tuple(first[0])]]
    assert run_tokens(llm, second, greedy(MAX_TOKENS)) == [ref2[tuple(second[0])][:MAX_TOKENS]]
    assert llm.llm_engine.prefix_cache_stats()["hit_tokens"] >= 48
    # every hashed block covers accepted tokens only: its hash is one of a finished sequence's
    bm = llm.llm_engine.block_manager
    valid = set()
    for tokens in (first[0] + ref1[tuple(first[0])], second[0] + ref2[tuple(second[0])][:MAX_TOKENS]):
        from deepinfer_core.engine.sequence import Sequence

        seq = Sequence("x", 0, tokens, greedy(), None)
        valid.update(bm.block_hashes(seq, len(tokens) // bm.block_size))
    assert set(bm.blocks.cached) <= valid and bm.blocks.cached


def test_prefix_hits_on_speculated_outputs(tiny_path, make_llm):
    check_prefix_hits_on_speculated_outputs(make_llm, tiny_path("tiny"), make_llm, oracle_drafts)


def test_trained_model_accepts_and_stays_greedy_equal(make_llm):
    """The trained default model's MTP layer: real acceptance, same tokens, stop strings included."""
    plain = make_llm(None, dtype="float64", block_size=32)
    text = open("data/heldout_slice.txt").read()
    ids = plain.llm_engine.encode(text)
    prompts = [ids[i * 150: i * 150 + 60] for i in range(4)]
    params = greedy(24)
    ref = plain.generate(token_prompts(prompts), params, use_tqdm=False)
    words = [o.outputs[0].text.split() for o in ref]
    stop = next(w[len(w) // 2] for w in words if len(w) > 4)
    stopped = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    ref_stop = plain.generate(token_prompts(prompts), stopped, use_tqdm=False)
    for k in (1, 2, 3):
        llm = make_llm(None, dtype="float64", block_size=32, **spec(k))
        outs = llm.generate(token_prompts(prompts), params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
        stats = llm.llm_engine.spec_decode_stats()
        assert stats["mean_acceptance_length"] > 1.3, stats
        per_request = outs[0].spec_decode_stats
        assert per_request["num_drafts"] > 0 and per_request["num_accepted_tokens"] > 0
        got = llm.generate(token_prompts(prompts), stopped, use_tqdm=False)
        assert [(o.outputs[0].text, o.outputs[0].finish_reason) for o in got] == [
            (o.outputs[0].text, o.outputs[0].finish_reason) for o in ref_stop]


def test_invalid_speculative_configs(tiny_path):
    from deepinfer_core.entrypoints.llm import LLM

    path = tiny_path("tiny_hc1")  # rings of 8 rows (cache_layout.MIN_RING_ROWS): at most 7 drafts
    with pytest.raises(ValueError, match=r"more than this model allows \(7: .* ring of 8 rows\)"):
        LLM(str(path), block_size=16, **spec(8))
    with pytest.raises(ValueError, match="method"):
        LLM(str(path), block_size=16, speculative_config={"method": "eagle"})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(str(path), block_size=16, speculative_config={"method": "mtp", "num_speculative_tokens": 0})


def test_cli_speculative_config_flag(capsys):
    from deepinfer_core.default_model import v4_model_path
    from deepinfer_core.entrypoints import cli

    args = ["generate", "--model", str(v4_model_path()), "--json", "--temperature", "0", "--max-tokens", "6",
            "--ignore-eos", "def fibonacci(n):"]  # the trained tiny V4: its MTP layer
    assert cli.main(args) == 0
    plain = json.loads(capsys.readouterr().out)["results"][0]["outputs"][0]["token_ids"]
    spec_arg = '{"method": "mtp", "num_speculative_tokens": 2}'
    assert cli.main(args + ["--speculative-config", spec_arg]) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["outputs"][0]["token_ids"] == plain
    assert cli.main(args + ["--speculative-config", "{not json"]) == 2
    assert "--speculative-config" in capsys.readouterr().err


def test_penalised_requests_and_requests_with_logprobs_speculate(tiny_path, make_llm):
    """Penalised greedy requests verify drafts against penalised logits, and requests with logprobs get
    those of every kept token (the model's own distribution, before penalties): the tokens and logprobs
    (to float64 rounding) of an engine without speculation, next to plain greedy requests."""
    path = tiny_path("tiny")
    prompts = PROMPTS[8:13]
    params = [greedy(MAX_TOKENS, repetition_penalty=1.3), greedy(MAX_TOKENS, logprobs=2), greedy(MAX_TOKENS),
              greedy(MAX_TOKENS, presence_penalty=0.5, frequency_penalty=0.3),
              greedy(MAX_TOKENS, logprobs=0, frequency_penalty=0.8)]
    plain = make_llm(path, dtype="float64").generate(token_prompts(prompts), params, use_tqdm=False)
    llm = make_llm(path, dtype="float64", **spec(2))
    oracle_drafts(llm, reference(make_llm, path, prompts), lambda seq, m, j: (m + j) % 3 == 2)
    got = llm.generate(token_prompts(prompts), params, use_tqdm=False)
    for a, b, p in zip(plain, got, params):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        if p.logprobs is None:
            assert b.outputs[0].logprobs is None
            continue
        assert len(b.outputs[0].logprobs) == len(b.outputs[0].token_ids)
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-9 for t in x)  # other rows, other sums
        assert b.outputs[0].cumulative_logprob == pytest.approx(a.outputs[0].cumulative_logprob, abs=1e-8)
    stats = [o.spec_decode_stats for o in got]
    assert all(0 < s["num_accepted_tokens"] < s["num_draft_tokens"] for s in stats), stats


def test_sampled_verifications_give_the_logprobs_of_their_context(make_llm):
    """A sampled request with logprobs (the trained model and its drafts, temperature 0.5, a frequency
    penalty) speculates and every kept token's logprobs are the model's own distribution after the tokens
    before it: those an engine without speculation gives for each prefix of the output."""
    params = SamplingParams(temperature=0.5, seed=5, max_tokens=16, ignore_eos=True, logprobs=3,
                            frequency_penalty=0.4)
    plain = make_llm(None, dtype="float64", block_size=32)
    prompt = plain.llm_engine.encode(open("data/heldout_slice.txt").read())[:40]
    llm = make_llm(None, dtype="float64", block_size=32, **spec(3))
    out = llm.generate(token_prompts([prompt]), params, use_tqdm=False)[0]
    tokens, logprobs = out.outputs[0].token_ids, out.outputs[0].logprobs
    assert out.spec_decode_stats["num_accepted_tokens"] > 0 and len(logprobs) == len(tokens)
    probe = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=3)
    prefixes = [prompt + tokens[:j] for j in range(len(tokens))]
    want = [o.outputs[0].logprobs[0] for o in plain.generate(token_prompts(prefixes), probe, use_tqdm=False)]
    for j, (got, top) in enumerate(zip(logprobs, want)):
        top3 = sorted(top, key=lambda t: -top[t])[:3]
        assert set(got) == set(top3) | {tokens[j]}, j
        assert all(abs(got[t] - top[t]) < 1e-9 for t in top3), j

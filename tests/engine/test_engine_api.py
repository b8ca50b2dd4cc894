"""The offline API (LLM.generate / LLM.stream / RequestOutput) and how it handles bad input."""

from __future__ import annotations

import re
import threading

import engine_fixtures
import pytest
import torch
from engine_fixtures import assert_drained, check_every_step, greedy, make_prompt, run_tokens, token_prompts

from deepinfer_core.entrypoints.llm import LLM
from deepinfer_core.outputs import CompletionOutput, RequestOutput
from deepinfer_core.plugins import PluginError
from deepinfer_core.sampling.params import RequestOutputKind, SamplingParams

# the shared fixtures, bound here so that pytest finds them in this module
make_llm = engine_fixtures.make_llm
one_torch_thread = engine_fixtures.one_torch_thread
tiny_path = engine_fixtures.tiny_path

VOCAB = 384
PROMPTS = [make_prompt(n, seed=300 + i) for i, n in enumerate([4, 13, 29])]


@pytest.fixture(scope="module")
def llm(tiny_path):
    llm = LLM(str(tiny_path("tiny")), block_size=16, dtype="float64", max_model_len=64)
    check_every_step(llm.llm_engine)
    return llm


@pytest.fixture(autouse=True)
def _drained_after(request):
    yield
    if "llm" in request.fixturenames:
        assert_drained(request.getfixturevalue("llm").llm_engine)


def default_llm(**kw) -> LLM:
    """``LLM(model=None)`` (``make_llm(None)`` is the trained tiny V4), checked every step."""
    llm = LLM(None, **kw)
    check_every_step(llm.llm_engine)
    return llm


def test_default_model_is_embedded(make_llm):
    """model=None is the trained tiny DeepSeek-V4.1 shipped with the package (nothing downloaded)."""
    from deepinfer_core.default_model import EMBEDDED_MODEL

    default = default_llm(dtype="float64", block_size=128)
    assert default.llm_engine.model_config.path == EMBEDDED_MODEL
    assert default.llm_engine.model_config.hf_config.model_type == "deepseek_v41"
    out = default.generate("def fibonacci(n):", greedy(6), use_tqdm=False)[0]
    assert out.finished and out.error is None and len(out.outputs[0].token_ids) == 6
    assert out.prompt == "def fibonacci(n):" and out.prompt_token_ids
    explicit = make_llm(EMBEDDED_MODEL, dtype="float64", block_size=128)
    assert run_tokens(explicit, [out.prompt_token_ids], greedy(6)) == [out.outputs[0].token_ids]


def test_random_default_is_built_when_nothing_is_shipped(tmp_path_factory, monkeypatch, make_llm, tiny_path):
    """Without the shipped folder the default is the random tiny config with seed 0, built into the cache."""
    from deepinfer_core import default_model

    monkeypatch.setenv("DEEPINFER_CACHE", str(tmp_path_factory.mktemp("deepinfer_cache")))
    monkeypatch.setattr(default_model, "EMBEDDED_MODEL", tmp_path_factory.mktemp("stripped") / "none")
    default = default_llm(dtype="float64", block_size=engine_fixtures.BLOCK_SIZE)
    out = default.generate("def fibonacci(n):", greedy(6), use_tqdm=False)[0]
    assert all(0 <= t < VOCAB for t in out.outputs[0].token_ids)
    tiny = make_llm(tiny_path("tiny"), dtype="float64")
    assert run_tokens(tiny, [PROMPTS[0]], greedy(6)) == run_tokens(default, [PROMPTS[0]], greedy(6))


def test_string_and_token_id_prompts(llm):
    tok = llm.get_tokenizer()
    text = "print(i, \"is even\")"
    ids = tok.encode(text, add_special_tokens=True)
    outs = llm.generate([text, {"prompt_token_ids": ids}, ids], greedy(5), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[1:]] == [outs[0].outputs[0].token_ids] * 2
    assert outs[0].prompt == text and outs[0].prompt_token_ids == ids
    assert outs[1].prompt is None and outs[1].prompt_token_ids == ids
    # a single prompt (not in a list) gives a one-element list
    single = llm.generate(text, greedy(5), use_tqdm=False)
    assert len(single) == 1 and single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    both = llm.generate({"prompt": text, "prompt_token_ids": ids}, greedy(5), use_tqdm=False)[0]
    assert both.prompt == text and both.outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_request_output_fields(llm):
    tok = llm.get_tokenizer()
    params = [greedy(4, logprobs=2), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)]
    outs = llm.generate(token_prompts(PROMPTS[:2]), params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == PROMPTS[:2]
    assert len({o.request_id for o in outs}) == 2
    for out, p in zip(outs, params):
        assert isinstance(out, RequestOutput) and out.finished and out.error is None
        assert len(out.outputs) == 1
        comp = out.outputs[0]
        assert isinstance(comp, CompletionOutput) and comp.index == 0 and comp.finished()
        assert len(comp.token_ids) == p.max_tokens and comp.finish_reason == "length"
        assert comp.text == tok.decode(comp.token_ids, skip_special_tokens=True)
    lp = outs[0].outputs[0].logprobs
    assert len(lp) == 4 and all(t in d and len(d) in (2, 3) for t, d in zip(outs[0].outputs[0].token_ids, lp))
    assert outs[0].outputs[0].cumulative_logprob < 0
    assert outs[1].outputs[0].logprobs is None and outs[1].outputs[0].cumulative_logprob is None


def test_tqdm_bar_only_when_asked(llm, capsys):
    llm.generate(token_prompts(PROMPTS[:1]), greedy(2), use_tqdm=False)
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""
    llm.generate(token_prompts(PROMPTS[:1]), greedy(2), use_tqdm=True)
    assert "generating" in capsys.readouterr().err


def test_stream_yields_growing_outputs(llm):
    expected = run_tokens(llm, [PROMPTS[1]], greedy(6))[0]
    seen = list(llm.stream({"prompt_token_ids": PROMPTS[1]}, greedy(6)))
    lengths = [len(o.outputs[0].token_ids) for o in seen]
    assert lengths == sorted(lengths) and lengths[-1] == 6 and len(seen) >= 6
    for out in seen:
        assert out.outputs[0].token_ids == expected[: len(out.outputs[0].token_ids)]
    assert [o.finished for o in seen] == [False] * (len(seen) - 1) + [True]
    assert seen[-1].outputs[0].finish_reason == "length"


def test_stream_text_only_grows(llm):
    """Text ending in an incomplete UTF-8 character is held back until the character is complete, so
    every streamed text is a prefix of the final one."""
    tok = llm.get_tokenizer()
    g = run_tokens(llm, [PROMPTS[0]], greedy(12))[0]
    partial = [tok.decode(g[:k], skip_special_tokens=True) for k in range(1, 12)]
    assert any(t.endswith("\ufffd") for t in partial), "this prompt should produce a split character"
    seen = [o.outputs[0].text for o in llm.stream({"prompt_token_ids": PROMPTS[0]}, greedy(12))]
    assert seen[-1] == tok.decode(g, skip_special_tokens=True)
    for text in seen[:-1]:
        assert seen[-1].startswith(text) and not text.endswith("\ufffd")


def test_stream_closed_early_aborts_its_request(llm):
    stream = llm.stream({"prompt_token_ids": PROMPTS[2]}, greedy(20))
    first = next(stream)
    assert not first.finished
    stream.close()
    assert not llm.llm_engine.has_unfinished_requests()


def test_generate_from_several_threads_gives_each_its_sequential_outputs(llm):
    """Calls from several threads are serialised (each runs whole, as if alone): every thread gets the
    outputs a sequential run gives, seeded sampling included, and a stream beside them keeps its own."""
    prompts = [[make_prompt(n, seed=400 + 10 * t + i) for i, n in enumerate([6, 17, 11])] for t in range(3)]
    params = [greedy(8), SamplingParams(temperature=0.9, seed=7, max_tokens=8, ignore_eos=True), greedy(8)]
    expected = [run_tokens(llm, ps, params) for ps in prompts]
    streamed = run_tokens(llm, [PROMPTS[2]], greedy(12))[0]
    rounds, start = 3, threading.Barrier(len(prompts) + 1)
    got: dict[int, list] = {}
    errors: list[BaseException] = []

    def call(t: int) -> None:
        try:
            start.wait()
            for _ in range(rounds):  # another thread's call may run between two of these
                outs = llm.generate(token_prompts(prompts[t]), params, use_tqdm=False)
                got.setdefault(t, []).append([o.outputs[0].token_ids for o in outs])
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    def stream() -> None:
        try:
            start.wait()
            got[-1] = [list(llm.stream({"prompt_token_ids": PROMPTS[2]}, greedy(12)))[-1].outputs[0].token_ids]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(t,)) for t in range(len(prompts))]
    threads.append(threading.Thread(target=stream))
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not errors, errors
    assert all(got[t] == [expected[t]] * rounds for t in range(len(prompts)))
    assert got[-1] == [streamed]


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"prompt_token_ids": []}, "empty"),
        ({"prompt_token_ids": [5] * 64}, "max_model_len"),
        ({"prompt_token_ids": [3, VOCAB, 7]}, "vocabulary"),
        ({"prompt_token_ids": [3, -1]}, "vocabulary"),
        ({"nothing": 1}, "prompt"),
    ],
    ids=["empty", "too-long", "past-vocab", "negative", "bad-dict"],
)
def test_bad_prompt_raises_naming_its_index_before_anything_runs(llm, bad, message):
    """vLLM's behaviour: an invalid prompt raises ValueError, naming it, and nothing of the call runs or
    stays queued (the prompts before it are aborted); the engine then serves the next call as before."""
    alone = run_tokens(llm, PROMPTS[:2], greedy(5))
    engine = llm.llm_engine
    steps = engine.step
    engine.step = lambda: pytest.fail("a step ran although a prompt of the call was invalid")
    try:
        with pytest.raises(ValueError, match=rf"^prompt 1: .*{message}"):
            llm.generate([token_prompts(PROMPTS[:1])[0], bad, token_prompts(PROMPTS[1:2])[0]], greedy(5),
                         use_tqdm=False)
    finally:
        engine.step = steps
    assert not engine.has_unfinished_requests() and not engine.requests and not llm._router.queues
    assert run_tokens(llm, PROMPTS[:2], greedy(5)) == alone


def test_final_only_requests_are_reported_once_when_they_end(llm):
    """``output_kind=FINAL_ONLY`` (what ``generate`` asks for: it returns final outputs only): the engine
    builds no output for the request until it ends, then the cumulative one; a default request beside it
    is reported after every step."""
    engine = llm.llm_engine
    ref = run_tokens(llm, PROMPTS[:2], greedy(6))
    final = greedy(6, output_kind=RequestOutputKind.FINAL_ONLY)
    engine.add_request("final", {"prompt_token_ids": PROMPTS[0]}, final)
    engine.add_request("every", {"prompt_token_ids": PROMPTS[1]}, greedy(6))
    seen: dict[str, list] = {"final": [], "every": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert [o.finished for o in seen["final"]] == [True]
    assert seen["final"][0].outputs[0].token_ids == ref[0]
    assert len(seen["every"]) >= 6 and seen["every"][-1].outputs[0].token_ids == ref[1]
    passed = greedy(3)
    llm.generate(token_prompts(PROMPTS[:1]), passed, use_tqdm=False)
    assert passed.output_kind is RequestOutputKind.CUMULATIVE  # the caller's params are left as they were


@pytest.mark.parametrize("end", ["length", "stop-string", "stop-token"])
def test_final_only_text_is_the_streamed_text(llm, end):
    """A final-only request without stop strings decodes its text once, at the end; with them, as it goes.
    Either way its text, tokens and finish are those of the request reported after every step."""
    params = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
    if end == "stop-string":
        params["stop"] = ["e"]
    elif end == "stop-token":  # the fifth token of the first prompt's output
        first = llm.generate(token_prompts(PROMPTS[:1]), SamplingParams(**params), use_tqdm=False)
        params["stop_token_ids"] = [first[0].outputs[0].token_ids[4]]
    every = llm.generate(token_prompts(PROMPTS), SamplingParams(**params), use_tqdm=False)
    streamed = [list(llm.stream({"prompt_token_ids": p}, SamplingParams(**params)))[-1] for p in PROMPTS]
    for a, b in zip(every, streamed):
        assert (a.outputs[0].text, a.outputs[0].token_ids, a.outputs[0].finish_reason) == (
            b.outputs[0].text, b.outputs[0].token_ids, b.outputs[0].finish_reason)
    assert all(o.outputs[0].text for o in every)
    assert any(o.outputs[0].finish_reason == "stop" for o in every) == (end != "length")


def test_invalid_sampling_params_raise():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-0.5)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="final")


def test_mismatched_sampling_params_list_raises(llm):
    with pytest.raises(ValueError, match="sampling params"):
        llm.generate(token_prompts(PROMPTS[:2]), [greedy(2)], use_tqdm=False)


def test_stop_token_outside_vocabulary_raises(llm):
    with pytest.raises(ValueError, match="^prompt 0: stop_token_ids"):
        llm.generate(token_prompts(PROMPTS[:1]), greedy(2, stop_token_ids=[VOCAB + 5]), use_tqdm=False)


def test_unknown_backend_is_named(tiny_path):
    with pytest.raises(PluginError, match="no_such_backend"):
        LLM(str(tiny_path("tiny")), backend="no_such_backend")


def test_model_folder_without_config(tmp_path):
    folder = tmp_path / "empty_model"
    folder.mkdir()
    with pytest.raises(FileNotFoundError, match="empty_model"):
        LLM(str(folder))
    with pytest.raises(FileNotFoundError, match="missing_folder"):
        LLM(str(tmp_path / "missing_folder"))


def test_unknown_engine_argument(tiny_path):
    with pytest.raises(TypeError, match="no_such_option"):
        LLM(str(tiny_path("tiny")), no_such_option=3)


@pytest.mark.parametrize("name", ["max_num_batched_tokens", "max_num_seqs", "block_size"])
def test_nonpositive_engine_sizes_raise(tiny_path, name):
    with pytest.raises(ValueError, match=name):
        LLM(str(tiny_path("tiny")), **{name: 0})


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64", torch.float32])
def test_dtypes_generate(make_llm, tiny_path, dtype):
    llm = make_llm(tiny_path("tiny"), dtype=dtype)
    outs = run_tokens(llm, PROMPTS[:2], greedy(4))
    assert all(len(t) == 4 and all(isinstance(x, int) and 0 <= x < VOCAB for x in t) for t in outs)
    if dtype in ("float32", torch.float32):  # near float64 on a tiny model: same greedy tokens
        ref = make_llm(tiny_path("tiny"), dtype="float64")
        assert run_tokens(ref, PROMPTS[:2], greedy(4)) == outs


def test_sequence_that_never_fits_ends_with_error(make_llm, tiny_path):
    # 3 compressed blocks of 16 tokens: a 60-token prompt can never be held, short ones can
    llm = make_llm(tiny_path("tiny"), dtype="float64", num_blocks=3, num_window_blocks=6)
    long_prompt = make_prompt(60, seed=7)
    outs = llm.generate(token_prompts([PROMPTS[0], long_prompt, PROMPTS[1]]), greedy(5), use_tqdm=False)
    assert outs[1].finished and outs[1].outputs[0].finish_reason == "error"
    assert outs[1].error and "pool" in outs[1].error
    alone = run_tokens(make_llm(tiny_path("tiny"), dtype="float64"), PROMPTS[:2], greedy(5))
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == alone
    assert all(o.outputs[0].finish_reason == "length" for o in (outs[0], outs[2]))


def test_growing_past_the_pools_ends_with_error_keeping_tokens(make_llm, tiny_path):
    # 2 blocks = 32 tokens of KV: a 28-token prompt fits; 5 tokens are sampled (the 5th from the KV of
    # position 31), then computing position 32 needs a third block and the request ends in an error
    llm = make_llm(tiny_path("tiny"), dtype="float64", num_blocks=2, num_window_blocks=4)
    prompt = make_prompt(28, seed=8)
    out = llm.generate(token_prompts([prompt]), greedy(10), use_tqdm=False)[0]
    comp = out.outputs[0]
    assert comp.finish_reason == "error" and out.error and len(comp.token_ids) == 32 - 28 + 1
    roomy = make_llm(tiny_path("tiny"), dtype="float64")
    assert run_tokens(roomy, [prompt], greedy(5))[0] == comp.token_ids
    assert comp.text == llm.get_tokenizer().decode(comp.token_ids, skip_special_tokens=True)  # decoded at the end


def test_prompt_longer_than_token_budget_without_chunked_prefill(make_llm, tiny_path):
    """Without chunked prefill a prompt must fit one step: a longer one is refused, not left waiting."""
    llm = make_llm(tiny_path("tiny"), dtype="float64", enable_chunked_prefill=False,
                   max_num_batched_tokens=16)
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        engine.add_request(None, {"prompt_token_ids": make_prompt(17, seed=9)}, greedy(3))
    with pytest.raises(ValueError, match="^prompt 0: .*max_num_batched_tokens"):
        llm.generate(token_prompts([make_prompt(17, seed=9), PROMPTS[1]]), greedy(3), use_tqdm=False)


def test_max_model_len_ends_with_length(llm):
    # max_model_len is 64: a 60-token prompt has room for 4 tokens, which max_tokens=None asks for
    out = llm.generate(token_prompts([make_prompt(60, seed=10)]), greedy(None), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"
    assert run_tokens(llm, [make_prompt(60, seed=10)], greedy(4)) == [out.outputs[0].token_ids]


@pytest.mark.parametrize("params, message", [
    (greedy(5), "max_tokens is 5, but max_model_len is 64 and the prompt has 60 tokens: at most 4"),
    (greedy(10**9), "max_tokens is 1000000000"),
    (greedy(4, n=65), "n is 65, more than the 64 sequences that run at once"),
], ids=["past-the-context", "huge", "n-past-max_num_seqs"])
def test_limits_on_max_tokens_and_n_raise(llm, params, message):
    """max_tokens beyond what the context holds beside the prompt, and n beyond max_num_seqs, are refused
    (vLLM's server answers 400 to the first), before anything runs."""
    with pytest.raises(ValueError, match=rf"^prompt 1: {re.escape(message)}"):
        llm.generate(token_prompts([PROMPTS[0], make_prompt(60, seed=10)]), [greedy(4), params], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_max_model_len_beyond_the_model_raises(tiny_path):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(str(tiny_path("tiny")), block_size=16, max_model_len=10**6)


def test_interrupted_generate_releases_everything(llm, monkeypatch):
    engine = llm.llm_engine
    step, calls = engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(engine, "step", failing_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(token_prompts(PROMPTS), greedy(8), use_tqdm=False)
    assert_drained(engine)  # the unfinished requests were aborted and their memory returned
    monkeypatch.undo()
    assert run_tokens(llm, PROMPTS[:1], greedy(2))


def test_generate_many_calls_reuse_the_engine(llm):
    a = run_tokens(llm, PROMPTS, greedy(3))
    b = run_tokens(llm, list(reversed(PROMPTS)), greedy(3))
    assert a == list(reversed(b))


def test_add_request_rejects_duplicate_ids(llm):
    engine = llm.llm_engine
    engine.add_request("dup", {"prompt_token_ids": PROMPTS[0]}, greedy(1))
    with pytest.raises(ValueError, match="dup"):
        engine.add_request("dup", {"prompt_token_ids": PROMPTS[0]}, greedy(1))
    engine.abort_request("dup")
    assert not engine.has_unfinished_requests()


def test_checkpoint_path_may_be_a_path_object(tiny_path):
    llm = LLM(tiny_path("tiny"), block_size=16)
    out = llm.generate(token_prompts(PROMPTS[:1]), greedy(2), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2
    assert_drained(llm.llm_engine)

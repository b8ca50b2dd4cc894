"""Structured output (xgrammar): every constraint kind yields valid text from the tiny random model.

The model's preferences do not matter: the grammar mask leaves it only valid continuations, and a
bounded grammar (enums, bounded integers, length-limited patterns, finite EBNF, choices) must end
within ``max_tokens``. A constraint that does not compile is refused when its request is added
(``generate`` raises naming the prompt, nothing runs); a request whose grammar reaches a state no token
can satisfy ends alone with ``finish_reason="error"``. Engine runs that compare batches use
``batch_invariant=True``, so "identical" means bit-identical.

Tests that need xgrammar are skipped when it is not installed (``pip install 'deepinfer[structured]'``).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable

import engine_fixtures
import pytest
import torch
from engine_fixtures import make_prompt, token_prompts

from deepinfer_core.entrypoints.llm import LLM
from deepinfer_core.sampling.params import SamplingParams, StructuredOutputsParams
from deepinfer_core.sampling.structured import StructuredOutputManager, choice_grammar, pack_bitmask

make_llm = engine_fixtures.make_llm
one_torch_thread = engine_fixtures.one_torch_thread
tiny_path = engine_fixtures.tiny_path



def _xgrammar_problem() -> str | None:
    """Why xgrammar cannot be used here (None: it can)."""
    try:
        import xgrammar  # noqa: F401
    except Exception as exc:  # missing, or installed without a dependency (e.g. pydantic)
        return f"{type(exc).__name__}: {exc}"
    return None


XGRAMMAR_PROBLEM = _xgrammar_problem()
needs_xgrammar = pytest.mark.skipif(
    XGRAMMAR_PROBLEM is not None,
    reason=f"xgrammar is not importable ({XGRAMMAR_PROBLEM}); it is the optional extra "
    "'deepinfer[structured]': the structured-output generation tests are skipped",
)
EOS = 1

# --- constraints and their independent validators ----------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tag": {"enum": ["red", "green", "blue"]},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
    },
    "required": ["name", "age", "ok", "tag"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)"
EBNF = r"""
root ::= greeting " " name ("!" | ".")
greeting ::= "hi" | "hello"
name ::= [a-z] [a-z]? [a-z]? [a-z]?
"""
EBNF_AS_REGEX = r"(hi|hello) [a-z]{1,4}[!.]"
CHOICES = ["yes", "no", "maybe so", 'say "hi"']


def validate_schema(value, schema) -> None:
    """A small JSON-schema validator for the keywords used here (independent of xgrammar)."""
    if "enum" in schema:
        assert value in schema["enum"], value
        return
    kind = schema["type"]
    if kind == "object":
        assert isinstance(value, dict), value
        props = schema.get("properties", {})
        assert set(schema.get("required", [])) <= set(value), value
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(props), value
        for key, sub in props.items():
            if key in value:
                validate_schema(value[key], sub)
    elif kind == "array":
        assert isinstance(value, list) and len(value) <= schema.get("maxItems", len(value)), value
        for item in value:
            validate_schema(item, schema["items"])
    elif kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), value
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value), value
    elif kind == "boolean":
        assert isinstance(value, bool), value
    elif kind == "string":
        assert isinstance(value, str), value
        if "pattern" in schema:
            assert re.search(schema["pattern"], value), value
    else:
        raise AssertionError(f"validator does not know {kind}")


def check_json_schema(text: str) -> None:
    validate_schema(json.loads(text), SCHEMA)  # strict: control characters inside strings are invalid


def check_json_object(text: str) -> None:
    assert isinstance(json.loads(text), dict), text


def fullmatch(pattern: str) -> Callable[[str], None]:
    def check(text: str) -> None:
        assert re.fullmatch(pattern, text), (pattern, text)

    return check


def check_choice(text: str) -> None:
    assert text in CHOICES, text


CASES = {
    "json_schema": (StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), check_json_schema),
    "json_schema_string_any_whitespace": (StructuredOutputsParams(json=json.dumps(SCHEMA)), check_json_schema),
    "json_object": (StructuredOutputsParams(json_object=True, disable_any_whitespace=True), check_json_object),
    "regex": (StructuredOutputsParams(regex=REGEX), fullmatch(REGEX)),
    "grammar": (StructuredOutputsParams(grammar=EBNF), fullmatch(EBNF_AS_REGEX)),
    "choice": (StructuredOutputsParams(choice=CHOICES), check_choice),
}
PROMPTS = [make_prompt(n, seed=700 + i) for i, n in enumerate([4, 19, 33])]

# --- parameters (no xgrammar needed) ---------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [dict(), dict(json={}, regex="a"), dict(choice=[]), dict(choice=["a", 3]), dict(regex=5), dict(grammar=" "),
     dict(json_object=True, choice=["a"]), dict(json=7)],
    ids=repr,
)
def test_invalid_structured_outputs_params(kwargs):
    with pytest.raises(ValueError, match="StructuredOutputsParams"):
        StructuredOutputsParams(**kwargs)


def test_structured_outputs_params_normalise_and_key():
    a = StructuredOutputsParams(json={"b": 1, "a": 2})
    b = StructuredOutputsParams(json={"a": 2, "b": 1})
    assert a.kind == "json" and a.key() == b.key()
    assert StructuredOutputsParams(choice=("x", "y")).choice == ["x", "y"]
    p = SamplingParams(structured_outputs={"regex": "[0-9]+"})
    assert isinstance(p.structured_outputs, StructuredOutputsParams) and p.structured_outputs.kind == "regex"
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs="[0-9]+")


def test_choice_grammar_escapes_literals():
    assert choice_grammar(['a"b', "c\\d", "e\nf"]) == r'root ::= "a\"b" | "c\\d" | "e\nf"'


def test_pack_bitmask_matches_the_apply_token_bitmask_layout():
    from deepinfer_cpu_ref.ops import apply_token_bitmask

    allowed = torch.rand(3, 100, generator=torch.Generator().manual_seed(0)) < 0.5
    masked = apply_token_bitmask(torch.zeros(3, 100), pack_bitmask(allowed))
    assert torch.equal(masked == 0, allowed)


def test_without_xgrammar_a_structured_request_raises_naming_the_install(tiny_path, make_llm, monkeypatch):
    llm = make_llm(tiny_path("tiny"))
    engine = llm.llm_engine
    engine.structured = StructuredOutputManager(engine.tokenizer, 384, [EOS])  # nothing imported yet
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar -> ImportError
    params = [SamplingParams(temperature=0, max_tokens=4),
              SamplingParams(temperature=0, max_tokens=4, structured_outputs=StructuredOutputsParams(regex="a+"))]
    with pytest.raises(ValueError, match="^prompt 1: .*pip install"):
        llm.generate(token_prompts(PROMPTS[:2]), params, use_tqdm=False)
    out = llm.generate(token_prompts(PROMPTS[:1]), params[0], use_tqdm=False)[0]
    assert out.error is None and len(out.outputs[0].token_ids) == 4


# --- generation -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_path):
    llm = LLM(str(tiny_path("tiny")), block_size=16, batch_invariant=True)
    engine_fixtures.check_every_step(llm.llm_engine)
    return llm


@needs_xgrammar
@pytest.mark.parametrize("case", sorted(CASES))
def test_generated_text_is_valid(llm, case):
    constraint, check = CASES[case]
    settings, max_tokens = [(0.0, None), (0.8, 1), (1.5, 2)], 160
    if case in ("json_object", "json_schema_string_any_whitespace"):
        # unbounded (strings of any length, free whitespace): greedy may never close; sampled runs do
        settings, max_tokens = [(1.2, 0), (1.2, 1), (1.2, 2)], 400
    params = [SamplingParams(temperature=t, seed=s, max_tokens=max_tokens, structured_outputs=constraint)
              for t, s in settings]
    outs = llm.generate(token_prompts(PROMPTS), params, use_tqdm=False)
    engine_fixtures.assert_drained(llm.llm_engine)
    for out in outs:
        comp = out.outputs[0]
        assert out.error is None and comp.finish_reason == "stop", (case, comp)
        assert comp.token_ids[-1] == EOS  # the matcher terminated on the end-of-sequence token
        check(comp.text)


@needs_xgrammar
def test_each_of_n_samples_has_its_own_matcher(llm):
    params = SamplingParams(n=4, temperature=1.5, seed=8, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(grammar=EBNF))
    out = llm.generate(token_prompts(PROMPTS[:1]), params, use_tqdm=False)[0]
    assert len(out.outputs) == 4 and len({c.text for c in out.outputs}) > 1
    for comp in out.outputs:
        assert comp.finish_reason == "stop"
        fullmatch(EBNF_AS_REGEX)(comp.text)


@needs_xgrammar
def test_matcher_termination_stops_even_with_ignore_eos(llm):
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=100, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(choice=CHOICES))
    comp = llm.generate(token_prompts(PROMPTS[:1]), params, use_tqdm=False)[0].outputs[0]
    assert comp.finish_reason == "stop" and comp.stop_reason is None
    assert comp.token_ids[-1] == EOS and comp.text in CHOICES


@needs_xgrammar
def test_logprobs_are_those_of_the_constrained_distribution(llm):
    params = SamplingParams(temperature=0.0, max_tokens=20, logprobs=3,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    comp = llm.generate(token_prompts(PROMPTS[:1]), params, use_tqdm=False)[0].outputs[0]
    first = comp.logprobs[0]
    allowed = {t for t in range(384) if llm.get_tokenizer().decode([t]) in ("y", "ye", "yes", "n", "no")}
    finite = {t for t, v in first.items() if v > float("-inf")}
    assert finite and finite <= allowed
    assert sum(torch.tensor(v).exp().item() for v in first.values() if v > float("-inf")) <= 1 + 1e-6


@needs_xgrammar
def test_bitmask_goes_through_the_backend_op(llm):
    ops = llm.llm_engine.model.ops
    original, calls = ops.apply_token_bitmask, []

    def counted(logits, bitmask):
        calls.append(tuple(bitmask.shape))
        return original(logits, bitmask)

    ops.apply_token_bitmask = counted
    try:
        constrained = StructuredOutputsParams(regex="[ab]+")
        params = [SamplingParams(temperature=0, max_tokens=8, structured_outputs=constrained),
                  SamplingParams(temperature=0, max_tokens=8)]
        llm.generate(token_prompts(PROMPTS[:2]), params, use_tqdm=False)
    finally:
        ops.apply_token_bitmask = original
    assert calls and all(shape[1] == (384 + 31) // 32 for shape in calls)


@needs_xgrammar
@pytest.mark.parametrize(
    "bad, fragment",
    [(StructuredOutputsParams(regex="a(b"), "regex"),
     (StructuredOutputsParams(json='{"type": "nonsense"}'), "json"),
     # schema_syntax (slow): another JSON failure, refused as schema_type's is
     pytest.param(StructuredOutputsParams(json="{not json"), "json", marks=pytest.mark.slow),
     (StructuredOutputsParams(grammar="root ::= undefined"), "grammar")],
    ids=["regex", "schema_type", "schema_syntax", "ebnf"],
)
def test_a_failing_grammar_raises_naming_its_prompt(llm, bad, fragment):
    """A constraint that does not compile is refused when its prompt is added: ``generate`` raises naming
    the prompt before anything runs, and the engine serves the next call as before."""
    good = [SamplingParams(temperature=0.8, seed=i, max_tokens=40, structured_outputs=CASES[c][0])
            for i, c in enumerate(["regex", "json_schema"])] + [SamplingParams(temperature=0.7, seed=9, max_tokens=12)]
    baseline = llm.generate(token_prompts(PROMPTS), good, use_tqdm=False)
    with pytest.raises(ValueError, match=rf"^prompt 1: .*\({fragment}\)"):
        llm.generate(token_prompts(PROMPTS[:2]), [good[0], SamplingParams(structured_outputs=bad)], use_tqdm=False)
    engine_fixtures.assert_drained(llm.llm_engine)
    again = llm.generate(token_prompts(PROMPTS), good, use_tqdm=False)
    for a, b in zip(baseline, again):
        assert b.error is None
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and a.outputs[0].text == b.outputs[0].text


@needs_xgrammar
def test_compiled_grammars_are_cached(llm):
    manager = llm.llm_engine.structured
    constraint = StructuredOutputsParams(regex="[xyz]{2,4}")
    before = dict(manager.stats)
    params = SamplingParams(temperature=0.9, seed=4, max_tokens=10, structured_outputs=constraint)
    llm.generate(token_prompts(PROMPTS), params, use_tqdm=False)
    assert manager.stats["compiled"] == before["compiled"] + 1
    assert manager.stats["cache_hits"] == before["cache_hits"] + len(PROMPTS) - 1
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(("))
    for _ in range(2):
        with pytest.raises(ValueError, match="regex"):
            llm.generate(token_prompts(PROMPTS[:1]), bad, use_tqdm=False)
    assert manager.stats["failed"] == before["failed"] + 1  # the failure is remembered too


@needs_xgrammar
def test_impossible_state_ends_that_request_alone(llm):
    """After the choice only end-of-sequence fits the grammar, but min_tokens bans it: that request ends
    with an error; the others' outputs are bit-identical to a run without it."""
    stuck = SamplingParams(temperature=0, max_tokens=20, min_tokens=10,
                           structured_outputs=StructuredOutputsParams(choice=["no"]))
    others = [SamplingParams(temperature=0.7, seed=5, max_tokens=10, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.9, seed=6, max_tokens=60, structured_outputs=CASES["json_schema"][0])]
    baseline = llm.generate(token_prompts(PROMPTS[1:]), others, use_tqdm=False)
    outs = llm.generate(token_prompts(PROMPTS), [stuck, *others], use_tqdm=False)
    comp = outs[0].outputs[0]
    assert comp.finish_reason == "error" and comp.text == "no"
    assert "no token satisfies the grammar" in outs[0].error
    for a, b in zip(baseline, outs[1:]):
        assert b.error is None
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and a.outputs[0].logprobs == b.outputs[0].logprobs


@needs_xgrammar
def test_structured_output_survives_preemption_and_chunked_prefill(tiny_path, make_llm):
    """Recompute after preemption keeps the tokens and samples only the next one, so the matcher (which
    accepted exactly the kept tokens) goes on: outputs equal a roomy run's, and stay valid."""
    prompts = [make_prompt(n, seed=800 + i) for i, n in enumerate([40, 7, 25, 33, 12, 50])]
    params = [SamplingParams(temperature=0.9, seed=i, max_tokens=60, structured_outputs=CASES[c][0])
              for i, c in enumerate(["json_schema", "regex", "grammar", "json_object", "choice", "json_schema"])]
    roomy = make_llm(tiny_path("tiny"), batch_invariant=True).generate(token_prompts(prompts), params, use_tqdm=False)
    tight_llm = make_llm(tiny_path("tiny"), batch_invariant=True, num_blocks=20, num_window_blocks=4,
                         max_num_batched_tokens=16)
    tight = tight_llm.generate(token_prompts(prompts), params, use_tqdm=False)
    assert tight_llm.llm_engine.scheduler.num_preemptions > 0
    for a, b, p in zip(roomy, tight, params):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and b.error is None
        if b.outputs[0].finish_reason == "stop":
            name = next(c for c in CASES if CASES[c][0] is p.structured_outputs)
            CASES[name][1](b.outputs[0].text)


@needs_xgrammar
@pytest.mark.parametrize("k", [1, 3])
def test_speculation_masks_every_verified_position_by_the_grammar(tiny_path, make_llm, k):
    """Grammar requests speculate: a verification's row j is masked by the grammar after its drafts before
    j (drafts from the first one the grammar rejects on are not verified). Drafts are the greedy
    constrained output with some replaced by other tokens (some invalid): greedy outputs equal those
    without speculation, next to an unconstrained request, and are valid; sampled ones are valid."""
    from spec_fixtures import oracle_drafts, spec

    path = tiny_path("tiny")
    cases = ["json_schema", "regex", "grammar", "choice"]
    prompts = [make_prompt(n, seed=900 + i) for i, n in enumerate([5, 12, 20, 9, 30])]
    params = [SamplingParams(temperature=0.0, max_tokens=160, structured_outputs=CASES[c][0]) for c in cases]
    params.append(SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    plain = make_llm(path, dtype="float64")
    ref = plain.generate(token_prompts(prompts), params, use_tqdm=False)
    llm = make_llm(path, dtype="float64", **spec(k))
    oracle_drafts(llm, {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, ref)},
                  lambda seq, m, j: (m + 2 * j) % 5 == 3)
    outs = llm.generate(token_prompts(prompts), params, use_tqdm=False)
    engine_fixtures.assert_drained(llm.llm_engine)
    for a, b, case in zip(ref, outs, cases + [None]):
        assert b.error is None and a.outputs[0].token_ids == b.outputs[0].token_ids, case
        if case is not None:
            assert b.outputs[0].finish_reason == "stop"
            CASES[case][1](b.outputs[0].text)
    stats = [o.spec_decode_stats for o in outs]
    assert all(0 < s["num_accepted_tokens"] <= s["num_draft_tokens"] for s in stats), stats
    assert sum(s["num_accepted_tokens"] < s["num_draft_tokens"] for s in stats) >= 2, stats
    sampled = [SamplingParams(temperature=0.9, seed=i, max_tokens=160, structured_outputs=CASES[c][0])
               for i, c in enumerate(cases)]
    for out, case in zip(llm.generate(token_prompts(prompts[:4]), sampled, use_tqdm=False), cases):
        assert out.error is None and out.outputs[0].finish_reason == "stop", case
        CASES[case][1](out.outputs[0].text)


@needs_xgrammar
def test_drafts_the_grammar_rejects_are_not_verified(tiny_path, make_llm):
    """A draft the grammar rejects would be rejected by its row's mask: it and the drafts after it are not
    verified at all. The outputs and the accepted drafts are those of verifying them; fewer drafts are
    verified, and every one verified is one the grammar allowed."""
    from spec_fixtures import oracle_drafts, spec

    from deepinfer_core.sampling.structured import GrammarState

    path = tiny_path("tiny")
    cases = ["json_schema", "regex", "grammar", "choice"]
    prompts = [make_prompt(n, seed=900 + i) for i, n in enumerate([5, 12, 20, 9])]
    params = [SamplingParams(temperature=0.0, max_tokens=160, structured_outputs=CASES[c][0]) for c in cases]
    ref = make_llm(path, dtype="float64").generate(token_prompts(prompts), params, use_tqdm=False)
    ref_tokens = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, ref)}

    def run(check: bool):
        llm = make_llm(path, dtype="float64", **spec(3))
        oracle_drafts(llm, ref_tokens, lambda seq, m, j: (m + 2 * j) % 5 == 3)
        engine, verified = llm.llm_engine, []
        execute = engine.runner.execute_model

        def checked(so):
            seqs = {seq.seq_id: seq for seq in engine.scheduler.running}
            for s in so.scheduled:
                if check and s.num_drafts and seqs[s.seq_id].grammar is not None:
                    drafts = s.token_ids[-s.num_drafts:]
                    verified.append(seqs[s.seq_id].grammar.valid_prefix(drafts) == len(drafts))
            return execute(so)

        engine.runner.execute_model = checked
        outs = llm.generate(token_prompts(prompts), params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
        assert verified == [True] * len(verified)
        return engine.spec_decode_stats()

    cut = run(check=True)
    valid_prefix = GrammarState.valid_prefix
    GrammarState.valid_prefix = lambda self, drafts: len(drafts)  # every draft verified, as before
    try:
        whole = run(check=False)
    finally:
        GrammarState.valid_prefix = valid_prefix
    assert cut["num_accepted_tokens"] == whole["num_accepted_tokens"] > 0
    assert cut["num_draft_tokens"] < whole["num_draft_tokens"]

"""Whitespace in JSON structured output: free by default (vLLM's default), forbidden between tokens with
``disable_any_whitespace``, per request (``StructuredOutputsParams``) or for the whole engine (the engine
argument ``structured_outputs_config``).

The embedded model, trained on Python source, likes newlines and indentation: given free whitespace it
spends ``max_tokens`` on them inside a JSON object and returns text that does not parse; without it, the
same greedy requests close the object.
"""

from __future__ import annotations

import json

import pytest
import torch

from deepinfer_core.config import StructuredOutputsConfig, structured_outputs_config_of
from deepinfer_core.default_model import EMBEDDED_MODEL
from deepinfer_core.entrypoints.cli import build_parser
from deepinfer_core.entrypoints.cli_generate import UsageError, engine_kwargs
from deepinfer_core.entrypoints.llm import LLM
from deepinfer_core.sampling.params import SamplingParams, StructuredOutputsParams
from deepinfer_core.sampling.structured import StructuredOutputManager
from deepinfer_core.tokenizer import get_tokenizer

EOS = 1
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
PROMPTS = ["def parse(data):\n    return ", "config = "]
BLOCK_SIZE = 32  # the embedded model's largest compression rate


def _xgrammar_problem() -> str | None:
    try:
        import xgrammar  # noqa: F401
    except Exception as exc:  # missing, or installed without a dependency
        return f"{type(exc).__name__}: {exc}"
    return None


XGRAMMAR_PROBLEM = _xgrammar_problem()
needs_xgrammar = pytest.mark.skipif(XGRAMMAR_PROBLEM is not None,
                                    reason=f"xgrammar is not importable ({XGRAMMAR_PROBLEM})")


@pytest.fixture(autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _json_params(disable_any_whitespace: bool = False) -> SamplingParams:
    constraint = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=disable_any_whitespace)
    return SamplingParams(temperature=0, max_tokens=64, structured_outputs=constraint)


def _assert_compact_json(outs) -> None:
    for out in outs:
        comp = out.outputs[0]
        assert out.error is None and comp.finish_reason == "stop", comp
        assert comp.token_ids[-1] == EOS and "\n" not in comp.text
        value = json.loads(comp.text)
        assert set(value) == {"name", "age", "ok"} and isinstance(value["ok"], bool)


# --- the engine argument (no xgrammar needed) ----------------------------------------------------


def test_engine_argument_defaults_to_free_whitespace_and_is_checked():
    assert structured_outputs_config_of(None) == StructuredOutputsConfig("auto", False)
    assert structured_outputs_config_of({"disable_any_whitespace": True}).disable_any_whitespace
    assert structured_outputs_config_of({"backend": "xgrammar"}).backend == "xgrammar"
    for bad, message in [({"disable_any_whitespace": "yes"}, "must be a bool"),
                         ({"any_whitespace": False}, "unknown structured_outputs_config keys"),
                         ({"backend": "guidance"}, "'guidance' is not served"), ("compact", "must be a dict")]:
        with pytest.raises(ValueError, match=message):
            structured_outputs_config_of(bad)


def test_command_line_option():
    def kwargs(*argv: str) -> dict:
        return engine_kwargs(build_parser("generate").parse_args(["generate", "x", *argv]))

    assert "structured_outputs_config" not in kwargs()
    option = '{"disable_any_whitespace": true}'
    assert kwargs("--structured-outputs-config", option)["structured_outputs_config"] == {
        "disable_any_whitespace": True}
    for bad in ("{", "true"):
        with pytest.raises(UsageError, match="--structured-outputs-config"):
            kwargs("--structured-outputs-config", bad)


# --- the grammar itself --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return get_tokenizer(EMBEDDED_MODEL)


def _allowed_after(tokenizer, manager: StructuredOutputManager, params: StructuredOutputsParams,
                   text: str) -> set[int]:
    """The tokens the grammar allows after the output ``text``, from the bitmask the sampler applies."""
    state = manager.new_state(manager.compile(params), params)
    for token in tokenizer.encode(text, add_special_tokens=False):
        assert state.accept(token), text
    mask = manager.bitmask([state])[0]
    vocab = manager.vocab_size
    bits = (mask.view(-1, 1) >> torch.arange(32)) & 1
    return set(torch.nonzero(bits.view(-1)[:vocab]).view(-1).tolist())


@needs_xgrammar
@pytest.mark.parametrize("where", ["request", "engine"])
def test_bitmask_forbids_newlines_between_tokens(tokenizer, where):
    vocab = len(tokenizer)
    newlines = {t for t in range(vocab) if "\n" in tokenizer.decode([t])}
    assert newlines
    free = StructuredOutputManager(tokenizer, vocab, [EOS])
    compact = StructuredOutputManager(tokenizer, vocab, [EOS], disable_any_whitespace=where == "engine")
    params = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=where == "request")
    for text in ['{', '{"name":', '{"name": "ab",', '{"name": "ab", "age": 7']:
        assert _allowed_after(tokenizer, free, StructuredOutputsParams(json=SCHEMA), text) & newlines, text
        allowed = _allowed_after(tokenizer, compact, params, text)
        assert allowed and not allowed & newlines, text
    # the matcher refuses a newline outright, not only through the mask
    state = compact.new_state(compact.compile(params), params)
    assert state.accept(tokenizer.convert_tokens_to_ids("{"))
    assert not state.matcher.accept_token(min(newlines))


# --- generation with the embedded model ----------------------------------------------------------


@needs_xgrammar
def test_free_whitespace_runs_out_where_compact_json_parses():
    """The issue as a user meets it, and the per-request fix: same engine, same greedy requests."""
    llm = LLM(block_size=BLOCK_SIZE)
    for out in llm.generate(PROMPTS, _json_params(), use_tqdm=False):
        comp = out.outputs[0]
        assert comp.finish_reason == "length" and comp.text[-16:].isspace()  # spent on whitespace
        with pytest.raises(json.JSONDecodeError):
            json.loads(comp.text)
    _assert_compact_json(llm.generate(PROMPTS, _json_params(disable_any_whitespace=True), use_tqdm=False))


@needs_xgrammar
def test_engine_argument_makes_every_json_request_compact():
    llm = LLM(block_size=BLOCK_SIZE, structured_outputs_config={"disable_any_whitespace": True})
    assert llm.llm_engine.structured.disable_any_whitespace
    _assert_compact_json(llm.generate(PROMPTS, _json_params(), use_tqdm=False))
    json_object = SamplingParams(temperature=0, max_tokens=64,
                                 structured_outputs=StructuredOutputsParams(json_object=True))
    for out in llm.generate(PROMPTS, json_object, use_tqdm=False):
        assert "\n" not in out.outputs[0].text

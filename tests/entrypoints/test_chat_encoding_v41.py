"""DeepSeek-V4.1 chat encoding, feature by feature.

V4.1's release ``encoding/`` folder was not found, so the expected strings below follow its README as
mirrored and independent ports of its ``encoding.py`` (the reference README's section 3.15). When the
published encoder turns up, drop it in as ``tests/data/deepseek_v41_encoding/encoding.py`` (with its
``tests/`` cases beside it): the differential tests at the end then check every case against it.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from deepinfer_core import chat_v41
from deepinfer_core.chat import ASSISTANT, BOS, EOS, USER
from deepinfer_core.chat_v41 import (
    IMAGE_TOKEN,
    SYSTEM,
    CompletionStream,
    encode_messages,
    expand_image_tokens,
    image_parts,
    parse_completion,
    resolve_reasoning_effort,
)

EFFORT = "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
SYS = {"role": "system", "content": "S"}
Q = {"role": "user", "content": "q"}
TOOL = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}
CALLS = [{"id": "c1", "type": "function", "function": {"name": "get", "arguments": '{"q": "a b", "k": 3}'}}]
BLOCK = ('<｜DSML｜ calls>\n<｜DSML｜ invoke name="get">\n'
         '<｜DSML｜ parameter name="q" string="true">a b</｜DSML｜ parameter>\n'
         '<｜DSML｜ parameter name="k" string="false">3</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>')

TABLE = [
    ("chat mode: the system turn opens with the system token, no effort",
     [SYS, Q], {}, f"{BOS}{SYSTEM}S{USER}q{ASSISTANT}</think>"),
    ("thinking mode: the default effort 75 opens the system turn",
     [SYS, Q], {"thinking_mode": "thinking"}, f"{BOS}{SYSTEM}{EFFORT.format(75)}S{USER}q{ASSISTANT}<think>"),
    ("thinking mode without a system message: the effort block alone",
     [Q], {"thinking_mode": "thinking", "reasoning_effort": 42},
     f"{BOS}{SYSTEM}{EFFORT.format(42)}{USER}q{ASSISTANT}<think>"),
    ("chat mode ignores a valid effort", [Q], {"reasoning_effort": "max"}, f"{BOS}{USER}q{ASSISTANT}</think>"),
    ("a mid-conversation system turn has its token and is answered",
     [Q, {"role": "assistant", "content": "a"}, {"role": "system", "content": "New rule."}], {},
     f"{BOS}{USER}q{ASSISTANT}</think>a{EOS}{SYSTEM}New rule.{ASSISTANT}</think>"),
    ("a mid-conversation system turn is the last one answered: earlier reasoning dropped, thinking opens",
     [Q, {"role": "assistant", "content": "a", "reasoning_content": "r"}, {"role": "system", "content": "N"}],
     {"thinking_mode": "thinking"},
     f"{BOS}{SYSTEM}{EFFORT.format(75)}{USER}q{ASSISTANT}</think>a{EOS}{SYSTEM}N{ASSISTANT}<think>"),
    ("assistant tool calls in V4.1's DSML",
     [Q, {"role": "assistant", "content": "", "tool_calls": CALLS}], {},
     f"{BOS}{USER}q{ASSISTANT}</think>\n\n{BLOCK}{EOS}"),
    ("an image part is one image token; parts a blank line apart",
     [{"role": "user", "content": [{"type": "text", "text": "look"},
                                   {"type": "image_url", "image_url": {"url": "data:,"}},
                                   {"type": "text", "text": "and"}, {"type": "image", "image": "x"}]}], {},
     f"{BOS}{USER}look\n\n{IMAGE_TOKEN}\n\nand\n\n{IMAGE_TOKEN}{ASSISTANT}</think>"),
    ("action task, chat mode", [{"role": "user", "content": "q", "task": "action"}], {},
     f"{BOS}{USER}q{ASSISTANT}</think><｜action｜>"),
    ("action task, thinking mode", [{"role": "user", "content": "q", "task": "action"}],
     {"thinking_mode": "thinking"}, f"{BOS}{SYSTEM}{EFFORT.format(75)}{USER}q{ASSISTANT}<think><｜action｜>"),
    ("action task answered", [{"role": "user", "content": "q", "task": "action"},
                              {"role": "assistant", "content": "Search"}], {},
     f"{BOS}{USER}q{ASSISTANT}</think><｜action｜>Search{EOS}"),
    ("query task", [{"role": "user", "content": "q", "task": "query"}], {}, f"{BOS}{USER}q<｜query｜>"),
    ("authority task", [{"role": "user", "content": "q", "task": "authority"}], {}, f"{BOS}{USER}q<｜authority｜>"),
    ("domain task", [{"role": "user", "content": "q", "task": "domain"}], {}, f"{BOS}{USER}q<｜domain｜>"),
    ("read_url task", [{"role": "user", "content": "q<｜extracted_url｜>u", "task": "read_url"}], {},
     f"{BOS}{USER}q<｜extracted_url｜>u<｜read_url｜>"),
    ("title task", [Q, {"role": "assistant", "content": "a", "task": "title"}], {},
     f"{BOS}{USER}q{ASSISTANT}</think>a{EOS}<｜title｜>"),
]


@pytest.mark.parametrize("messages, kwargs, expected", [c[1:] for c in TABLE], ids=[c[0] for c in TABLE])
def test_encode_table(messages, kwargs, expected):
    assert encode_messages(messages, **kwargs) == expected


def test_tools_block_uses_the_spaced_tags():
    text = encode_messages([SYS, Q], tools=[TOOL])
    assert text.startswith(f"{BOS}{SYSTEM}S\n\n## Tools\n\n")
    assert 'writing a "<｜DSML｜ calls>" block' in text
    assert '<｜DSML｜ invoke name="$TOOL_NAME">' in text and "</｜DSML｜ parameter>" in text
    assert "<｜DSML｜tool_calls>" not in text and "<｜DSML｜invoke" not in text
    assert encode_messages([Q], tools=[TOOL]).startswith(f"{BOS}{SYSTEM}\n\n## Tools\n\n")


@pytest.mark.parametrize("effort, n", [(None, 75), ("low", 50), ("high", 75), ("max", 100), (1, 1), (100, 100),
                                       ("37", 37), ("MAX", 100)])
def test_reasoning_effort_values(effort, n):
    assert resolve_reasoning_effort(effort) == n
    text = encode_messages([Q], "thinking", reasoning_effort=effort)
    assert text == f"{BOS}{SYSTEM}{EFFORT.format(n)}{USER}q{ASSISTANT}<think>"


@pytest.mark.parametrize("effort", [0, 101, -1, True, 1.5, "medium", "none", "", "fast", [75]])
@pytest.mark.parametrize("mode", ["chat", "thinking"])
def test_bad_reasoning_effort_is_refused_in_both_modes(effort, mode):
    with pytest.raises(ValueError, match="reasoning_effort must be an integer from 1 to 100"):
        encode_messages([Q], mode, reasoning_effort=effort)


def test_image_token_in_text_is_refused():
    with pytest.raises(ValueError, match="images come as image content parts"):
        encode_messages([{"role": "user", "content": f"see {IMAGE_TOKEN}"}])
    with pytest.raises(ValueError, match="only text content parts"):
        encode_messages([Q, {"role": "assistant", "content": "", "tool_calls": CALLS},
                         {"role": "tool", "tool_call_id": "c1", "content": [{"type": "image_url"}]}])


def test_images_expand_to_their_spans_in_prompt_order():
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "A"}}]},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": [{"type": "text", "text": "t"},
                                         {"type": "image_url", "image_url": {"url": "B"}}]}]
    assert [p["image_url"]["url"] for p in image_parts(msgs)] == ["A", "B"]
    assert encode_messages(msgs).count(IMAGE_TOKEN) == 2
    img = chat_v41.IMAGE_TOKEN_ID
    assert expand_image_tokens([5, img, 6, img], [3, 1]) == [5, img, img, img, 6, img]
    with pytest.raises(ValueError, match="2 image tokens but 1 images"):
        expand_image_tokens([img, img], [4])


def test_parse_and_stream_v41_tool_calls():
    text = f"r</think>let me look\n\n{BLOCK}{EOS}"
    msg = parse_completion(text, "thinking")
    assert msg["content"] == "let me look" and msg["reasoning_content"] == "r"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == \
        [("get", {"q": "a b", "k": 3})]
    assert parse_completion(BLOCK.replace("｜DSML｜ ", "｜DSML｜"))["tool_calls"] == []  # V4's tags are not V4.1's
    stream, args = CompletionStream("thinking"), ""
    for i in range(1, len(text) + 1):
        for d in stream.tool_call_deltas(text[:i]):
            args += d["function"]["arguments"]
    _, _, final = stream.finish(text)
    for d in stream.finish_tool_calls(final):
        args += d["function"]["arguments"]
    assert args == final["tool_calls"][0]["function"]["arguments"]


# --- the published encoder, once it is dropped in ------------------------------------------------

ORACLE = Path(__file__).resolve().parents[1] / "data" / "deepseek_v41_encoding"


def _oracle():
    path = ORACLE / "encoding.py"
    if not path.is_file():
        pytest.skip("DeepSeek-V4.1's encoding.py is not in tests/data/deepseek_v41_encoding (not found yet)")
    spec = importlib.util.spec_from_file_location("_deepseek_v41_encoding", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


DIFFERENTIAL = {name: msgs for name, msgs, _, _ in TABLE if not any(
    isinstance(m.get("content"), list) for m in msgs)}


@pytest.mark.parametrize("name", sorted(DIFFERENTIAL))
@pytest.mark.parametrize("mode", ["chat", "thinking"])
def test_matches_the_published_encoder(name, mode):
    oracle = _oracle()
    msgs = DIFFERENTIAL[name]
    assert encode_messages(msgs, mode) == oracle.encode_messages(json.loads(json.dumps(msgs)), thinking_mode=mode)


def test_matches_the_published_cases():
    _oracle()
    for inp in sorted((ORACLE / "tests").glob("test_input_*.json")):
        case = json.loads(inp.read_text(encoding="utf-8"))
        case = case if isinstance(case, dict) else {"messages": case}
        expected = inp.with_name(inp.name.replace("input", "output").replace(".json", ".txt")).read_text("utf-8")
        got = encode_messages(case["messages"], case.get("thinking_mode") or "chat", tools=case.get("tools"),
                              reasoning_effort=case.get("reasoning_effort"))
        assert got == expected, inp.name


# --- the model's architecture picks the encoding ----------------------------------------------------

from engine_fixtures import tiny_path  # noqa: E402,F401  (the session's tiny checkpoints)

from deepinfer_core import chat as v4_chat  # noqa: E402
from deepinfer_core.config import ModelConfig  # noqa: E402
from deepinfer_core.entrypoints.chat_utils import chat_encoding_for  # noqa: E402


def test_the_architecture_picks_the_encoding(tiny_path):  # noqa: F811
    assert chat_encoding_for(ModelConfig.from_pretrained(tiny_path("v41"))) is chat_v41
    assert chat_encoding_for(ModelConfig.from_pretrained(tiny_path("tiny"))) is v4_chat
    assert chat_encoding_for(None) is v4_chat


def test_server_refuses_a_bad_effort_for_v41_with_400(tiny_path):  # noqa: F811
    """The OpenAI server encodes a V4.1 model's chats in V4.1's format: a numeric effort goes into the
    prompt, and 0, 101 or an unknown word is a 400 naming reasoning_effort (no engine needed for that)."""
    from types import SimpleNamespace

    from deepinfer_core.entrypoints.openai.protocol import APIError, ChatCompletionRequest
    from deepinfer_core.entrypoints.openai.serving import OpenAIServing

    front = SimpleNamespace(tokenizer=None, model_config=ModelConfig.from_pretrained(tiny_path("v41")))
    serving = OpenAIServing(front, ["m"], metrics=None)
    body = {"messages": [Q], "thinking": True}
    prompt = serving._chat_prompt(ChatCompletionRequest(**body, reasoning_effort=42))
    assert prompt.text == f"{BOS}{SYSTEM}{EFFORT.format(42)}{USER}q{ASSISTANT}<think>"
    assert isinstance(prompt.stream(), chat_v41.CompletionStream)
    for bad in (0, 101, "medium", "fast", True):
        with pytest.raises(APIError) as err:
            serving._chat_prompt(ChatCompletionRequest(**body, reasoning_effort=bad))
        assert err.value.status == 400 and err.value.param == "reasoning_effort"
        assert "reasoning_effort must be an integer from 1 to 100" in err.value.message


def test_llm_chat_takes_reasoning_effort(tiny_path):  # noqa: F811
    """LLM.chat on a tiny V4.1 encodes in V4.1's format with the given effort."""
    from deepinfer_core.entrypoints.llm import LLM
    from deepinfer_core.sampling.params import SamplingParams

    llm = LLM(model=str(tiny_path("v41")))
    out = llm.chat([SYS, Q], SamplingParams(max_tokens=2, temperature=0), thinking=True, reasoning_effort="low")[0]
    assert out.prompt == f"{BOS}{SYSTEM}{EFFORT.format(50)}S{USER}q{ASSISTANT}<think>"
    with pytest.raises(ValueError, match="reasoning_effort must be an integer from 1 to 100"):
        llm.chat([Q], reasoning_effort=0)

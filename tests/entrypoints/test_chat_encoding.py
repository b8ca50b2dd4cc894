"""DeepSeek-V4 chat encoding: the two published cases byte for byte, a table of the format's rules, and
parsing of completions (well-formed, streamed, malformed).

The published cases are in tests/data/deepseek_v4_encoding/ (its README says where each comes from):
1 and 2 in thinking mode, 4 (the action task) in chat mode, as DeepSeek's own harness encodes them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepinfer_core.chat import (
    ASSISTANT,
    BOS,
    EOS,
    REASONING_EFFORT_MAX,
    USER,
    CompletionStream,
    encode_messages,
    parse_completion,
    render_tool_calls,
)

DATA = Path(__file__).resolve().parents[1] / "data" / "deepseek_v4_encoding"
SYS = {"role": "system", "content": "S"}
TOOL = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}


def _case(n: int):
    raw = json.loads((DATA / f"test_input_{n}.json").read_text(encoding="utf-8"))
    expected = (DATA / f"test_output_{n}.txt").read_text(encoding="utf-8")
    if isinstance(raw, dict):
        return raw["messages"], raw.get("tools"), expected
    return raw, None, expected


PUBLISHED = {1: "thinking", 2: "thinking", 4: "chat"}


@pytest.mark.parametrize("n, mode", PUBLISHED.items())
def test_published_cases_exactly(n, mode):
    """encode_messages reproduces DeepSeek's test_output_N.txt from test_input_N.json."""
    messages, tools, expected = _case(n)
    assert encode_messages(messages, mode, tools=tools) == expected


def test_action_task_answer_keeps_its_token_and_no_reasoning():
    """Case 4's last turns: the action token sits between the assistant prefix and the answer, in both
    modes, and the answer to a task carries no reasoning even in thinking mode."""
    convo = [{"role": "user", "content": "q", "task": "action"},
             {"role": "assistant", "content": "Search", "reasoning_content": "r"}]
    assert encode_messages(convo, "chat") == f"{BOS}{USER}q{ASSISTANT}</think><｜action｜>Search{EOS}"
    assert encode_messages(convo, "thinking") == f"{BOS}{USER}q{ASSISTANT}<think><｜action｜>Search{EOS}"


@pytest.mark.parametrize("n", [1, 2])
def test_parse_recovers_published_assistant_turns(n):
    """Each assistant turn of the published outputs parses back to its message (content, reasoning,
    tool calls with the same name and arguments)."""
    messages, tools, expected = _case(n)
    turns = expected.split(ASSISTANT)[1:]
    assistants = [m for m in messages if m["role"] == "assistant"]
    assert len(turns) == len(assistants)
    for turn, want in zip(turns, assistants):
        # what the model generated: the turn after the prompt's "<think>" (reasoning kept) or "</think>"
        kept = turn.startswith("<think>")
        completion = turn.removeprefix("<think>" if kept else "</think>").split(EOS)[0] + EOS
        got = parse_completion(completion, "thinking" if kept else "chat")
        assert got["role"] == "assistant"
        assert got["content"] == (want.get("content") or "")
        assert got["reasoning_content"] == (want["reasoning_content"] if kept else None)
        calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got["tool_calls"]]
        assert calls == [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                         for c in want.get("tool_calls", [])]
        for c in got["tool_calls"]:
            assert c["type"] == "function" and c["id"].startswith("call_")


def test_readme_quick_start():
    prompt = encode_messages([{"role": "system", "content": "You are a helpful assistant."},
                              {"role": "user", "content": "What is 2+2?"}], thinking_mode="thinking")
    assert prompt == f"{BOS}You are a helpful assistant.{USER}What is 2+2?{ASSISTANT}<think>"
    parsed = parse_completion(f"Simple arithmetic.</think>2 + 2 = 4.{EOS}", thinking_mode="thinking")
    assert parsed == {"role": "assistant", "reasoning_content": "Simple arithmetic.", "content": "2 + 2 = 4.",
                      "tool_calls": []}


ENCODE_TABLE = [
    ("chat mode opens with </think>",
     [SYS, {"role": "user", "content": "hi"}], {}, f"{BOS}S{USER}hi{ASSISTANT}</think>"),
    ("no system message",
     [{"role": "user", "content": "hi"}], {}, f"{BOS}{USER}hi{ASSISTANT}</think>"),
    ("chat mode drops reasoning of every turn",
     [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": "r"},
      {"role": "user", "content": "c"}], {},
     f"{BOS}{USER}a{ASSISTANT}</think>b{EOS}{USER}c{ASSISTANT}</think>"),
    ("thinking mode drops reasoning before the last user message",
     [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": "r"},
      {"role": "user", "content": "c"}], {"thinking_mode": "thinking"},
     f"{BOS}{USER}a{ASSISTANT}</think>b{EOS}{USER}c{ASSISTANT}<think>"),
    ("drop_thinking=False keeps it",
     [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": "r"},
      {"role": "user", "content": "c"}], {"thinking_mode": "thinking", "drop_thinking": False},
     f"{BOS}{USER}a{ASSISTANT}<think>r</think>b{EOS}{USER}c{ASSISTANT}<think>"),
    ("content given as text parts",
     [{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}], {},
     f"{BOS}{USER}x\ny{ASSISTANT}</think>"),
    ("latest_reminder role",
     [{"role": "latest_reminder", "content": "date: today"}, {"role": "user", "content": "q"}], {},
     f"{BOS}<｜latest_reminder｜>date: today{USER}q{ASSISTANT}</think>"),
    ("a final assistant message ends the prompt (no generation prompt)",
     [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], {},
     f"{BOS}{USER}q{ASSISTANT}</think>a{EOS}"),
    ("add_generation_prompt=False",
     [{"role": "user", "content": "q"}], {"add_generation_prompt": False}, f"{BOS}{USER}q"),
    ("tool results merge into one user turn, in the order of the calls, with the next user message, as blocks "
     "a blank line apart",
     [{"role": "user", "content": "q"},
      {"role": "assistant", "content": None, "tool_calls": [
          {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
          {"id": "2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
      {"role": "tool", "tool_call_id": "2", "content": "B"}, {"role": "tool", "tool_call_id": "1", "content": "A"},
      {"role": "user", "content": "more"}], {},
     f"{BOS}{USER}q{ASSISTANT}</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n</｜DSML｜invoke>\n"
     f"<｜DSML｜invoke name=\"g\">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>{EOS}"
     f"{USER}<tool_result>A</tool_result>\n\n<tool_result>B</tool_result>\n\nmore{ASSISTANT}</think>"),
    ("user quick-instruction task",
     [{"role": "user", "content": "q", "task": "domain"}], {}, f"{BOS}{USER}q<｜domain｜>"),
    ("action task in chat mode: after a closed thinking token",
     [{"role": "user", "content": "q", "task": "action"}], {},
     f"{BOS}{USER}q{ASSISTANT}</think><｜action｜>"),
    ("action task in thinking mode: after the opening thinking token",
     [{"role": "user", "content": "q", "task": "action"}], {"thinking_mode": "thinking"},
     f"{BOS}{USER}q{ASSISTANT}<think><｜action｜>"),
    ("a non-action task's answer follows its token directly",
     [{"role": "user", "content": "q", "task": "query"}, {"role": "assistant", "content": "a b"}], {},
     f"{BOS}{USER}q<｜query｜>a b{EOS}"),
    ("read_url task", [{"role": "user", "content": "<｜extracted_url｜>u", "task": "read_url"}], {},
     f"{BOS}{USER}<｜extracted_url｜>u<｜read_url｜>"),
    ("the title after the title task",
     [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "task": "title"},
      {"role": "assistant", "content": "T"}], {"thinking_mode": "thinking"},
     f"{BOS}{USER}q{ASSISTANT}<think></think>a{EOS}<｜title｜>T{EOS}"),
    ("a latest_reminder after the user turn comes after the assistant prefix",
     [{"role": "user", "content": "A"}, {"role": "latest_reminder", "content": "R"}], {},
     f"{BOS}{USER}A{ASSISTANT}</think><｜latest_reminder｜>R"),
    ("consecutive user messages form one turn",
     [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], {},
     f"{BOS}{USER}a\n\nb{ASSISTANT}</think>"),
    ("reasoning_effort=max adds nothing in chat mode",
     [SYS, {"role": "user", "content": "q"}], {"reasoning_effort": "max"}, f"{BOS}S{USER}q{ASSISTANT}</think>"),
    ("title task after the assistant's EOS",
     [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "task": "title"}], {},
     f"{BOS}{USER}q{ASSISTANT}</think>a{EOS}<｜title｜>"),
    ("reasoning_effort=max comes first",
     [SYS, {"role": "user", "content": "q"}], {"reasoning_effort": "max", "thinking_mode": "thinking"},
     f"{BOS}{REASONING_EFFORT_MAX}\n\nS{USER}q{ASSISTANT}<think>"),
]


@pytest.mark.parametrize("messages, kwargs, expected", [c[1:] for c in ENCODE_TABLE], ids=[c[0] for c in ENCODE_TABLE])
def test_encode_table(messages, kwargs, expected):
    assert encode_messages(messages, **kwargs) == expected


def test_tools_in_system_turn_and_on_the_system_message():
    """Tools go after the system prompt (one JSON schema per line); on the system message they count
    the same, and with tools thinking mode keeps every turn's reasoning."""
    convo = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": "r"},
             {"role": "user", "content": "c"}]
    by_arg = encode_messages([SYS, *convo], "thinking", tools=[TOOL])
    by_msg = encode_messages([{**SYS, "tools": [TOOL]}, *convo], "thinking")
    assert by_arg == by_msg
    assert by_arg.startswith(f"{BOS}S\n\n## Tools\n\n")
    assert '\n{"name": "f", "description": "d", "parameters": {"type": "object"}}\n' in by_arg
    assert f"invoke tool calls.\n{USER}a" in by_arg
    assert f"{ASSISTANT}<think>r</think>b{EOS}" in by_arg
    no_system = encode_messages(convo[:1], tools=[TOOL])  # an empty system turn holds them
    assert no_system.startswith(f"{BOS}\n\n## Tools\n\n")


def test_response_format_in_system_turn():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    text = encode_messages([SYS, {"role": "user", "content": "q"}],
                           response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert text.startswith(f"{BOS}S\n\n## Response Format\n\n")
    assert json.dumps(schema) in text
    assert encode_messages([{"role": "user", "content": "q"}], response_format={"type": "text"}) == \
        encode_messages([{"role": "user", "content": "q"}])


def test_tool_call_arguments_strings_raw_others_json():
    block = render_tool_calls([{"function": {"name": "f", "arguments": {"s": "x<y", "n": 5, "l": [1, "a"],
                                                                        "o": {"k": None}, "b": True}}}])
    assert '<｜DSML｜parameter name="s" string="true">x<y</｜DSML｜parameter>' in block
    assert '<｜DSML｜parameter name="n" string="false">5</｜DSML｜parameter>' in block
    assert '<｜DSML｜parameter name="l" string="false">[1, "a"]</｜DSML｜parameter>' in block
    assert '<｜DSML｜parameter name="b" string="false">true</｜DSML｜parameter>' in block
    calls = parse_completion(block)["tool_calls"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"s": "x<y", "n": 5, "l": [1, "a"], "o": {"k": None},
                                                             "b": True}


BAD_MESSAGES = [
    ([], "non-empty list"),
    ([{"role": "wizard", "content": "x"}], "unknown role 'wizard'"),
    ([{"role": "developer", "content": "x"}], "developer role is not supported"),
    (["hello"], "must be an object"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "only text content parts"),
    ([{"role": "user", "content": 5}], "content must be a string"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{not json"}}]}],
     "arguments are not valid JSON"),
    ([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}], "non-empty string 'name'"),
    ([{"role": "user", "content": "x", "task": "summarize"}], "unsupported task 'summarize'"),
    ([{"role": "assistant", "content": "x", "task": "action"}], "unsupported task 'action'"),
    ([SYS, {"role": "user", "content": "x"}, {"role": "system", "content": "y", "tools": [TOOL]}],
     "tools go on the first system message"),
]


@pytest.mark.parametrize("messages, message", BAD_MESSAGES)
def test_invalid_conversations_say_what_is_wrong(messages, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        encode_messages(messages)


def test_bad_arguments_of_encode():
    with pytest.raises(ValueError, match="thinking_mode"):
        encode_messages([{"role": "user", "content": "x"}], thinking_mode="deep")
    with pytest.raises(ValueError, match="tools\\[0\\]"):
        encode_messages([{"role": "user", "content": "x"}], tools=[{"type": "function", "function": {}}])
    with pytest.raises(ValueError, match="response_format type"):
        encode_messages([{"role": "user", "content": "x"}], response_format={"type": "yaml"})


CALL = ('<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get">\n'
        '<｜DSML｜parameter name="q" string="true">a b</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="k" string="false">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>')

TWO = CALL.replace("</｜DSML｜invoke>\n", '</｜DSML｜invoke>\n<｜DSML｜invoke name="x">\n</｜DSML｜invoke>\n')
GET = ("get", {"q": "a b", "k": 3})
PARSE_TABLE = [
    ("chat text", "hello", "chat", ("hello", None, [])),
    ("chat text with EOS and junk after", f"hi{EOS}junk", "chat", ("hi", None, [])),
    ("thinking", "r</think>c", "thinking", ("c", "r", [])),
    ("thinking with a repeated <think>", "<think>r</think>c", "thinking", ("c", "r", [])),
    ("reasoning never closed (out of tokens)", "still thinking", "thinking", ("", "still thinking", [])),
    ("tool call after content", f"let me look\n\n{CALL}", "chat", ("let me look", None, [GET])),
    ("tool call after reasoning", f"r</think>\n\n{CALL}{EOS}", "thinking", ("", "r", [GET])),
    ("two invokes", TWO, "chat", ("", None, [GET, ("x", {})])),
]

MALFORMED = [
    ("unclosed block", CALL[:-10]),
    ("text after the block", CALL + " and more"),
    ("bad JSON value", CALL.replace('string="false">3<', 'string="false">{3<')),
    ("stray text inside invoke", CALL.replace('<｜DSML｜parameter name="k"', 'oops<｜DSML｜parameter name="k"')),
    ("empty block", "<｜DSML｜tool_calls>\n</｜DSML｜tool_calls>"),
    ("missing name", CALL.replace('name="get"', 'name=""')),
    ("bad string attribute", CALL.replace('string="true"', 'string="yes"')),
]


@pytest.mark.parametrize("text, mode, expected", [c[1:] for c in PARSE_TABLE], ids=[c[0] for c in PARSE_TABLE])
def test_parse_table(text, mode, expected):
    got = parse_completion(text, mode)
    content, reasoning, calls = expected
    assert got["content"] == content and got["reasoning_content"] == reasoning
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got["tool_calls"]] == calls


@pytest.mark.parametrize("text", [c[1] for c in MALFORMED], ids=[c[0] for c in MALFORMED])
def test_malformed_tool_calls_are_plain_content(text):
    got = parse_completion("pre " + text, "chat")
    assert got["tool_calls"] == [] and got["content"] == "pre " + text


@pytest.mark.parametrize("junk", [None, 5, b"bytes", "\ud800", "</think></think>", "<｜DSML｜tool_calls>"])
def test_parse_never_raises(junk):
    for mode in ("chat", "thinking"):
        got = parse_completion(junk, mode)
        assert set(got) == {"role", "content", "reasoning_content", "tool_calls"}


def test_tools_false_leaves_dsml_in_content():
    assert parse_completion(CALL, tools=False)["content"] == CALL


@pytest.mark.parametrize("mode, text", [
    ("thinking", "<think>let me see</think>The answer\n\nis 4.\n"),
    ("thinking", f"r</think>ok\n\n{CALL}"),
    ("chat", f"content then\n\n{CALL}"),
    ("chat", "plain <｜DSML｜tool_calls> broken"),
    ("thinking", "never closes </thin"),
])
def test_stream_pieces_add_up_to_the_final_parse(mode, text):
    """Fed one character at a time, the streamed reasoning and content are prefixes of (and at the end
    equal to) parse_completion's; held-back markers never leak into the stream."""
    stream = CompletionStream(mode)
    reasoning = content = ""
    for i in range(1, len(text) + 1):
        r, c = stream.update(text[:i])
        reasoning, content = reasoning + r, content + c
        assert "</think" not in reasoning and "<｜DSML" not in content.replace("<｜DSML｜tool_calls> broken", "")
    r, c, msg = stream.finish(text)
    reasoning, content = reasoning + r, content + c
    want = parse_completion(text, mode)
    assert msg == {**want, "tool_calls": msg["tool_calls"]}
    assert reasoning == (want["reasoning_content"] or "") and content == want["content"]

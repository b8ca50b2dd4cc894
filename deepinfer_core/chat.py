"""DeepSeek-V4 chat encoding: messages to prompt text, and a completion's text back to a message.

The model ships no chat template; its format is DeepSeek's published encoding (``encoding_dsv4.py``),
reproduced here rule for rule: a BOS, the system turn (with the tool schemas when tools are given),
``<｜User｜>`` turns (tool results merged into them as ``<tool_result>`` blocks), assistant turns, tool
calls written in DSML (:mod:`deepinfer_core.dsml`).

The assistant prefix belongs to the turn *before* the assistant's: after a user turn that is followed
by an assistant turn (or that ends the conversation) comes ``<｜Assistant｜>`` and ``<think>`` (thinking
mode, reasoning kept) or ``</think>``; the assistant turn itself is ``reasoning</think>`` (only where
its reasoning is kept), its content, its tool calls and EOS. A quick-instruction task on the turn
replaces that prefix with its token (``action``: ``<｜Assistant｜><think>`` or ``</think>``, then
``<｜action｜>``), and the assistant turn answering a task carries no reasoning.

V4.1 (:mod:`deepinfer_core.chat_v41`) uses the same rules with another :class:`ChatDialect`.
:func:`parse_completion` turns generated text into ``{role, content, reasoning_content, tool_calls}``
and never raises; :class:`CompletionStream` does the same incrementally for streaming.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from deepinfer_core.dsml import (  # noqa: F401  (re-exported: the V4 spellings)
    DSML,
    V4_TAGS,
    DsmlTags,
    ToolCallStream,
    new_tool_call_id,
    partial_suffix,
)
from deepinfer_core.dsml import parse_tool_calls as _parse_tool_calls
from deepinfer_core.dsml import render_tool_calls as _render_tool_calls

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALLS_START = V4_TAGS.calls_start
TOOL_CALLS_END = V4_TAGS.calls_end
TOOL_RESULT_START = "<tool_result>"
TOOL_RESULT_END = "</tool_result>"

THINKING_MODES = ("chat", "thinking")
ROLES = ("system", "user", "assistant", "tool", "latest_reminder")
#: quick-instruction tasks on a user turn: the token written after it (action: after the assistant prefix)
USER_TASKS = {"action": "<｜action｜>", "query": "<｜query｜>", "authority": "<｜authority｜>",
              "domain": "<｜domain｜>", "read_url": "<｜read_url｜>"}
#: on an assistant turn: the token written after its EOS (the next assistant turn is the title)
ASSISTANT_TASKS = {"title": "<｜title｜>"}
ACTION_TASK = USER_TASKS["action"]
TITLE_TASK = ASSISTANT_TASKS["title"]
#: OpenAI's chat and Responses image parts, and vLLM's PIL-image part
IMAGE_PART_TYPES = ("image_url", "image", "input_image", "image_pil")

REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked."
)
V4_REASONING_EFFORTS = ("none", "low", "medium", "high", "max")

TOOLS_TEMPLATE = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \
"{start}" block like the following:

{start}
{invoke}$TOOL_NAME">
{param}$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{param_end}
...
{invoke_end}
{invoke}$TOOL_NAME2">
...
{invoke_end}
{end}

String parameters should be specified as is and set `string="true"`. For all other types (numbers, \
booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside \
<think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""

RESPONSE_FORMAT_TEMPLATE = """## Response Format

Reply with a single JSON value only, no other text. {what}"""


def v4_effort_prefix(effort: Any) -> str:
    """V4's opening for ``reasoning_effort`` in thinking mode: DeepSeek's instruction for ``"max"``,
    nothing for the other OpenAI levels."""
    if effort is not None and effort not in V4_REASONING_EFFORTS:
        raise ValueError(f"reasoning_effort must be one of {list(V4_REASONING_EFFORTS)} for this model, "
                         f"got {effort!r}")
    return REASONING_EFFORT_MAX + "\n\n" if effort == "max" else ""


@dataclass(frozen=True)
class ChatDialect:
    """What one DeepSeek chat format changes; the turn rules of :func:`encode` are shared."""

    tags: DsmlTags = V4_TAGS
    #: the system-turn token (V4.1): it opens the first system turn and every later one; a later system
    #: turn is then a turn the assistant answers, like a user turn
    system_token: str | None = None
    #: written once per image content part; None refuses images
    image_token: str | None = None
    #: between the parts of one message's content list
    part_separator: str = "\n"
    #: reasoning_effort -> the prompt's opening in thinking mode (validates in both modes)
    effort_prefix: Callable[[Any], str] = field(default=v4_effort_prefix)


V4 = ChatDialect()


# --- encoding ------------------------------------------------------------------------------------


def _text(content: Any, where: str, dialect: ChatDialect = V4, separator: str | None = None) -> str:
    """A message's content as text: a string, None (empty) or a list of OpenAI content parts (image
    parts become the dialect's image token)."""
    if content is None:
        return ""
    image = dialect.image_token if separator is None else None  # images only in a message's own content
    if isinstance(content, str):
        parts = [content]
    elif isinstance(content, Sequence) and not isinstance(content, (bytes, bytearray)):
        parts = []
        for part in content:
            kind = part.get("type", "text") if isinstance(part, Mapping) else type(part).__name__
            if isinstance(part, str):
                parts.append(part)
            elif kind == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif kind in IMAGE_PART_TYPES and image is not None:
                parts.append(None)
            else:
                allowed = "text and image" if image is not None else "text"
                raise ValueError(f"{where}: only {allowed} content parts are supported here, got a {kind!r} part")
    else:
        raise ValueError(f"{where}: content must be a string or a list of content parts, got "
                         f"{type(content).__name__}")
    # the image token comes only from image parts: one token per image is what the vision side expands
    if dialect.image_token is not None and any(p is not None and dialect.image_token in p for p in parts):
        raise ValueError(f"{where}: the text contains the image token {dialect.image_token}; "
                         f"images come as image content parts")
    parts = [image if p is None else p for p in parts]
    return (dialect.part_separator if separator is None else separator).join(parts)


def _tool_function(tool: Any, i: int) -> dict:
    """The function definition of an OpenAI tool (``{"type": "function", "function": {...}}``) or a bare one."""
    if not isinstance(tool, Mapping):
        raise ValueError(f"tools[{i}] must be an object, got {type(tool).__name__}")
    if "function" in tool:
        if tool.get("type", "function") != "function":
            raise ValueError(f"tools[{i}]: only function tools are supported, got type {tool.get('type')!r}")
        fn = tool["function"]
    else:
        fn = tool
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f"tools[{i}]: a function tool needs a non-empty string 'name'")
    return dict(fn)


def render_tools(tools: Iterable[Any], tags: DsmlTags = V4_TAGS) -> str:
    """The system-prompt block that describes ``tools`` (one JSON schema per line)."""
    schemas = "\n".join(json.dumps(_tool_function(t, i), ensure_ascii=False) for i, t in enumerate(tools))
    return TOOLS_TEMPLATE.format(schemas=schemas, start=tags.calls_start, end=tags.calls_end,
                                 invoke=tags.invoke_open, invoke_end=tags.invoke_close,
                                 param=tags.param_open, param_end=tags.param_close)


def render_response_format(response_format: Mapping[str, Any]) -> str | None:
    """The system-prompt block asking for JSON (OpenAI's ``response_format``); None for plain text."""
    if not isinstance(response_format, Mapping):
        raise ValueError(f"response_format must be an object, got {type(response_format).__name__}")
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return RESPONSE_FORMAT_TEMPLATE.format(what="It must be a JSON object.")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema", spec.get("json_schema")) if isinstance(spec, Mapping) else None
        if not isinstance(schema, (Mapping, bool)):
            raise ValueError("response_format json_schema needs a 'json_schema' object with a 'schema'")
        text = json.dumps(schema, ensure_ascii=False)
        return RESPONSE_FORMAT_TEMPLATE.format(what=f"It must follow this JSON schema:\n{text}")
    raise ValueError(f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}")


def render_tool_calls(tool_calls: Sequence[Any], where: str = "tool_calls", tags: DsmlTags = V4_TAGS) -> str:
    """OpenAI-style tool calls as a DSML block (strings raw, every other value as JSON)."""
    return _render_tool_calls(tool_calls, tags, where)


@dataclass
class _Turn:
    """One turn of the prompt: a message, or a user message with the tool results merged into it."""

    role: str
    where: str
    msg: Mapping[str, Any]
    parts: list[str] = field(default_factory=list)  # a user turn's blocks, joined by a blank line
    results: list[tuple[Any, int]] = field(default_factory=list)  # (tool_call_id, index in parts)
    task: str | None = None


def _turns(messages: Sequence[Mapping[str, Any]], dialect: ChatDialect) -> list[_Turn]:
    """DeepSeek's merge: each tool message becomes a ``<tool_result>`` block of a user turn, and a user
    message joins the user turn before it unless that one has a task (a task on the joining message is
    kept; DeepSeek's encoder would drop it). Tool results are then put in the order of the calls of the
    latest assistant turn with calls (unknown ids rank first, as there)."""
    turns: list[_Turn] = []
    order: dict[Any, int] = {}
    for i, msg in enumerate(messages):
        role, where = msg["role"], f"messages[{i}]"
        last = turns[-1] if turns and turns[-1].role == "user" and turns[-1].task is None else None
        if role == "tool":
            block = TOOL_RESULT_START + _text(msg.get("content"), where, dialect, "\n\n") + TOOL_RESULT_END
            turn = last or _Turn("user", where, msg)
            turn.results.append((msg.get("tool_call_id"), len(turn.parts)))
            turn.parts.append(block)
            if last is None:
                turns.append(turn)
        elif role == "user":
            turn = last or _Turn("user", where, msg)
            turn.parts.append(_text(msg.get("content"), where, dialect))
            turn.task, turn.where = msg.get("task"), where
            if last is None:
                turns.append(turn)
        else:
            if role == "assistant" and msg.get("tool_calls"):
                order = {c.get("id"): k for k, c in enumerate(msg["tool_calls"])
                         if isinstance(c, Mapping) and c.get("id")}
            turns.append(_Turn(role, where, msg, task=msg.get("task")))
        if role == "tool":
            _sort_results(turns[-1], order)
    return turns


def _sort_results(turn: _Turn, order: Mapping[Any, int]) -> None:
    slots = [pos for _, pos in turn.results]
    ranked = sorted(turn.results, key=lambda r: order.get(r[0], 0))
    blocks = [turn.parts[pos] for _, pos in ranked]
    for pos, block in zip(slots, blocks):
        turn.parts[pos] = block
    turn.results = [(rid, pos) for (rid, _), pos in zip(ranked, slots)]


def _check(messages: Any, thinking_mode: str) -> list[Mapping[str, Any]]:
    if thinking_mode not in THINKING_MODES:
        raise ValueError(f"thinking_mode must be one of {THINKING_MODES}, got {thinking_mode!r}")
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise ValueError("messages must be a non-empty list of message objects")
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise ValueError(f"messages[{i}] must be an object, got {type(msg).__name__}")
        role = msg.get("role")
        if role == "developer":
            raise ValueError(f"messages[{i}]: the developer role is not supported (use system)")
        if role not in ROLES:
            raise ValueError(f"messages[{i}]: unknown role {role!r}; expected one of {ROLES}")
        task = msg.get("task")
        allowed = USER_TASKS if role == "user" else ASSISTANT_TASKS if role == "assistant" else {}
        if task is not None and task not in allowed:
            raise ValueError(f"messages[{i}]: unsupported task {task!r}; supported on {role} messages: "
                             f"{sorted(allowed)}")
        if i > 0 and role == "system" and msg.get("tools"):
            raise ValueError(f"messages[{i}]: tools go on the first system message or in the tools argument")
    return list(messages)


def encode(
    messages: Sequence[Mapping[str, Any]],
    dialect: ChatDialect,
    thinking_mode: str = "chat",
    tools: Sequence[Any] | None = None,
    response_format: Mapping[str, Any] | None = None,
    drop_thinking: bool = True,
    add_generation_prompt: bool | None = None,
    reasoning_effort: Any = None,
    add_bos: bool = True,
) -> str:
    """The prompt text of a conversation in ``dialect`` (see the module docstring for the rules).

    ``tools`` (OpenAI format) may also sit on the first system message as its ``tools`` field; they
    and ``response_format`` are described in the system turn (an empty one is opened when the
    conversation has none). In thinking mode the reasoning of assistant turns before the last user
    turn is dropped (``drop_thinking``) unless tools are present. ``add_generation_prompt``: None
    follows DeepSeek's encoder, which writes the assistant prefix after a final user turn; False
    writes nothing after the last message; True also opens an assistant turn after a final assistant,
    reminder or system turn. Raises ValueError, naming the message, for anything it cannot encode.
    """
    messages = _check(messages, thinking_mode)
    thinking = thinking_mode == "thinking"
    effort = dialect.effort_prefix(reasoning_effort)  # validated in chat mode too, written in thinking mode
    effort = effort if thinking else ""
    tool_list = list(tools or [])
    if messages[0]["role"] == "system" and messages[0].get("tools"):
        tool_list += list(messages[0]["tools"])
    extra = render_response_format(response_format) if response_format is not None else None
    if (tool_list or extra) and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": ""})

    turns = _turns(messages, dialect)
    keep_all = thinking and (bool(tool_list) or not drop_thinking)
    answered = ("user", "system") if dialect.system_token else ("user",)
    last_user = max((k for k, t in enumerate(turns) if t.role in answered and (t.role == "user" or k > 0)),
                    default=-1)

    out = [BOS] if add_bos else []
    out.append(effort)
    for k, turn in enumerate(turns):
        role, where, msg = turn.role, turn.where, turn.msg
        if role == "system":
            if dialect.system_token and (k > 0 or not effort):
                out.append(dialect.system_token)
            text = _text(msg.get("content"), where, dialect)
            if k == 0 and tool_list:
                text += "\n\n" + render_tools(tool_list, dialect.tags)
            if k == 0 and extra:
                text += "\n\n" + extra
            out.append(text)
        elif role == "latest_reminder":
            out.append(LATEST_REMINDER + _text(msg.get("content"), where, dialect))
        elif role == "user":
            out.append(USER + "\n\n".join(turn.parts))
        else:  # assistant
            reasoning = msg.get("reasoning_content") or ""
            if not isinstance(reasoning, str):
                raise ValueError(f"{where}: reasoning_content must be a string")
            answers_task = k > 0 and turns[k - 1].task is not None
            keep = thinking and not answers_task and (keep_all or k > last_user)
            body = (reasoning + THINK_END if keep else "") + _text(msg.get("content"), where, dialect)
            calls = msg.get("tool_calls") or []
            if calls:
                body += "\n\n" + render_tool_calls(calls, f"{where}.tool_calls", dialect.tags)
            out.append(body + EOS)
        out.append(_transition(turns, k, dialect, thinking, keep_all or k >= last_user, add_generation_prompt))
    return "".join(out)


def _transition(turns: list[_Turn], k: int, dialect: ChatDialect, thinking: bool, keep: bool,
                add_generation_prompt: bool | None) -> str:
    """What follows turn ``k``: its task token, or the assistant prefix when an assistant turn follows
    (or the conversation ends) after a user turn (V4.1: or a later system turn)."""
    nxt = turns[k + 1].role if k + 1 < len(turns) else None
    if nxt not in (None, "assistant", "latest_reminder") or (nxt is None and add_generation_prompt is False):
        return ""
    turn = turns[k]
    if turn.task == "action":
        return ASSISTANT + (THINK_START if thinking else THINK_END) + ACTION_TASK
    if turn.task is not None:
        return {**USER_TASKS, **ASSISTANT_TASKS}[turn.task]
    if turn.role == "user" or (turn.role == "system" and k > 0 and dialect.system_token):
        return ASSISTANT + (THINK_START if thinking and keep else THINK_END)
    if nxt is None and add_generation_prompt:
        return ASSISTANT + (THINK_START if thinking else THINK_END)
    return ""


def encode_messages(
    messages: Sequence[Mapping[str, Any]],
    thinking_mode: str = "chat",
    tools: Sequence[Any] | None = None,
    response_format: Mapping[str, Any] | None = None,
    drop_thinking: bool = True,
    add_generation_prompt: bool | None = None,
    reasoning_effort: str | None = None,
    add_bos: bool = True,
) -> str:
    """The prompt text of a conversation in DeepSeek-V4's encoding (:func:`encode` with V4's dialect).

    ``reasoning_effort="max"`` opens a thinking-mode prompt with DeepSeek's maximum-effort instruction;
    ``"none"``, ``"low"``, ``"medium"`` and ``"high"`` add nothing.
    """
    return encode(messages, V4, thinking_mode, tools, response_format, drop_thinking, add_generation_prompt,
                  reasoning_effort, add_bos)


# --- parsing -------------------------------------------------------------------------------------


def parse_tool_calls(block: str, tags: DsmlTags = V4_TAGS) -> list[dict] | None:
    """The OpenAI-style tool calls of one DSML block, or None when it does not follow the format."""
    return _parse_tool_calls(block, tags)


def _strip_eos(text: str) -> str:
    cut = text.find(EOS)
    return text if cut < 0 else text[:cut]


def _split_reasoning(text: str, thinking: bool) -> tuple[str | None, str | None]:
    """(reasoning, the rest) of a completion; the rest is None while the reasoning is still open."""
    if not thinking:
        return None, text
    body = text[len(THINK_START):] if text.startswith(THINK_START) else text
    cut = body.find(THINK_END)
    if cut < 0:
        return body, None
    return body[:cut], body[cut + len(THINK_END):]


def parse_completion(text: str, thinking_mode: str = "chat", tools: bool = True,
                     tags: DsmlTags = V4_TAGS) -> dict[str, Any]:
    """The assistant message of a completion (the text generated after the prompt's assistant prefix).

    Returns ``{"role": "assistant", "content", "reasoning_content", "tool_calls"}``: in thinking mode
    the text before ``</think>`` is the reasoning (all of it when the reasoning never closed, as when
    the output ran out of tokens); in chat mode ``reasoning_content`` is None. A well-formed DSML block
    at the end becomes OpenAI-style ``tool_calls`` (``tools=False`` leaves it in the content). Anything
    malformed stays in ``content`` as plain text; this never raises.
    """
    try:
        text = _strip_eos(text if isinstance(text, str) else str(text))
        reasoning, rest = _split_reasoning(text, thinking_mode == "thinking")
        if rest is None:
            return {"role": "assistant", "content": "", "reasoning_content": reasoning, "tool_calls": []}
        calls: list[dict] = []
        if tools:
            start = rest.find(tags.calls_start)
            parsed = _parse_tool_calls(rest[start:], tags) if start >= 0 else None
            if parsed is not None:
                calls, rest = parsed, rest[:start].rstrip()
        return {"role": "assistant", "content": rest, "reasoning_content": reasoning, "tool_calls": calls}
    except Exception:  # never fail a request on the model's output
        return {"role": "assistant", "content": str(text), "reasoning_content": None, "tool_calls": []}


class CompletionStream:
    """Incremental :func:`parse_completion` for streaming.

    ``update(text)`` takes the whole text generated so far and returns the new ``(reasoning, content)``
    pieces that are certain already: a possible beginning of ``</think>`` or of a tool-call block and
    trailing whitespace are held back. ``tool_call_deltas(text)`` returns OpenAI's streamed
    ``tool_calls`` deltas of the block begun so far (:class:`~deepinfer_core.dsml.ToolCallStream`).
    ``finish(text)`` returns the last pieces and the final message, ``finish_tool_calls(message)`` the
    last deltas: everything streamed is a prefix of the final ``reasoning_content``, ``content`` and
    each call's ``arguments`` when the output is well-formed (a malformed block comes back as content,
    and calls already begun in the stream are not taken back).
    """

    def __init__(self, thinking_mode: str = "chat", tools: bool = True, tags: DsmlTags = V4_TAGS):
        self.thinking = thinking_mode == "thinking"
        self.thinking_mode, self.tools, self.tags = thinking_mode, tools, tags
        self.reasoning_sent = ""
        self.content_sent = ""
        self.calls = ToolCallStream()

    def _visible(self, text: str) -> tuple[str, str]:
        text = _strip_eos(text)
        if self.thinking and THINK_START.startswith(text):
            return "", ""
        reasoning, rest = _split_reasoning(text, self.thinking)
        if rest is None:
            return reasoning[:len(reasoning) - partial_suffix(reasoning, THINK_END)], ""
        if self.tools:
            start = rest.find(self.tags.calls_start)
            rest = rest[:start] if start >= 0 else rest[:len(rest) - partial_suffix(rest, self.tags.calls_start)]
        return reasoning or "", rest.rstrip()

    def _delta(self, reasoning: str, content: str) -> tuple[str, str]:
        dr = reasoning[len(self.reasoning_sent):] if reasoning.startswith(self.reasoning_sent) else ""
        dc = content[len(self.content_sent):] if content.startswith(self.content_sent) else ""
        self.reasoning_sent += dr
        self.content_sent += dc
        return dr, dc

    def update(self, text: str) -> tuple[str, str]:
        try:
            return self._delta(*self._visible(text))
        except Exception:
            return "", ""

    def tool_call_deltas(self, text: str) -> list[dict[str, Any]]:
        if not self.tools:
            return []
        try:
            _, rest = _split_reasoning(_strip_eos(text), self.thinking)
            start = -1 if rest is None else rest.find(self.tags.calls_start)
        except Exception:
            return []
        return [] if start < 0 else self.calls.update(rest[start + len(self.tags.calls_start):], self.tags)

    def finish(self, text: str) -> tuple[str, str, dict[str, Any]]:
        msg = parse_completion(text, self.thinking_mode, self.tools, self.tags)
        dr, dc = self._delta(msg["reasoning_content"] or "", msg["content"] or "")
        return dr, dc, msg

    def finish_tool_calls(self, msg: Mapping[str, Any]) -> list[dict[str, Any]]:
        return self.calls.finish(msg["tool_calls"])

"""DeepSeek-V4 chat encoding: messages to prompt text, and a completion's text back to a message.

The model ships no chat template; its format is DeepSeek's published encoding: a BOS, the system turn
(with the tool schemas when tools are given), ``<｜User｜>`` turns (tool results merged into them as
``<tool_result>`` blocks), ``<｜Assistant｜>`` turns that open with ``<think>reasoning</think>`` in
thinking mode or a bare ``</think>`` in chat mode and end with EOS, and tool calls written in DSML.

:func:`encode_messages` builds the prompt; :func:`parse_completion` turns generated text into
``{role, content, reasoning_content, tool_calls}`` with OpenAI-style tool calls and never raises:
output that does not follow the format comes back as plain content. :class:`CompletionStream` does the
same incrementally for streaming, so that every streamed piece is a prefix of the final parse.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
TOOL_CALLS_START = f"<{DSML}tool_calls>"
TOOL_CALLS_END = f"</{DSML}tool_calls>"
TOOL_RESULT_START = "<tool_result>"
TOOL_RESULT_END = "</tool_result>"

THINKING_MODES = ("chat", "thinking")
ROLES = ("system", "user", "assistant", "tool", "latest_reminder")
# quick-instruction tasks: where each token goes (after the user content, or after the assistant prefix)
USER_TASKS = {"query": "<｜query｜>", "authority": "<｜authority｜>", "domain": "<｜domain｜>"}
ACTION_TASK = "<｜action｜>"
TITLE_TASK = "<｜title｜>"

REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked."
)

TOOLS_TEMPLATE = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \
"<｜DSML｜tool_calls>" block like the following:

<｜DSML｜tool_calls>
<｜DSML｜invoke name="$TOOL_NAME">
<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>
...
</｜DSML｜invoke>
<｜DSML｜invoke name="$TOOL_NAME2">
...
</｜DSML｜invoke>
</｜DSML｜tool_calls>

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


# --- encoding ------------------------------------------------------------------------------------


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, None (empty) or a list of OpenAI text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, (bytes, bytearray)):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, Mapping) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ValueError(f"{where}: only text content parts are supported, got a {kind!r} part")
        return "\n".join(parts)
    raise ValueError(f"{where}: content must be a string or a list of text parts, got {type(content).__name__}")


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


def render_tools(tools: Iterable[Any]) -> str:
    """The system-prompt block that describes ``tools`` (one JSON schema per line)."""
    schemas = "\n".join(json.dumps(_tool_function(t, i), ensure_ascii=False) for i, t in enumerate(tools))
    return TOOLS_TEMPLATE.format(schemas=schemas)


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


def _arguments(call: Mapping[str, Any], where: str) -> dict:
    args = call.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: arguments are not valid JSON: {exc}") from None
    if not isinstance(args, Mapping):
        raise ValueError(f"{where}: arguments must be a JSON object, got {type(args).__name__}")
    return dict(args)


def render_tool_calls(tool_calls: Sequence[Any], where: str = "tool_calls") -> str:
    """OpenAI-style tool calls as a DSML block (strings raw, every other value as JSON)."""
    invokes = []
    for i, call in enumerate(tool_calls):
        at = f"{where}[{i}]"
        if not isinstance(call, Mapping):
            raise ValueError(f"{at} must be an object")
        fn = call.get("function", call)
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"{at} needs a function with a non-empty string 'name'")
        lines = [f'<{DSML}invoke name="{fn["name"]}">']
        for key, value in _arguments(fn, at).items():
            is_str = isinstance(value, str)
            shown = value if is_str else json.dumps(value, ensure_ascii=False)
            lines.append(f'<{DSML}parameter name="{key}" string="{"true" if is_str else "false"}">{shown}'
                         f"</{DSML}parameter>")
        lines.append(f"</{DSML}invoke>")
        invokes.append("\n".join(lines))
    return TOOL_CALLS_START + "\n" + "\n".join(invokes) + "\n" + TOOL_CALLS_END


def _sorted_tool_results(results: list[Mapping[str, Any]], calls: Sequence[Any]) -> list[Mapping[str, Any]]:
    """Tool results in the order of the assistant's tool calls (unknown ids keep their order, last)."""
    order = {}
    for i, call in enumerate(calls or ()):
        if isinstance(call, Mapping) and call.get("id") is not None:
            order.setdefault(call["id"], i)
    return sorted(results, key=lambda m: order.get(m.get("tool_call_id"), len(order)))


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
    """The prompt text of a conversation in DeepSeek-V4's encoding.

    ``tools`` (OpenAI format) may also sit on the first system message as its ``tools`` field; they are
    described in the system turn. In thinking mode the reasoning of assistant turns before the last user
    message is dropped (``drop_thinking``) unless tools are present. ``add_generation_prompt`` (default:
    the last message is not the assistant's) appends the assistant prefix that the model continues from.
    ``reasoning_effort="max"`` prepends DeepSeek's maximum-effort instruction. Raises ValueError, naming
    the message, for anything that cannot be encoded.
    """
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
    messages = list(messages)
    tool_list = list(tools or [])
    if messages[0]["role"] == "system" and messages[0].get("tools"):
        tool_list += list(messages[0]["tools"])
    thinking = thinking_mode == "thinking"
    keep_all_reasoning = thinking and (bool(tool_list) or not drop_thinking)
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)

    out = [BOS] if add_bos else []
    if reasoning_effort == "max":
        out.append(REASONING_EFFORT_MAX + "\n\n")
    elif reasoning_effort not in (None, "low", "medium", "high", "none"):
        raise ValueError(f"reasoning_effort must be 'low', 'medium', 'high' or 'max', got {reasoning_effort!r}")

    start = 0
    system_parts = []
    if messages[0]["role"] == "system":
        text = _text(messages[0].get("content"), "messages[0]")
        if text:
            system_parts.append(text)
        start = 1
    extra = render_response_format(response_format) if response_format is not None else None
    if tool_list:
        system_parts.append(render_tools(tool_list).rstrip("\n"))
    if extra:
        system_parts.append(extra)
    if system_parts:
        out.append("\n\n".join(system_parts) + ("\n" if tool_list else ""))

    last_role = "system"
    pending_task = None
    i = start
    while i < len(messages):
        msg, where = messages[i], f"messages[{i}]"
        role = msg["role"]
        pending_task = None
        if role == "system":
            out.append(_text(msg.get("content"), where))
        elif role == "latest_reminder":
            out.append(LATEST_REMINDER + _text(msg.get("content"), where))
        elif role in ("user", "tool"):
            turn = [USER]
            if role == "tool":  # consecutive tool results, then a user message, form one user turn
                results = []
                while i < len(messages) and messages[i]["role"] == "tool":
                    results.append(messages[i])
                    i += 1
                prev = next((m for m in reversed(messages[:i - len(results)]) if m["role"] == "assistant"), None)
                for res in _sorted_tool_results(results, (prev or {}).get("tool_calls") or []):
                    turn.append(TOOL_RESULT_START + _text(res.get("content"), where) + TOOL_RESULT_END)
                if i < len(messages) and messages[i]["role"] == "user":
                    msg, where = messages[i], f"messages[{i}]"
                else:
                    i -= 1
                    msg = None
            if msg is not None:
                turn.append(_text(msg.get("content"), where))
                task = msg.get("task")
                if task is not None:
                    if task in USER_TASKS:
                        turn.append(USER_TASKS[task])
                    elif task != "action":
                        raise ValueError(f"{where}: unsupported task {task!r}; supported on user messages: "
                                         f"{sorted([*USER_TASKS, 'action'])}")
                pending_task = task
            out.append("".join(turn))
        else:  # assistant
            reasoning = msg.get("reasoning_content") or ""
            if not isinstance(reasoning, str):
                raise ValueError(f"{where}: reasoning_content must be a string")
            keep = thinking and (keep_all_reasoning or i > last_user)
            head = THINK_START + reasoning + THINK_END if keep else THINK_END
            body = _text(msg.get("content"), where)
            calls = msg.get("tool_calls") or []
            if calls:
                body += "\n\n" + render_tool_calls(calls, f"{where}.tool_calls")
            out.append(ASSISTANT + head + body + EOS)
            task = msg.get("task")
            if task == "title":
                out.append(TITLE_TASK)
            elif task is not None:
                raise ValueError(f"{where}: unsupported task {task!r}; supported on assistant messages: ['title']")
            pending_task = task
        last_role = role
        i += 1

    if add_generation_prompt is None:
        add_generation_prompt = last_role != "assistant"
    if add_generation_prompt and pending_task not in (*USER_TASKS, "title"):
        out.append(ASSISTANT + (THINK_START if thinking or pending_task == "action" else THINK_END))
        if pending_task == "action":
            out.append(ACTION_TASK)
    return "".join(out)


# --- parsing -------------------------------------------------------------------------------------

_INVOKE = re.compile(rf'<{DSML}invoke name="([^"]*)">(.*?)</{DSML}invoke>', re.S)
_PARAM = re.compile(rf'<{DSML}parameter name="([^"]*)" string="(true|false)">(.*?)</{DSML}parameter>', re.S)


def new_tool_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def parse_tool_calls(block: str) -> list[dict] | None:
    """The OpenAI-style tool calls of one DSML block (from its opening tag to the end of the text), or
    None when the block does not follow the format exactly."""
    if not block.startswith(TOOL_CALLS_START):
        return None
    end = block.find(TOOL_CALLS_END)
    if end < 0 or block[end + len(TOOL_CALLS_END):].strip():
        return None
    inner = block[len(TOOL_CALLS_START):end]
    calls, pos = [], 0
    for m in _INVOKE.finditer(inner):
        if inner[pos:m.start()].strip():
            return None
        pos = m.end()
        args, ppos = {}, 0
        body = m.group(2)
        for p in _PARAM.finditer(body):
            if body[ppos:p.start()].strip():
                return None
            ppos = p.end()
            name, is_str, raw = p.group(1), p.group(2) == "true", p.group(3)
            if is_str:
                args[name] = raw
            else:
                try:
                    args[name] = json.loads(raw)
                except json.JSONDecodeError:
                    return None
        if body[ppos:].strip() or not m.group(1):
            return None
        calls.append({"id": new_tool_call_id(), "type": "function",
                      "function": {"name": m.group(1), "arguments": json.dumps(args, ensure_ascii=False)}})
    if inner[pos:].strip() or not calls:
        return None
    return calls


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


def parse_completion(text: str, thinking_mode: str = "chat", tools: bool = True) -> dict[str, Any]:
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
            start = rest.find(TOOL_CALLS_START)
            parsed = parse_tool_calls(rest[start:]) if start >= 0 else None
            if parsed is not None:
                calls, rest = parsed, rest[:start].rstrip()
        return {"role": "assistant", "content": rest, "reasoning_content": reasoning, "tool_calls": calls}
    except Exception:  # never fail a request on the model's output
        return {"role": "assistant", "content": str(text), "reasoning_content": None, "tool_calls": []}


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class CompletionStream:
    """Incremental :func:`parse_completion` for streaming.

    ``update(text)`` takes the whole text generated so far and returns the new ``(reasoning, content)``
    pieces that are certain already: a possible beginning of ``</think>`` or of a tool-call block and
    trailing whitespace are held back. ``finish(text)`` returns the last pieces and the final message;
    everything streamed is a prefix of the final ``reasoning_content`` and ``content``.
    """

    def __init__(self, thinking_mode: str = "chat", tools: bool = True):
        self.thinking = thinking_mode == "thinking"
        self.thinking_mode, self.tools = thinking_mode, tools
        self.reasoning_sent = ""
        self.content_sent = ""

    def _visible(self, text: str) -> tuple[str, str]:
        text = _strip_eos(text)
        if self.thinking and THINK_START.startswith(text):
            return "", ""
        reasoning, rest = _split_reasoning(text, self.thinking)
        if rest is None:
            return reasoning[:len(reasoning) - _partial_suffix(reasoning, THINK_END)], ""
        if self.tools:
            start = rest.find(TOOL_CALLS_START)
            rest = rest[:start] if start >= 0 else rest[:len(rest) - _partial_suffix(rest, TOOL_CALLS_START)]
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

    def finish(self, text: str) -> tuple[str, str, dict[str, Any]]:
        msg = parse_completion(text, self.thinking_mode, self.tools)
        dr, dc = self._delta(msg["reasoning_content"] or "", msg["content"] or "")
        return dr, dc, msg

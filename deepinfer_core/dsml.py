"""DSML, DeepSeek's tool-call markup: OpenAI tool calls to a DSML block, a block back to calls, and a
block that is still being generated to OpenAI's streamed ``tool_calls`` deltas.

A block reads (V4's tag names; V4.1 writes `` calls``, `` invoke`` and `` parameter``, with the space)::

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get">
    <｜DSML｜parameter name="q" string="true">raw text</｜DSML｜parameter>
    <｜DSML｜parameter name="k" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

String values are raw text, every other value is JSON. A parsed call's ``arguments`` is always
``json.dumps(args, ensure_ascii=False)``: the one spelling the streamed deltas add up to.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

DSML = "｜DSML｜"


@dataclass(frozen=True)
class DsmlTags:
    """The tag names of one DSML dialect."""

    block: str
    invoke: str
    parameter: str

    @property
    def calls_start(self) -> str:
        return f"<{DSML}{self.block}>"

    @property
    def calls_end(self) -> str:
        return f"</{DSML}{self.block}>"

    @property
    def invoke_open(self) -> str:
        return f'<{DSML}{self.invoke} name="'

    @property
    def invoke_close(self) -> str:
        return f"</{DSML}{self.invoke}>"

    @property
    def param_open(self) -> str:
        return f'<{DSML}{self.parameter} name="'

    @property
    def param_close(self) -> str:
        return f"</{DSML}{self.parameter}>"

    @cached_property
    def invoke_re(self) -> re.Pattern:
        return re.compile(rf'{re.escape(self.invoke_open)}([^"]*)">(.*?){re.escape(self.invoke_close)}', re.S)

    @cached_property
    def param_re(self) -> re.Pattern:
        return re.compile(rf'{re.escape(self.param_open)}([^"]*)" string="(true|false)">(.*?)'
                          rf'{re.escape(self.param_close)}', re.S)


V4_TAGS = DsmlTags("tool_calls", "invoke", "parameter")
V41_TAGS = DsmlTags(" calls", " invoke", " parameter")


def new_tool_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


# --- rendering -----------------------------------------------------------------------------------


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


def render_tool_calls(tool_calls: Sequence[Any], tags: DsmlTags = V4_TAGS, where: str = "tool_calls") -> str:
    """OpenAI-style tool calls as a DSML block (strings raw, every other value as JSON)."""
    invokes = []
    for i, call in enumerate(tool_calls):
        at = f"{where}[{i}]"
        if not isinstance(call, Mapping):
            raise ValueError(f"{at} must be an object")
        fn = call.get("function", call)
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"{at} needs a function with a non-empty string 'name'")
        lines = [f'{tags.invoke_open}{fn["name"]}">']
        for key, value in _arguments(fn, at).items():
            is_str = isinstance(value, str)
            shown = value if is_str else json.dumps(value, ensure_ascii=False)
            lines.append(f'{tags.param_open}{key}" string="{"true" if is_str else "false"}">{shown}{tags.param_close}')
        lines.append(tags.invoke_close)
        invokes.append("\n".join(lines))
    return tags.calls_start + "\n" + "\n".join(invokes) + "\n" + tags.calls_end


# --- parsing -------------------------------------------------------------------------------------


def parse_tool_calls(block: str, tags: DsmlTags = V4_TAGS) -> list[dict] | None:
    """The OpenAI-style tool calls of one DSML block (from its opening tag to the end of the text), or
    None when the block does not follow the format exactly (a repeated parameter name included)."""
    if not block.startswith(tags.calls_start):
        return None
    end = block.find(tags.calls_end)
    if end < 0 or block[end + len(tags.calls_end):].strip():
        return None
    inner = block[len(tags.calls_start):end]
    calls, pos = [], 0
    for m in tags.invoke_re.finditer(inner):
        if inner[pos:m.start()].strip():
            return None
        pos = m.end()
        args, ppos = {}, 0
        body = m.group(2)
        for p in tags.param_re.finditer(body):
            if body[ppos:p.start()].strip() or p.group(1) in args:
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


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def _lstrip_at(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def partial_tool_calls(body: str, tags: DsmlTags = V4_TAGS) -> list[tuple[str, str]]:
    """``(name, arguments so far)`` of each call begun in ``body`` (the text after the block's opening
    tag, possibly cut anywhere). Each arguments string is a prefix of the ``arguments`` that
    :func:`parse_tool_calls` gives once the block is complete: a string value shows as far as it is
    certain, a JSON value only when its closing tag has come; anything malformed ends the reading."""
    calls: list[tuple[str, str]] = []
    pos = _lstrip_at(body, 0)
    while body.startswith(tags.invoke_open, pos):
        name_end = body.find('">', pos + len(tags.invoke_open))
        if name_end < 0:
            break
        name = body[pos + len(tags.invoke_open):name_end]
        args, sep, pos = "{", "", name_end + 2
        while True:
            pos = _lstrip_at(body, pos)
            if body.startswith(tags.invoke_close, pos):
                calls.append((name, args + "}"))
                pos = _lstrip_at(body, pos + len(tags.invoke_close))
                break
            head = re.compile(rf'{re.escape(tags.param_open)}([^"]*)" string="(true|false)">').match(body, pos)
            if head is None:
                calls.append((name, args))
                return calls
            key, is_str = head.group(1), head.group(2) == "true"
            value_end = body.find(tags.param_close, head.end())
            lead = f"{sep}{json.dumps(key, ensure_ascii=False)}: "
            if value_end < 0:  # the value is still being generated
                if is_str:
                    seen = body[head.end():]
                    seen = seen[:len(seen) - partial_suffix(seen, tags.param_close)]
                    args += lead + '"' + json.dumps(seen, ensure_ascii=False)[1:-1]
                calls.append((name, args))
                return calls
            raw = body[head.end():value_end]
            if is_str:
                shown = json.dumps(raw, ensure_ascii=False)
            else:
                try:
                    shown = json.dumps(json.loads(raw), ensure_ascii=False)
                except json.JSONDecodeError:
                    calls.append((name, args))
                    return calls
            args, sep, pos = args + lead + shown, ", ", value_end + len(tags.param_close)
    return calls


class ToolCallStream:
    """OpenAI's streamed ``tool_calls`` deltas of a DSML block being generated.

    ``update(body)`` takes the block's text so far (after its opening tag) and returns the new deltas:
    a call's first delta carries its ``id``, ``type`` and ``function.name`` with empty ``arguments``, the
    next ones only ``arguments`` pieces. ``finish(calls)`` takes the final parsed calls and returns what
    is left, so that, per index, the streamed ``arguments`` pieces concatenate to the final ``arguments``.
    """

    def __init__(self) -> None:
        self.sent: list[tuple[str, str, str]] = []  # (id, name, arguments sent) per call index

    def _deltas(self, calls: Sequence[tuple[str, str]]) -> list[dict[str, Any]]:
        out = []
        for k, (name, args) in enumerate(calls):
            if k == len(self.sent):
                self.sent.append((new_tool_call_id(), name, ""))
                out.append({"index": k, "id": self.sent[k][0], "type": "function",
                            "function": {"name": name, "arguments": ""}})
            cid, sent_name, sent = self.sent[k]
            # a prefix never shrinks; a mismatch (it cannot happen for one growing text) sends nothing more
            if sent_name == name and len(args) > len(sent) and args.startswith(sent):
                self.sent[k] = (cid, name, args)
                out.append({"index": k, "function": {"arguments": args[len(sent):]}})
        return out

    def update(self, body: str, tags: DsmlTags = V4_TAGS) -> list[dict[str, Any]]:
        try:
            return self._deltas(partial_tool_calls(body, tags))
        except Exception:  # never fail a stream on the model's output
            return []

    def finish(self, calls: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        return self._deltas([(c["function"]["name"], c["function"]["arguments"]) for c in calls])

"""DeepSeek-V4.1 chat encoding: V4's turn rules (:mod:`deepinfer_core.chat`) in V4.1's dialect.

What V4.1 changes (its release's ``encoding/`` folder was not found; these follow its README as
mirrored and independent ports of its ``encoding.py``, not a byte-verified file):

- DSML tag names gain a leading space: ``<｜DSML｜ calls>``, ``<｜DSML｜ invoke``, ``<｜DSML｜ parameter``.
- Reasoning effort is a number from 1 to 100 (aliases low 50, high 75, max 100; default 75). In
  thinking mode the prompt opens with ``<｜System｜>Reasoning Effort: N (range 1-100, ...)`` and a
  blank line; chat mode writes none.
- ``<｜System｜>`` opens the first system turn (the effort block, when there is one, is that turn's
  start) and every later system turn; a later system turn is answered like a user turn.
- Each image content part is one ``<｜deepseek_image｜>`` token: :func:`expand_image_tokens` widens it
  to the image's span once the vision side knows the span's length.
- The quick-instruction tasks are V4's.

The module has the public names of :mod:`deepinfer_core.chat` (``encode_messages``,
``parse_completion``, ``CompletionStream``), so the engine picks either by the model's architecture.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from deepinfer_core import chat
from deepinfer_core.chat import IMAGE_PART_TYPES, ChatDialect
from deepinfer_core.dsml import V41_TAGS

SYSTEM = "<｜System｜>"
IMAGE_TOKEN = "<｜deepseek_image｜>"
#: the id every position of an image span carries (config.json ``image_token_id``)
IMAGE_TOKEN_ID = 129264
REASONING_EFFORT_ALIASES = {"low": 50, "high": 75, "max": 100}
DEFAULT_REASONING_EFFORT = 75
REASONING_EFFORT_TEMPLATE = ("Reasoning Effort: {n} (range 1-100, the higher the value, the more thorough "
                             "the reasoning)\n\n")


def resolve_reasoning_effort(effort: Any) -> int:
    """The numeric reasoning effort of ``effort``: an integer 1..100 (or its decimal string), one of
    the aliases low, high, max, or None (the default, 75). ValueError for anything else."""
    if effort is None:
        return DEFAULT_REASONING_EFFORT
    if isinstance(effort, str):
        key = effort.strip().lower()
        if key in REASONING_EFFORT_ALIASES:
            return REASONING_EFFORT_ALIASES[key]
        if key.isdigit():
            effort = int(key)
    if isinstance(effort, int) and not isinstance(effort, bool) and 1 <= effort <= 100:
        return effort
    raise ValueError(f"reasoning_effort must be an integer from 1 to 100 or one of "
                     f"{list(REASONING_EFFORT_ALIASES)}, got {effort!r}")


def effort_prefix(effort: Any) -> str:
    return SYSTEM + REASONING_EFFORT_TEMPLATE.format(n=resolve_reasoning_effort(effort))


V41 = ChatDialect(tags=V41_TAGS, system_token=SYSTEM, image_token=IMAGE_TOKEN, part_separator="\n\n",
                  effort_prefix=effort_prefix)


def encode_messages(
    messages: Sequence[Mapping[str, Any]],
    thinking_mode: str = "chat",
    tools: Sequence[Any] | None = None,
    response_format: Mapping[str, Any] | None = None,
    drop_thinking: bool = True,
    add_generation_prompt: bool | None = None,
    reasoning_effort: int | str | None = None,
    add_bos: bool = True,
) -> str:
    """The prompt text of a conversation in DeepSeek-V4.1's encoding (arguments as
    :func:`deepinfer_core.chat.encode_messages`; ``reasoning_effort`` as :func:`resolve_reasoning_effort`)."""
    return chat.encode(messages, V41, thinking_mode, tools, response_format, drop_thinking, add_generation_prompt,
                       reasoning_effort, add_bos)


def image_parts(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The image content parts of ``messages`` in the order their tokens appear in the prompt: the encoding
    writes every message's content in message order (user turns merged in order), and a tool message's
    content, the only one it moves, may hold no image."""
    return [part for msg in messages if isinstance(msg, Mapping) and msg.get("role") != "tool"
            and isinstance(msg.get("content"), list)
            for part in msg["content"] if isinstance(part, Mapping) and part.get("type") in IMAGE_PART_TYPES]


def expand_image_tokens(token_ids: Sequence[int], span_lengths: Sequence[int],
                        image_token_id: int = IMAGE_TOKEN_ID) -> list[int]:
    """``token_ids`` with the i-th image token repeated ``span_lengths[i]`` times: the positions of the
    image's span ``[START] ([IMAGE] * w [NEWLINE]) * h [END]``, which all carry the image token's id.
    ValueError when the counts of image tokens and spans differ."""
    found = sum(1 for t in token_ids if t == image_token_id)
    if found != len(span_lengths):
        raise ValueError(f"the prompt has {found} image tokens but {len(span_lengths)} images were given")
    out: list[int] = []
    spans = iter(span_lengths)
    for t in token_ids:
        out.extend([t] * next(spans) if t == image_token_id else [t])
    return out


def parse_completion(text: str, thinking_mode: str = "chat", tools: bool = True) -> dict[str, Any]:
    """:func:`deepinfer_core.chat.parse_completion` with V4.1's DSML tag names."""
    return chat.parse_completion(text, thinking_mode, tools, V41_TAGS)


class CompletionStream(chat.CompletionStream):
    """:class:`deepinfer_core.chat.CompletionStream` with V4.1's DSML tag names."""

    def __init__(self, thinking_mode: str = "chat", tools: bool = True):
        super().__init__(thinking_mode, tools, V41_TAGS)

"""Chat on top of ``generate``: the encoding of a conversation in the model's chat format (chosen by its
architecture: DeepSeek-V4's or V4.1's), its sampling parameters, and the parsed assistant message of
each completion. Shared by ``LLM.chat`` and the OpenAI server.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

from deepinfer_core import chat as v4_chat
from deepinfer_core.outputs import RequestOutput
from deepinfer_core.sampling.params import SamplingParams, StructuredOutputsParams


def structured_outputs_for(response_format: Mapping[str, Any] | None) -> StructuredOutputsParams | None:
    """The structured-output constraint of OpenAI's ``response_format`` (None for plain text)."""
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise ValueError(f"response_format must be an object, got {type(response_format).__name__}")
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema", spec.get("json_schema")) if isinstance(spec, Mapping) else None
        if not isinstance(schema, Mapping):
            raise ValueError("response_format json_schema needs a 'json_schema' object with a 'schema' object")
        return StructuredOutputsParams(json=dict(schema))
    raise ValueError(f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}")


def chat_encoding_for(model_config: Any) -> ModuleType:
    """The chat-encoding module of a model (:func:`~deepinfer_core.models.registry.get_chat_encoding`
    by its architecture); DeepSeek-V4's when the config names none."""
    from deepinfer_core.models.registry import get_chat_encoding

    arch = getattr(model_config, "architecture", None) if model_config is not None else None
    return get_chat_encoding(arch.name) if arch is not None else v4_chat


@dataclasses.dataclass
class ChatPrompt:
    """One conversation ready for the engine: its text, its token ids, how to parse what comes back."""

    text: str
    prompt_token_ids: list[int] | None
    params: SamplingParams
    thinking_mode: str
    parse_tools: bool
    encoding: ModuleType = v4_chat

    @property
    def engine_prompt(self) -> str | dict:
        if self.prompt_token_ids is None:
            return self.text
        return {"prompt": self.text, "prompt_token_ids": self.prompt_token_ids}

    def parse(self, text: str) -> dict[str, Any]:
        return self.encoding.parse_completion(text, self.thinking_mode, tools=self.parse_tools)

    def stream(self) -> Any:
        """A :class:`~deepinfer_core.chat.CompletionStream` of this prompt's format, for one completion."""
        return self.encoding.CompletionStream(self.thinking_mode, self.parse_tools)


def build_chat_prompt(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    sampling_params: SamplingParams | None = None,
    thinking: bool = False,
    tools: Sequence[Any] | None = None,
    response_format: Mapping[str, Any] | None = None,
    parse_tools: bool = True,
    encoding: ModuleType = v4_chat,
    **encode_kwargs: Any,
) -> ChatPrompt:
    """Encode ``messages`` (ValueError when they cannot be) and derive the request's sampling parameters.

    With ``response_format`` asking for JSON the output is constrained by structured outputs, and the
    conversation is encoded in chat mode (a grammar over the whole output leaves no room for reasoning).
    The text is tokenized without adding special tokens (the encoding already starts with BOS).
    """
    params = sampling_params or SamplingParams()
    structured = structured_outputs_for(response_format)
    if structured is not None:
        if params.structured_outputs is not None:
            raise ValueError("give either response_format or structured_outputs, not both")
        params = dataclasses.replace(params, structured_outputs=structured)
    mode = "thinking" if thinking and structured is None else "chat"
    text = encoding.encode_messages(messages, mode, tools=tools, response_format=response_format, **encode_kwargs)
    ids = tokenizer.encode(text, add_special_tokens=False) if tokenizer is not None else None
    return ChatPrompt(text, ids, params, mode, parse_tools and bool(tools), encoding)


def chat(
    llm: Any,
    messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
    sampling_params: SamplingParams | None = None,
    thinking: bool = False,
    tools: Sequence[Any] | None = None,
    response_format: Mapping[str, Any] | None = None,
    use_tqdm: bool = False,
    reasoning_effort: int | str | None = None,
    **encode_kwargs: Any,
) -> list[RequestOutput]:
    """``LLM.chat``: generate the assistant's reply to one conversation (or to each of a list of them).

    Returns ``generate``'s RequestOutputs, each with ``chat_messages``: per completion, the parsed
    assistant message (``{role, content, reasoning_content, tool_calls}``, see :func:`chat_message`).
    ``reasoning_effort``: V4.1 takes 1..100 or low/high/max (default 75, written in thinking mode only);
    V4 takes OpenAI's levels, of which "max" adds DeepSeek's maximum-effort instruction. Raises
    ValueError for a conversation that cannot be encoded or a bad reasoning effort.
    """
    conversations = [messages] if not messages or isinstance(messages[0], Mapping) else list(messages)
    tokenizer = llm.get_tokenizer()
    encoding = chat_encoding_for(getattr(getattr(llm, "llm_engine", None), "model_config", None))
    prompts = [build_chat_prompt(tokenizer, conv, sampling_params, thinking, tools, response_format,
                                 encoding=encoding, reasoning_effort=reasoning_effort, **encode_kwargs)
               for conv in conversations]
    outs = llm.generate([p.engine_prompt for p in prompts], [p.params for p in prompts], use_tqdm=use_tqdm)
    for out, prompt in zip(outs, prompts):
        out.chat_messages = [prompt.parse(c.text) for c in out.outputs]
    return outs


def chat_message(output: RequestOutput, index: int = 0) -> dict[str, Any]:
    """The parsed assistant message of completion ``index`` of a :func:`chat` output."""
    return output.chat_messages[index]

"""Chat on top of ``generate``: the encoding of a conversation in the model's chat format (chosen by its
architecture: DeepSeek-V4's or V4.1's), its images, its sampling parameters, and the parsed assistant
message of each completion. Shared by ``LLM.chat`` and the OpenAI server.

A conversation's image parts travel as ``generate``'s ``multi_modal_data``: the prompt holds one image
token per image (in the images' order), which the engine widens into the image's span.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

from deepinfer_core import chat as v4_chat
from deepinfer_core.chat_v41 import image_parts
from deepinfer_core.entrypoints.chat_images import ImageInput, load_chat_images
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


def image_token_id_for(model_config: Any) -> int | None:
    """The id the prompt's image tokens carry, or None for a model that reads no images (no vision tower)."""
    if model_config is None or not getattr(model_config, "vision_config", None):
        return None
    return getattr(model_config, "image_token_id", None)


def tokenize_with_images(tokenizer: Any, text: str, image_token: str, image_token_id: int) -> list[int]:
    """``text``'s ids with every ``image_token`` as ``image_token_id``, the rest tokenized piece by piece
    (what a tokenizer that knows the image token as a special token gives for the whole text: it splits
    there first; a tokenizer that does not know it still gets the model's id)."""
    ids: list[int] = []
    for k, piece in enumerate(text.split(image_token)):
        if k:
            ids.append(image_token_id)
        if piece:
            ids.extend(tokenizer.encode(piece, add_special_tokens=False))
    return ids


@dataclasses.dataclass
class ChatPrompt:
    """One conversation ready for the engine: its text, its token ids, how to parse what comes back."""

    text: str
    prompt_token_ids: list[int] | None
    params: SamplingParams
    thinking_mode: str
    parse_tools: bool
    encoding: ModuleType = v4_chat
    images: list[ImageInput] = dataclasses.field(default_factory=list)  # one per image token, in order

    @property
    def engine_prompt(self) -> str | dict:
        if self.prompt_token_ids is None and not self.images:
            return self.text
        prompt: dict[str, Any] = {"prompt": self.text}
        if self.prompt_token_ids is not None:
            prompt["prompt_token_ids"] = self.prompt_token_ids
        if self.images:
            prompt["multi_modal_data"] = {"image": list(self.images)}
        return prompt

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
    image_token_id: int | None = None,
    **encode_kwargs: Any,
) -> ChatPrompt:
    """Encode ``messages`` (ValueError when they cannot be) and derive the request's sampling parameters.

    With ``response_format`` asking for JSON the output is constrained by structured outputs, and the
    conversation is encoded in chat mode (a grammar over the whole output leaves no room for reasoning).
    The text is tokenized without adding special tokens (the encoding already starts with BOS).
    ``image_token_id``: the id of the model's image token (:func:`image_token_id_for`); None refuses image
    parts. The images are decoded from their parts here (data: URLs only), checked by the engine.
    """
    image_token = getattr(encoding, "IMAGE_TOKEN", None)
    if image_parts(messages) and (image_token_id is None or image_token is None):
        raise ValueError("this model reads no images (it has no vision tower): send text content parts only")
    images = load_chat_images(messages)
    params = sampling_params or SamplingParams()
    structured = structured_outputs_for(response_format)
    if structured is not None:
        if params.structured_outputs is not None:
            raise ValueError("give either response_format or structured_outputs, not both")
        params = dataclasses.replace(params, structured_outputs=structured)
    mode = "thinking" if thinking and structured is None else "chat"
    text = encoding.encode_messages(messages, mode, tools=tools, response_format=response_format, **encode_kwargs)
    if images and tokenizer is None:
        raise ValueError("this model folder has no tokenizer: a chat with images cannot be tokenized")
    if images:
        ids = tokenize_with_images(tokenizer, text, image_token, image_token_id)
    else:
        ids = tokenizer.encode(text, add_special_tokens=False) if tokenizer is not None else None
    return ChatPrompt(text, ids, params, mode, parse_tools and bool(tools), encoding, images)


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

    Image content parts (``image_url`` with a data: URL, ``image_pil``, ``image``: see
    :mod:`~deepinfer_core.entrypoints.chat_images`) go to the engine as ``multi_modal_data``, on a model
    with a vision tower. Returns ``generate``'s RequestOutputs, each with ``chat_messages``: per completion, the parsed
    assistant message (``{role, content, reasoning_content, tool_calls}``, see :func:`chat_message`).
    ``reasoning_effort``: V4.1 takes 1..100 or low/high/max (default 75, written in thinking mode only);
    V4 takes OpenAI's levels, of which "max" adds DeepSeek's maximum-effort instruction. Raises
    ValueError for a conversation that cannot be encoded or a bad reasoning effort.
    """
    conversations = [messages] if not messages or isinstance(messages[0], Mapping) else list(messages)
    tokenizer = llm.get_tokenizer()
    model_config = getattr(getattr(llm, "llm_engine", None), "model_config", None)
    encoding, image_token_id = chat_encoding_for(model_config), image_token_id_for(model_config)
    prompts = [build_chat_prompt(tokenizer, conv, sampling_params, thinking, tools, response_format,
                                 encoding=encoding, image_token_id=image_token_id,
                                 reasoning_effort=reasoning_effort, **encode_kwargs)
               for conv in conversations]
    outs = llm.generate([p.engine_prompt for p in prompts], [p.params for p in prompts], use_tqdm=use_tqdm)
    for out, prompt in zip(outs, prompts):
        out.chat_messages = [prompt.parse(c.text) for c in out.outputs]
    return outs


def chat_message(output: RequestOutput, index: int = 0) -> dict[str, Any]:
    """The parsed assistant message of completion ``index`` of a :func:`chat` output."""
    return output.chat_messages[index]

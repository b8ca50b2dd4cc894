"""InputProcessor: a prompt and its SamplingParams become the sequences of one request (the prompt's
token ids, checked against the model and the scheduler; per-sequence seeds; compiled grammars)."""

from __future__ import annotations

from typing import Any

import torch

from deepinfer_core.config import ModelConfig, SchedulerConfig
from deepinfer_core.engine.multimodal import MultiModalItem, expand_image_placeholders
from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.sampling.structured import StructuredOutputManager

PromptType = str | dict | list[int]


class Request:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], seqs: list[Sequence]):
        self.request_id, self.prompt, self.prompt_token_ids, self.seqs = request_id, prompt, prompt_token_ids, seqs


def prompt_ids(prompt: Any, encode: Any) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a prompt given as text, token ids or a ``{"prompt"|"prompt_token_ids"}`` dict."""
    if isinstance(prompt, str):
        return prompt, encode(prompt)
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"], encode(prompt["prompt"])
        raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
    if isinstance(prompt, (list, tuple)):
        return None, list(prompt)
    raise ValueError(f"prompt must be a string, a token-id list or a dict, got {type(prompt).__name__}")


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    if tokenizer is None:
        raise ValueError("this model folder has no tokenizer; pass prompt_token_ids instead")
    return tokenizer.encode(prompt, add_special_tokens=True)


class InputProcessor:
    def __init__(self, model_config: ModelConfig, scheduler_config: SchedulerConfig, tokenizer: Any,
                 structured: StructuredOutputManager, seed: int):
        self.model_config, self.scheduler_config = model_config, scheduler_config
        self.tokenizer, self.structured = tokenizer, structured
        self._seed_rng = torch.Generator().manual_seed(seed)

    def encode(self, prompt: str) -> list[int]:
        return encode_prompt(self.tokenizer, prompt)

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams) -> Request:
        """The request's sequences; raises ValueError when the request is invalid."""
        text, ids = prompt_ids(prompt, self.encode)
        ids, mm_items = self.multimodal(prompt, ids)
        self.validate(ids, params)
        so = params.structured_outputs
        grammar = self.structured.compile(so) if so is not None else None
        seqs = []
        for i in range(params.n):
            gen = torch.Generator()
            if params.seed is not None:
                gen.manual_seed((params.seed * 1000003 + i) % 2**64)  # any int seed, no overflow
            else:
                gen.manual_seed(int(torch.randint(0, 2**62, (1,), generator=self._seed_rng)))
            seqs.append(Sequence(request_id, i, ids, params, gen, self.model_config.eos_token_ids))
            seqs[-1].mm_items = mm_items
            if grammar is not None:
                seqs[-1].grammar = self.structured.new_state(grammar, so)
        return Request(request_id, text, ids, seqs)

    def multimodal(self, prompt: PromptType, ids: list[int]) -> tuple[list[int], list[MultiModalItem]]:
        """The prompt's ids with the images of ``multi_modal_data={"image": [...]}`` (PIL images or encoded
        bytes) expanded into their spans, one per image token of the prompt, and the images; ValueError when
        the model reads no images or an image is unusable (this request only). A prompt processed already
        (``{"prompt_token_ids": expanded ids, "mm_items": items}``, what ``AsyncLLM`` hands the engine after
        decoding the images off its thread) passes as it is."""
        if isinstance(prompt, dict) and "mm_items" in prompt:
            return ids, list(prompt["mm_items"])
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if not data:
            return ids, []
        unknown = sorted(set(data) - {"image"})
        if unknown:
            raise ValueError(f"multi_modal_data holds {unknown}; this engine reads only 'image'")
        images = data["image"] if isinstance(data["image"], (list, tuple)) else [data["image"]]
        vision = getattr(self.model_config, "vision_config", None)
        if not vision:
            raise ValueError("this model has no vision tower: a prompt cannot carry images")
        from deepinfer_core.models.deepseek_v41.image_processor import VisionConfig, preprocess

        vc = VisionConfig.of(vision)
        return expand_image_placeholders(ids, images, self.model_config.image_token_id,
                                         lambda image: preprocess(image, vc))

    def validate(self, ids: list[int], params: SamplingParams) -> None:
        vocab, max_len = self.model_config.vocab_size, self.scheduler_config.max_model_len
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in ids if not isinstance(t, int) or t < 0 or t >= vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if len(ids) >= max_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; max_model_len is {max_len} "
                             "(prompt plus at least one generated token must fit)")
        sched = self.scheduler_config
        if not sched.enable_chunked_prefill and len(ids) > sched.max_num_batched_tokens:
            raise ValueError(f"the prompt has {len(ids)} tokens but max_num_batched_tokens is "
                             f"{sched.max_num_batched_tokens} and chunked prefill is off")
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids {params.stop_token_ids} are outside the vocabulary [0, {vocab})")
        self._validate_limits(len(ids), params)

    def _validate_limits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """What one request may ask of the engine: ``max_tokens`` that fit the context beside the prompt
        (vLLM's server answers 400 otherwise; ``None`` generates up to ``max_model_len``), and ``n``
        sequences, at most what one step runs (so that one request cannot hold the engine for minutes)."""
        sched = self.scheduler_config
        if params.n > sched.max_num_seqs:
            raise ValueError(f"n is {params.n}, more than the {sched.max_num_seqs} sequences that run at once "
                             "(max_num_seqs)")
        room = sched.max_model_len - num_prompt_tokens
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(f"max_tokens is {params.max_tokens}, but max_model_len is {sched.max_model_len} "
                             f"and the prompt has {num_prompt_tokens} tokens: at most {room} tokens can be "
                             "generated (max_tokens=None: up to the context's end)")

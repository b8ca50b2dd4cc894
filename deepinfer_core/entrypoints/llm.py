"""The offline API: ``LLM(model=None, backend="cpu_ref").generate(prompts, sampling_params)``."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from tqdm import tqdm

from deepinfer_core.engine.llm_engine import EngineArgs, LLMEngine
from deepinfer_core.outputs import CompletionOutput, RequestOutput
from deepinfer_core.sampling.params import SamplingParams

PromptType = str | dict | list[int]


class LLM:
    """Build an engine by backend name; ``model=None`` is the embedded default checkpoint."""

    def __init__(self, model: str | Path | None = None, backend: str = "cpu_ref", dtype: Any = None,
                 **engine_args: Any):
        known = {f.name for f in fields(EngineArgs)}
        unknown = sorted(set(engine_args) - known)
        if unknown:
            raise TypeError(f"unknown engine arguments {unknown}; known: {sorted(known)}")
        self.llm_engine = LLMEngine(EngineArgs(model=model, backend=backend, dtype=dtype, **engine_args))

    def reset_prefix_cache(self) -> None:
        self.llm_engine.reset_prefix_cache()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; an invalid prompt gets an output with ``error`` set (the others run)."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        engine = self.llm_engine
        results: dict[str, RequestOutput] = {}
        order = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            rid = f"gen-{id(self)}-{i}-{len(engine.requests)}"
            order.append(rid)
            try:
                engine.add_request(rid, prompt, p)
            except ValueError as exc:
                text = prompt if isinstance(prompt, str) else None
                results[rid] = RequestOutput(rid, text, [], [CompletionOutput(0, "", [], "error")], True, 0, str(exc))
        bar = tqdm(total=len(prompts), desc="generating", unit="req", disable=not use_tqdm)
        bar.update(len(results))
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        finally:
            bar.close()
            for rid in order:
                if rid not in results:
                    engine.abort_request(rid)
        return [results[rid] for rid in order]

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield the growing output of one request after every step it took part in."""
        engine = self.llm_engine
        rid = engine.add_request(None, prompt, sampling_params or SamplingParams())
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            engine.abort_request(rid)

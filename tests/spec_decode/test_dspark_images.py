"""Speculative decoding with images: ``LLM.chat`` on the tiny DeepSeek-V4.1 with a vision tower, drafting with
DSpark (``speculative_config={"method": "dspark"}``), gives the greedy tokens of the engine without
speculation (float64, cpu_ref) for a mix of conversations with and without images, through chunked
prefill that cuts the image spans and through prefix-cache hits over them. The oracle drafter of
``spec_fixtures`` places acceptances and rejections at every offset, so that rollback runs on sequences
whose prompts hold images. The target forward of the speculative runner reads the images' rows: without
them the tokens differ (the last test).
"""

from __future__ import annotations

import engine_fixtures
import pytest
from image_fixtures import conversation, one_torch_thread, tiny_vl_path
from spec_fixtures import oracle_drafts

from deepinfer_core import SamplingParams
from deepinfer_core.worker.spec_model_runner import SpecDecodeModelRunner

__all__ = ["one_torch_thread", "tiny_vl_path"]  # fixtures
make_llm = engine_fixtures.make_llm
pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONVERSATIONS = [conversation(i) for i in range(7)]  # two text only, the others one to three images
MAX_TOKENS = 8
ENGINE = dict(dtype="float64", numerics="unquantised", block_size=8, max_model_len=192)
DSPARK = {"speculative_config": {"method": "dspark", "num_speculative_tokens": 2}}
_REF: dict = {}


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def chat_tokens(llm, conversations) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.chat(conversations, greedy(MAX_TOKENS))]


def reference(make_llm, path) -> dict[tuple[int, ...], list[int]]:
    """Prompt token ids (images widened) -> the greedy tokens without speculation, a few past MAX_TOKENS."""
    if str(path) not in _REF:
        outs = make_llm(path, **ENGINE).chat(CONVERSATIONS, greedy(MAX_TOKENS + 4))
        _REF[str(path)] = {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in outs}
        assert len(_REF[str(path)]) == len(CONVERSATIONS)  # one continuation per prompt: the oracle's key
    return _REF[str(path)]


def expected(ref: dict, conversations=CONVERSATIONS) -> list[list[int]]:
    return [tokens[:MAX_TOKENS] for tokens in ref.values()][: len(conversations)]


VARIANTS = {
    "default": {},
    "chunks-of-7": dict(max_num_batched_tokens=7, max_num_seqs=3),
    "prefix-cache": dict(enable_prefix_caching=True),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_dspark_with_images_greedy_equal(variant, tiny_vl_path, make_llm):
    ref = reference(make_llm, tiny_vl_path)
    llm = make_llm(tiny_vl_path, **ENGINE, **DSPARK, **VARIANTS[variant])
    assert isinstance(llm.llm_engine.runner, SpecDecodeModelRunner)
    assert chat_tokens(llm, CONVERSATIONS) == expected(ref)
    if variant == "prefix-cache":  # again: hits through the image spans
        outs = llm.chat(CONVERSATIONS[2:4], greedy(MAX_TOKENS))
        assert all(o.num_cached_tokens >= 8 for o in outs)
        assert [o.outputs[0].token_ids for o in outs] == expected(ref)[2:4]
    assert llm.llm_engine.spec_decode_stats()["num_draft_tokens"] > 0


def test_oracle_drafts_with_images_greedy_equal(tiny_vl_path, make_llm):
    """Accepted and rejected drafts at every offset after prompts that hold images."""
    ref = reference(make_llm, tiny_vl_path)
    llm = make_llm(tiny_vl_path, **ENGINE, **DSPARK, max_num_batched_tokens=16)
    oracle_drafts(llm, ref, lambda seq, m, j: (seq.seq_id * 7 + m * 3 + j * 5) % 4 == 0)
    assert chat_tokens(llm, CONVERSATIONS) == expected(ref)
    stats = llm.llm_engine.spec_decode_stats()
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]


def test_the_speculative_runner_reads_the_images(tiny_vl_path, make_llm):
    """The check has teeth: image rows dropped from the speculative steps alone (the plain steps keep them)
    give other tokens."""
    ref = reference(make_llm, tiny_vl_path)
    llm = make_llm(tiny_vl_path, **ENGINE, **DSPARK)
    runner, dropped = llm.llm_engine.runner, []
    execute, mm_embeds = runner.execute_model, runner._mm_embeds
    speculating = [False]

    def execute_model(so):
        speculating[0] = so.speculate
        return execute(so)

    def without_images(so):
        rows = mm_embeds(so)
        if rows is None or not speculating[0]:
            return rows
        dropped.append(so)
        return None

    runner.execute_model, runner._mm_embeds = execute_model, without_images
    assert chat_tokens(llm, CONVERSATIONS) != expected(ref)
    assert dropped

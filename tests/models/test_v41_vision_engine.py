"""Images through the engine: ``LLM.generate`` with ``multi_modal_data`` on a tiny DeepSeek-V4.1 with a
vision tower, against DeepSeek's model.py decoding greedily (:mod:`test_v41_vision` builds the prompt and
the reference), prefix caching keyed by the images' content, and per-request image errors.
"""

from __future__ import annotations

import functools
import io

import pytest
import test_v41_vision as tv
import torch
import v41_reference as ref
from PIL import Image

from deepinfer_core import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not ref.reference_present(), reason=f"{ref.REFERENCE_DIR} not present")

MAX_TOKENS = 6
one_torch_thread = tv.one_torch_thread
tiny_vl = tv.tiny_vl


def placeholder_prompt(image_token_id: int) -> tuple[list[int], list[Image.Image]]:
    """:func:`test_v41_vision.vl_prompt`'s prompt (without its decoded tail) with one image token where each
    span goes, and the images as PIL images."""
    ids, token_types, images = tv.vl_prompt(image_token_id)
    ids, token_types = ids[:-tv.DECODE], token_types[:-tv.DECODE].tolist()
    out = [t for t, kind in zip(ids, token_types) if kind in (-1, 0)]  # text, and each span's START
    return out, [Image.open(io.BytesIO(data)) for _, data in images]


@functools.lru_cache(maxsize=1)
def reference_greedy(path) -> list[int]:
    """model.py's greedy continuation of the prompt: one prefill with both images, then one token a step."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, PretrainedConfig

    from deepinfer_core.config import ModelConfig

    cfg = ModelConfig.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(str(path), config=PretrainedConfig())
    model = ref.load_reference(cfg.to_flat(), load_file(str(path / "model.safetensors")), tokenizer, False,
                               torch.float32, max_seq_len=64)
    ip = ref.load_reference_module("image_processor")
    ids, token_types, images = tv.vl_prompt(cfg.image_token_id)
    prefill = len(ids) - tv.DECODE
    inputs = []
    for offset, data in images:
        patches, n_vit_h, n_vit_w, n_llm_h, n_llm_w = ip.load_image({"data": data}, model.reference_args)
        inputs.append(tv.types.SimpleNamespace(start=offset, patches=patches, n_vit_h=n_vit_h, n_vit_w=n_vit_w,
                                               types=ip.image_token_types(n_llm_h, n_llm_w)))
    with torch.random.fork_rng(devices=[]):
        _, logits, _ = model.forward(torch.tensor([ids[:prefill]]), 0, images=[inputs],
                                     token_types=token_types[None, :prefill])
        out = [int(logits[0].argmax())]
        for i in range(prefill, prefill + MAX_TOKENS - 1):
            _, logits, _ = model.forward(torch.tensor([[out[-1]]]), i)
            out.append(int(logits[0].argmax()))
    return out


def make_llm(path, **kw) -> LLM:
    return LLM(str(path), dtype="float32", numerics="unquantised", block_size=8, max_model_len=64, **kw)


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("batched_tokens", [64, 7], ids=["whole_prefill", "chunks_of_7"])
def test_greedy_generate_with_two_images_equals_model_py(tiny_vl, batched_tokens):
    """LLM.generate with ``multi_modal_data`` (chunks of 7 cut both images' spans) gives model.py's greedy
    tokens, beside a text-only request in the same batch."""
    llm = make_llm(tiny_vl, max_num_batched_tokens=batched_tokens, enable_prefix_caching=False)
    ids, images = placeholder_prompt(llm.llm_engine.model_config.image_token_id)
    outs = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": images}}, ids[:5]], GREEDY,
                        use_tqdm=False)
    assert len(outs[0].prompt_token_ids) == len(ids) - 2 + 2 * 17  # each placeholder became a 17-token span
    assert outs[0].outputs[0].token_ids == reference_greedy(tiny_vl)


def test_prefix_cache_hits_on_the_same_image_and_misses_on_another(tiny_vl):
    """The same images again: a prefix-cache hit through both spans, the same tokens as without a cache; the
    first image replaced (same size, other pixels): the cache stops before its span, and the tokens are
    those of that prompt without a cache."""
    llm = make_llm(tiny_vl, max_num_batched_tokens=64, enable_prefix_caching=True)
    ids, images = placeholder_prompt(llm.llm_engine.model_config.image_token_id)
    other = Image.open(io.BytesIO(tv.image_bytes(*tv.LAYOUT[1][1], seed=99)))
    first = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False)
    again = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False)
    swapped = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [other, images[1]]}}, GREEDY,
                           use_tqdm=False)
    assert first[0].outputs[0].token_ids == reference_greedy(tiny_vl)
    assert again[0].num_cached_tokens >= 40 and again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    assert swapped[0].num_cached_tokens <= 5  # the first image's span starts at position 5
    uncached = make_llm(tiny_vl, max_num_batched_tokens=64, enable_prefix_caching=False)
    alone = uncached.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [other, images[1]]}}, GREEDY,
                              use_tqdm=False)
    assert swapped[0].outputs[0].token_ids == alone[0].outputs[0].token_ids != first[0].outputs[0].token_ids


def test_an_unusable_image_fails_its_request_only(tiny_vl):
    llm = make_llm(tiny_vl, max_num_batched_tokens=64)
    ids, images = placeholder_prompt(llm.llm_engine.model_config.image_token_id)
    with pytest.raises(ValueError, match="image 1: the image data is not an image"):
        llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [images[0], b"not a png"]}}, GREEDY,
                     use_tqdm=False)
    with pytest.raises(ValueError, match="2 image placeholder.*1 image"):
        llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": images[:1]}}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="reads only 'image'"):
        llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"video": images}}, GREEDY, use_tqdm=False)
    # the engine still serves the next request
    out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == reference_greedy(tiny_vl)

"""``LLM.chat`` with image content parts on the tiny DeepSeek-V4.1 with a vision tower: an ``image_url`` part
with a data: URL, a PIL image (``image_pil``) and encoded bytes (``image``) give the tokens of
``LLM.generate`` with the same images as ``multi_modal_data`` on the encoded prompt; images in a system
message keep their order; every URL but a data: URL is refused (nothing is fetched), as are malformed
data: URLs; a model without a vision tower refuses images with a message that says so.
"""

from __future__ import annotations

import io

import pytest
from image_fixtures import VL_ENGINE, conversation, data_url, image_part, one_torch_thread, png, tiny_vl_path
from PIL import Image

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.chat_v41 import IMAGE_TOKEN, encode_messages
from deepinfer_core.entrypoints import chat_images
from deepinfer_core.entrypoints.chat_images import load_data_url, load_image_part

__all__ = ["one_torch_thread", "tiny_vl_path"]  # fixtures
pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_vl_path):
    return LLM(str(tiny_vl_path), **VL_ENGINE)


def generate_tokens(llm: LLM, messages: list[dict], images: list) -> list[int]:
    """The tokens of ``LLM.generate`` on the prompt of ``messages`` built by hand: the text tokenized around
    each image token, which becomes the model's image token id."""
    tok, image_id = llm.get_tokenizer(), llm.llm_engine.model_config.image_token_id
    ids: list[int] = []
    for k, piece in enumerate(encode_messages(messages).split(IMAGE_TOKEN)):
        ids += ([image_id] if k else []) + (tok.encode(piece, add_special_tokens=False) if piece else [])
    out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False)
    return out[0].outputs[0].token_ids


def test_image_parts_give_generate_s_tokens(llm):
    a, b = png(150, 100, seed=1), png(40, 50, seed=2)
    by_url = [{"role": "user", "content": [image_part(a), {"type": "text", "text": "and"}, image_part(b)]}]
    by_pil = [{"role": "user", "content": [{"type": "image_pil", "image_pil": Image.open(io.BytesIO(a))},
                                           {"type": "text", "text": "and"}, {"type": "image", "image": b}]}]
    expected = generate_tokens(llm, by_url, [a, b])
    out_url, out_pil = llm.chat([by_url, by_pil], GREEDY)
    assert len(out_url.prompt_token_ids) > 17 + 5  # the spans were widened from one token each
    assert out_url.outputs[0].token_ids == out_pil.outputs[0].token_ids == expected
    assert out_url.chat_messages[0]["content"] == out_url.outputs[0].text
    swapped = llm.chat([{"role": "user", "content": [image_part(b), {"type": "text", "text": "and"},
                                                     image_part(a)]}], GREEDY)
    assert swapped[0].outputs[0].token_ids != expected  # the images are read, in their order


def test_a_system_message_s_image_comes_first(llm):
    messages = conversation(10)  # an image in the system message, two in the user's
    images = [png(20, 20, seed=7), png(150, 100, seed=110), png(30, 45, seed=4)]
    assert llm.chat(messages, GREEDY)[0].outputs[0].token_ids == generate_tokens(llm, messages, images)


@pytest.mark.parametrize("url", ["https://example.com/cat.png", "http://127.0.0.1/a.png", "file:///etc/passwd",
                                 "ftp://host/x.png", "s3://bucket/key", "cat.png"])
def test_urls_other_than_data_urls_are_refused(llm, url):
    with pytest.raises(ValueError, match="image 0: images must come inline as data: URLs .*fetches nothing"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}], GREEDY)


@pytest.mark.parametrize("url, message", [
    ("data:image/png;base64,@@@@", "base64 does not decode"),
    ("data:text/plain;base64,aGVsbG8=", "holds 'text/plain', not an image"),
    ("data:image/png;base64", "needs a ','"),
    ("data:image/png;base64,", "holds no data"),
    (data_url(b"not a png at all"), "not an image Pillow can read"),
])
def test_malformed_data_urls_are_refused(llm, url, message):
    with pytest.raises(ValueError, match=message):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}], GREEDY)
    assert not llm.llm_engine.has_unfinished_requests()


def test_too_large_images_are_refused(llm, monkeypatch):
    monkeypatch.setattr(chat_images, "MAX_IMAGE_BYTES", 100)
    with pytest.raises(ValueError, match="larger than the 100 bytes"):
        load_data_url(data_url(png(40, 40, seed=0)))
    monkeypatch.undo()
    from deepinfer_core.models.deepseek_v41 import image_processor

    monkeypatch.setattr(image_processor, "MAX_SOURCE_PIXELS", 1000)
    with pytest.raises(ValueError, match="image 0: the image is 40x40 pixels, more than the 1000"):
        llm.chat([{"role": "user", "content": [image_part(png(40, 40, seed=0))]}], GREEDY)


def test_part_shapes():
    pil = Image.new("RGB", (3, 3))
    assert load_image_part({"type": "image_pil", "image_pil": pil}) is pil
    assert load_image_part({"type": "input_image", "image_url": "data:,abc"}) == b"abc"  # percent-encoded form
    assert load_image_part({"type": "image_url", "image_url": " data:image/png;base64,AAEC "}) == b"\0\1\2"
    with pytest.raises(ValueError, match="needs 'image_url.url'"):
        load_image_part({"type": "image_url", "image_url": {}})
    with pytest.raises(ValueError, match="needs 'image_pil'.*PIL image"):
        load_image_part({"type": "image_pil", "image_pil": 3})


def test_a_model_without_vision_refuses_images():
    llm = LLM(block_size=32)  # the embedded tiny DeepSeek-V4: text only
    with pytest.raises(ValueError, match="this model reads no images"):
        llm.chat([{"role": "user", "content": [{"type": "text", "text": "hi"}, image_part(png(8, 8, seed=0))]}])

"""Images through the OpenAI-compatible server, driven by the official ``openai`` client against a real uvicorn
(:func:`test_server.serving`) serving the tiny DeepSeek-V4.1 with a vision tower: chat requests with
``image_url`` parts (data: URLs) answer what offline ``LLM.chat`` answers, one at a time and from 32
concurrent clients with a mix of images and text-only requests, streaming and not; a URL the server would
have to fetch, a malformed data: URL, an unreadable or too-large image each get their own 400 while a
request beside them completes; a text-only model (DeepSeek-V4) answers an image with a 400 that says so.
Both engines are batch-invariant, so batching on the server cannot change a token.
"""

from __future__ import annotations

import asyncio

import pytest
from image_fixtures import VL_ENGINE, conversation, data_url, image_part, png, tiny_vl_path

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

import test_server as ts  # noqa: E402

from deepinfer_core import LLM, SamplingParams  # noqa: E402
from deepinfer_core.engine.args import EngineArgs  # noqa: E402
from deepinfer_core.engine.llm_engine import LLMEngine  # noqa: E402
from deepinfer_core.entrypoints.chat_utils import chat_message  # noqa: E402

__all__ = ["tiny_vl_path"]  # fixture
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
REQUEST = dict(model=ts.MODEL, temperature=0, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def server(tiny_vl_path):
    with ts.serving(LLMEngine(EngineArgs(model=str(tiny_vl_path), max_num_seqs=16, **VL_ENGINE))) as s:
        yield s


@pytest.fixture(scope="module")
def offline(tiny_vl_path):
    return LLM(str(tiny_vl_path), **VL_ENGINE)


def offline_contents(offline: LLM, conversations: list[list[dict]]) -> list[str]:
    return [chat_message(out)["content"] for out in offline.chat(conversations, GREEDY)]


def two_images() -> list[dict]:
    return [{"role": "user", "content": [image_part(png(150, 100, seed=1)), {"type": "text", "text": "versus"},
                                         image_part(png(40, 50, seed=2))]}]


def test_an_image_chat_equals_offline(server, offline):
    messages = two_images()
    (want,) = offline.chat(messages, GREEDY)
    resp = server.client().chat.completions.create(messages=messages, **REQUEST)
    assert resp.choices[0].message.content == chat_message(want)["content"]
    assert resp.usage.prompt_tokens == len(want.prompt_token_ids) > 17 + 5  # both spans widened
    stream = server.client().chat.completions.create(messages=messages, stream=True, **REQUEST)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == chat_message(want)["content"]
    server.wait_idle()


def test_32_concurrent_clients_with_images(server, offline):
    """32 clients at once, each its own conversation (text only, one image, two, one in the system message;
    some share images, so prefix-cache hits mix in), every other one streaming: every answer is offline's."""
    conversations = [conversation(i) for i in range(32)]
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=ts.KEY, max_retries=0, timeout=120)

    async def one(i: int) -> str:
        if i % 2:
            resp = await client.chat.completions.create(messages=conversations[i], **REQUEST)
            return resp.choices[0].message.content
        stream = await client.chat.completions.create(messages=conversations[i], stream=True, **REQUEST)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def main() -> list[str]:
        try:
            return await asyncio.gather(*(one(i) for i in range(32)))
        finally:
            await client.close()

    got = asyncio.run(main())
    assert got == offline_contents(offline, conversations)
    server.wait_idle()


@pytest.mark.parametrize("url", ["https://example.com/cat.png", "http://127.0.0.1:1/a.png", "file:///etc/hosts",
                                 "gopher://host/1"])
def test_a_url_to_fetch_is_refused(server, url):
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is it?"},
                                             {"type": "image_url", "image_url": {"url": url}}]}]
    with pytest.raises(openai.BadRequestError) as err:
        server.client().chat.completions.create(messages=messages, **REQUEST)
    assert err.value.status_code == 400
    assert "the server fetches nothing" in err.value.message and "data: URL" in err.value.message
    server.wait_idle()


BAD_IMAGES = {
    "bad base64": ("data:image/png;base64,iVBORw0KGgo!!!", "base64 does not decode"),
    "not an image": (data_url(b"GIF89a but nothing else"), "not an image Pillow can read"),
    "too many pixels": (data_url(png(150, 100, seed=3)), "the image is 150x100 pixels, more than the 5000"),
}


def test_bad_images_are_refused_while_a_good_request_completes(server, offline, monkeypatch):
    """Each bad image is its own request's 400, sent while a good request with an image streams; the good
    one completes with offline's answer and the server serves on."""
    from deepinfer_core.models.deepseek_v41 import image_processor

    monkeypatch.setattr(image_processor, "MAX_SOURCE_PIXELS", 5000)  # the good image has 40x50 pixels
    good = [{"role": "user", "content": [{"type": "text", "text": "a small one"}, image_part(png(40, 50, seed=4))]}]
    want = offline_contents(offline, [good])[0]
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=ts.KEY, max_retries=0, timeout=120)

    async def good_request() -> str:
        stream = await client.chat.completions.create(messages=good, stream=True, **REQUEST)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def bad_request(url: str) -> str:
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
        try:
            await client.chat.completions.create(messages=messages, **REQUEST)
        except openai.BadRequestError as exc:
            return exc.message
        return "answered"

    async def main() -> list[str]:
        try:
            return await asyncio.gather(good_request(), *(bad_request(url) for url, _ in BAD_IMAGES.values()))
        finally:
            await client.close()

    got, *refusals = asyncio.run(main())
    assert got == want
    for (name, (_, message)), refusal in zip(BAD_IMAGES.items(), refusals):
        assert "image 0: " in refusal and message in refusal, (name, refusal)
    server.wait_idle()


def test_a_text_only_model_refuses_images():
    with ts.serving(LLMEngine(EngineArgs(**ts.ENGINE))) as v4:
        with pytest.raises(openai.BadRequestError) as err:
            v4.client().chat.completions.create(messages=two_images(), **REQUEST)
        assert err.value.status_code == 400 and "this model reads no images" in err.value.message
        text = [{"role": "user", "content": [{"type": "text", "text": "still here?"}]}]
        assert v4.client().chat.completions.create(messages=text, **REQUEST).choices[0].message.content is not None

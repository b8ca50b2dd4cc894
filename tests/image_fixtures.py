"""Images for the chat-with-images tests: PNGs of random pixels, their data: URLs, a mix of conversations
(text only, one image, two images, an image in the system message) and the tiny DeepSeek-V4.1 with a vision
tower (:func:`~deepinfer_core.testing.tiny_v41.build_tiny_v41`), built once per test run. Imported by the
tests: the ``tests`` folder is on ``sys.path`` under pytest's default import mode.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

#: the offline and served engines of these tests: small blocks, room for three 40-position image spans
VL_ENGINE: dict[str, Any] = dict(dtype="float32", numerics="unquantised", block_size=8, max_model_len=192,
                                 batch_invariant=True)
_PATHS: dict[str, Path] = {}


def png(width: int, height: int, seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


def image_part(data: bytes) -> dict[str, Any]:
    """OpenAI's image content part of ``data``, inline."""
    return {"type": "image_url", "image_url": {"url": data_url(data)}}


def conversation(i: int) -> list[dict[str, Any]]:
    """Conversation ``i`` of a mix: every fourth text only, the others with one or two images of sizes and
    pixels that differ with ``i`` (some share an image, so prefix-cache hits happen), every fifth with an
    image in its system message too."""
    kind = i % 4
    parts: list[dict[str, Any]] = [{"type": "text", "text": f"Describe picture {i}."}]
    if kind >= 1:
        parts.append(image_part(png(30 + 7 * (i % 5), 40 + 5 * (i % 3), seed=i % 6)))
    if kind >= 2:
        parts.insert(0, image_part(png(150, 100, seed=100 + i)))
    messages = [{"role": "user", "content": parts}]
    if i % 5 == 0 and kind:
        messages.insert(0, {"role": "system", "content": [{"type": "text", "text": "You see images."},
                                                          image_part(png(20, 20, seed=7))]})
    return messages


@pytest.fixture(scope="session")
def tiny_vl_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of the tiny DeepSeek-V4.1 with a vision tower (seed 0), built once per test run."""
    key = str(tmp_path_factory.getbasetemp())
    if key not in _PATHS:
        from deepinfer_core.testing.tiny_v41 import build_tiny_v41

        _PATHS[key] = build_tiny_v41(tmp_path_factory.mktemp("v41_vision") / "tiny", vision=True)
    return _PATHS[key]


@pytest.fixture
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

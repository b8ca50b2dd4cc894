"""The images of chat content parts, as the engine takes them (``multi_modal_data={"image": [...]}``): a PIL
image or encoded bytes, which the model's image processor decodes and checks.

Accepted parts (vLLM's and OpenAI's shapes): ``{"type": "image_url", "image_url": {"url": URL}}`` (or the
URL as a bare string), ``{"type": "input_image", "image_url": URL}``, ``{"type": "image_pil", "image_pil":
PIL.Image}`` and ``{"type": "image", "image": PIL.Image | bytes | URL}``. A URL must be a ``data:`` URL:
deepinfer fetches nothing (a server that fetched would reach whatever its host reaches, on any client's
word), so http, https, file and every other scheme are refused, naming the fix.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import unquote_to_bytes

from PIL import Image

from deepinfer_core.chat_v41 import image_parts

#: the largest encoded image a data: URL may carry (the pixel count is bounded again where it is decoded)
MAX_IMAGE_BYTES = 32 << 20

ImageInput = Image.Image | bytes


def load_data_url(url: str) -> bytes:
    """The bytes of a ``data:[<media type>][;base64],<data>`` URL; ValueError for any other URL, a media
    type other than an image's, bad base64 or more than :data:`MAX_IMAGE_BYTES`."""
    scheme = url.split(":", 1)[0].lower() if ":" in url[:16] else ""
    if scheme != "data":
        got = f"a {scheme}: URL" if scheme else f"{url[:40]!r}"
        raise ValueError("images must come inline as data: URLs (data:image/png;base64,...): the server fetches "
                         f"nothing, so http, https and file URLs are refused; got {got}")
    head, sep, payload = url[5:].partition(",")
    if not sep:
        raise ValueError("a data: URL needs a ',' between its media type and its data")
    params = [p.strip().lower() for p in head.split(";")]
    media = params[0]
    if media and not media.startswith("image/"):
        raise ValueError(f"the data: URL holds {media!r}, not an image (image/png, image/jpeg, ...)")
    if "base64" in params[1:]:
        if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
            raise ValueError(f"the image is larger than the {MAX_IMAGE_BYTES} bytes an image may have")
        try:
            data = base64.b64decode("".join(payload.split()), validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"the data: URL's base64 does not decode ({exc})") from None
    else:
        data = unquote_to_bytes(payload)
    if len(data) > MAX_IMAGE_BYTES:
        raise ValueError(f"the image is larger than the {MAX_IMAGE_BYTES} bytes an image may have")
    if not data:
        raise ValueError("the data: URL holds no data")
    return data


def _url_of(part: Mapping[str, Any]) -> Any:
    value = part.get("image_url")
    return value.get("url") if isinstance(value, Mapping) else value


def load_image_part(part: Mapping[str, Any]) -> ImageInput:
    """The image of one image content part (a PIL image or encoded bytes); ValueError naming what is wrong."""
    kind = part.get("type")
    value = part.get("image_pil") if kind == "image_pil" else part.get("image") if kind == "image" else _url_of(part)
    if isinstance(value, (Image.Image, bytes)):
        return value
    if isinstance(value, bytearray):
        return bytes(value)
    if isinstance(value, str):
        return load_data_url(value.strip())
    field = {"image_pil": "image_pil", "image": "image"}.get(kind, "image_url.url")
    raise ValueError(f"an {kind!r} part needs {field!r}: a data: URL"
                     + (", a PIL image or encoded bytes" if kind in ("image", "image_pil") else "")
                     + f", got {type(value).__name__}")


def load_chat_images(messages: Sequence[Mapping[str, Any]]) -> list[ImageInput]:
    """The images of a conversation in the order of their image tokens in its prompt; ValueError naming the
    image (counted from 0 in that order) that cannot be used."""
    images = []
    for i, part in enumerate(image_parts(messages)):
        try:
            images.append(load_image_part(part))
        except ValueError as exc:
            raise ValueError(f"image {i}: {exc}") from None
    return images


__all__ = ["MAX_IMAGE_BYTES", "ImageInput", "load_chat_images", "load_data_url", "load_image_part"]

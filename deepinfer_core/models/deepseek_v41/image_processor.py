"""DeepSeek-V4.1's image preprocessing (Pillow): an image becomes ViT patches and the token span the
language model reads in its place.

The pixel size is chosen so that the span fits ``max_image_tokens``: small images are scaled up to
``min_pixels``, the size is rounded up to whole patches, and a size whose span would be too long is
shrunk (keeping the aspect ratio) to the largest one that fits. The image is then letterboxed into that
size on mid grey and cut into ``patch_size`` squares in reading order. The ViT sees an ``n_vit_h x
n_vit_w`` patch grid; the aligner merges ``downsample_ratio``-square cells of it into an ``n_llm_h x
n_llm_w`` token grid, which the language model reads as

    [START] + ([IMAGE] * n_llm_w + [NEWLINE]) * n_llm_h + [END]

with every position of the span carrying the image token id in the prompt (``ImageSpan.types`` tells
them apart). Same arithmetic as the release's ``inference/image_processor.py``.
"""

from __future__ import annotations

import hashlib
import io
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

#: token types of an image span's positions (text positions are -1)
TEXT, IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END = -1, 0, 1, 2, 3
#: the letterbox colour
PAD_COLOR = (127, 127, 127)
#: RMSNorm epsilon of the ViT (fixed in the release's vision.py, not in the config)
VISION_NORM_EPS = 1e-6
#: images with more source pixels than this are refused before they are decoded (an image this large is
#: shrunk to at most ``max_image_tokens`` anyway; the cap keeps a hostile file from exhausting memory)
MAX_SOURCE_PIXELS = 64 * 1024 * 1024


class ImageError(ValueError):
    """An image a request carries cannot be used (not an image, too large, unreadable)."""


@dataclass(frozen=True)
class VisionConfig:
    """The ``vision_config`` fields the preprocessing and the tower read (Hugging Face names)."""

    num_hidden_layers: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    patch_size: int = 14
    rope_theta: float = 10000.0
    downsample_ratio: int = 3
    max_image_tokens: int = 1024
    min_pixels: int = 544 * 544
    max_wh_ratio: float | None = None

    @classmethod
    def of(cls, vision_config: dict[str, Any]) -> VisionConfig:
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in vision_config.items() if k in names})

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True)
class ImageGrid:
    """An image's resize plan: the pixel size it is letterboxed into and the grids that follow."""

    height: int
    width: int
    n_vit_h: int
    n_vit_w: int
    n_llm_h: int
    n_llm_w: int

    @property
    def num_tokens(self) -> int:
        """Positions of the image's span in the prompt."""
        return span_length(self.n_llm_h, self.n_llm_w)


@dataclass(frozen=True)
class ImageSpan:
    """One preprocessed image: its patches [n_vit_h * n_vit_w, 3, p, p] (bfloat16, as the release hands
    them to the ViT), its grid, its span's token types and the hash of its pixels (the prefix cache's
    key for the span: equal hashes, equal embeddings)."""

    patches: torch.Tensor
    grid: ImageGrid
    mm_hash: str

    @property
    def num_tokens(self) -> int:
        return self.grid.num_tokens

    @property
    def types(self) -> torch.Tensor:
        return span_types(self.grid.n_llm_h, self.grid.n_llm_w)


def span_length(n_llm_h: int, n_llm_w: int) -> int:
    return n_llm_h * (n_llm_w + 1) + 2


def span_types(n_llm_h: int, n_llm_w: int) -> torch.Tensor:
    """The token type of every position of a span, in order."""
    row = [IMAGE] * n_llm_w + [IMAGE_NEW_LINE]
    return torch.tensor([IMAGE_START, *row * n_llm_h, IMAGE_END], dtype=torch.long)


def _llm_grid(height: int, width: int, vc: VisionConfig) -> tuple[int, int]:
    r, p = vc.downsample_ratio, vc.patch_size
    return math.ceil(height // p / r), math.ceil(width // p / r)


def _largest_fitting(height: float, width: float, vc: VisionConfig) -> tuple[int, int]:
    """The pixel size (whole patches, aspect kept) of the longest span that fits ``max_image_tokens``:
    an n_h x n_w cell grid costs n_h * (n_w + 1) + 2 positions; n_w is solved for at the image's aspect
    ratio. An image too thin for one cell across collapses to a single column (or row)."""
    budget, p = vc.max_image_tokens, vc.patch_size
    cell = p * vc.downsample_ratio
    aspect = height / width
    cols = math.sqrt((budget - 2) / aspect + 0.25) - 0.5
    rows = cols * aspect
    if cols < 1.0:
        return (budget - 2) // 2 * cell, cell
    if rows < 1.0:
        return cell, (budget - 3) * cell
    scale = min(math.floor(cols) * cell / width, math.floor(rows) * cell / height)
    return math.floor(height * scale / p) * p, math.floor(width * scale / p) * p


def plan_grid(width: int, height: int, vc: VisionConfig) -> ImageGrid:
    """The resize plan of an image of ``width`` x ``height`` source pixels."""
    if width <= 0 or height <= 0:
        raise ImageError(f"the image is {width}x{height} pixels: nothing to read")
    p = vc.patch_size
    if vc.max_wh_ratio is not None and width > height * vc.max_wh_ratio:
        width = height * vc.max_wh_ratio
    if width * height < vc.min_pixels:
        grow = (vc.min_pixels / (width * height)) ** 0.5
        width, height = int(width * grow), int(height * grow)
    best_h, best_w = math.ceil(height / p) * p, math.ceil(width / p) * p
    n_h, n_w = _llm_grid(best_h, best_w, vc)
    if span_length(n_h, n_w) > vc.max_image_tokens:
        best_h, best_w = _largest_fitting(height, width, vc)
        n_h, n_w = _llm_grid(best_h, best_w, vc)
    if not (best_h and best_w) or span_length(n_h, n_w) > vc.max_image_tokens:
        raise ImageError(f"an image of {width}x{height} pixels fits no grid of at most {vc.max_image_tokens} "
                         "tokens")
    return ImageGrid(best_h, best_w, best_h // p, best_w // p, n_h, n_w)


def load_image(data: Image.Image | bytes) -> Image.Image:
    """An RGB image from a Pillow image or encoded bytes; :class:`ImageError` when it is not a readable
    image or has more than :data:`MAX_SOURCE_PIXELS` pixels."""
    if isinstance(data, (bytes, bytearray)):
        try:
            source = Image.open(io.BytesIO(data))
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
            raise ImageError(f"the image data is not an image Pillow can read ({exc})") from exc
    elif isinstance(data, Image.Image):
        source = data
    else:
        raise ImageError(f"an image must be a PIL.Image.Image or encoded bytes, got {type(data).__name__}")
    if source.width * source.height > MAX_SOURCE_PIXELS:
        raise ImageError(f"the image is {source.width}x{source.height} pixels, more than the "
                         f"{MAX_SOURCE_PIXELS} this server reads")
    try:
        return source.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageError(f"the image could not be decoded ({exc})") from exc


def preprocess(image: Image.Image | bytes, vc: VisionConfig) -> ImageSpan:
    """One image as the ViT reads it: letterboxed (or stretched, past ``max_wh_ratio``) into its planned
    size, scaled to [-1, 1], rounded to bfloat16 and cut into patches in reading order, each patch's
    values channel-major (c, row, column) as the patch embedding's weight expects them."""
    rgb = load_image(image)
    grid = plan_grid(rgb.width, rgb.height, vc)
    size = (grid.width, grid.height)
    if vc.max_wh_ratio is not None and rgb.width >= vc.max_wh_ratio * rgb.height:
        rgb = rgb.resize(size)
    else:
        rgb = ImageOps.pad(rgb, size, color=PAD_COLOR)
    pixels = np.asarray(rgb, dtype=np.uint8)
    mm_hash = hashlib.sha256(pixels.tobytes() + repr(pixels.shape).encode()).hexdigest()
    x = torch.from_numpy(pixels.astype(np.float32)).permute(2, 0, 1) / 255
    x = ((x - 0.5) / 0.5).to(torch.bfloat16)
    p = vc.patch_size
    patches = x.reshape(3, grid.n_vit_h, p, grid.n_vit_w, p).permute(1, 3, 0, 2, 4)
    return ImageSpan(patches.reshape(grid.n_vit_h * grid.n_vit_w, 3, p, p), grid, mm_hash)


__all__ = ["IMAGE", "IMAGE_END", "IMAGE_NEW_LINE", "IMAGE_START", "TEXT", "ImageError", "ImageGrid", "ImageSpan",
           "VisionConfig", "load_image", "plan_grid", "preprocess", "span_length", "span_types"]

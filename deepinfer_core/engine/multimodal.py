"""A request's images as the engine carries them (vLLM's ``multi_modal_data``): each image token of the
prompt expanded into the image's span, the span's place (``PlaceholderRange``), the preprocessed image and
its content hash (``mm_hash``), which keys the prefix cache for the blocks the span covers.

Invariant: a prompt position lies inside a ``PlaceholderRange`` exactly when it reads an image's
embeddings; such positions carry the image token id and are dead to Engram's n-grams. The model's
``embed_image`` gives a span's rows once per request (the worker keeps them while the request lives); a
step that computes part of a span reads the rows of the positions it computes, so a prefill chunk may
cut a span anywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer_core.model.metadata import DEAD, MultiModalEmbeds


@dataclass(frozen=True)
class PlaceholderRange:
    """Positions ``offset .. offset + length - 1`` of the prompt hold one image's span."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class MultiModalItem:
    """One image of a request: where its span lies, the preprocessed image (the model's processor output,
    e.g. DeepSeek-V4.1's ``ImageSpan``) and its content hash."""

    placeholder: PlaceholderRange
    data: Any
    mm_hash: str


def expand_image_placeholders(token_ids: list[int], images: Sequence[Any], image_token_id: int,
                              preprocess: Any) -> tuple[list[int], list[MultiModalItem]]:
    """``token_ids`` with each ``image_token_id`` replaced by its image's span (``num_tokens`` copies of the
    id), and the items in prompt order; ``preprocess(image)`` gives an object with ``num_tokens`` and
    ``mm_hash``. ValueError when the images and the placeholders do not pair up."""
    found = sum(t == image_token_id for t in token_ids)
    if found != len(images):
        raise ValueError(f"the prompt holds {found} image placeholder(s) (token {image_token_id}) but "
                         f"{len(images)} image(s) were given")
    out: list[int] = []
    items: list[MultiModalItem] = []
    pending = iter(images)
    for token in token_ids:
        if token != image_token_id:
            out.append(token)
            continue
        try:
            image = preprocess(next(pending))
        except ValueError as exc:
            raise ValueError(f"image {len(items)}: {exc}") from exc
        items.append(MultiModalItem(PlaceholderRange(len(out), image.num_tokens), image, image.mm_hash))
        out.extend([image_token_id] * image.num_tokens)
    return out, items


def block_extra_keys(items: Sequence[MultiModalItem], start: int, end: int) -> bytes:
    """What positions ``start .. end - 1`` read besides their token ids: the offset and hash of every image
    whose span overlaps them (the same ids with another image must not hit the prefix cache)."""
    keys = [f"{it.placeholder.offset}:{it.mm_hash}" for it in items
            if it.placeholder.offset < end and start < it.placeholder.end]
    return ";".join(keys).encode()


def mark_dead(token_ids: list[int], first: int, items: Sequence[MultiModalItem]) -> list[int]:
    """``token_ids`` (positions ``first ..``) with every image position replaced by DEAD (Engram history)."""
    out = list(token_ids)
    for it in items:
        for p in range(max(first, it.placeholder.offset), min(first + len(out), it.placeholder.end)):
            out[p - first] = DEAD
    return out


def gather_mm_embeds(parts: Sequence[tuple[int, int, int, Sequence[MultiModalItem], Any]]) -> MultiModalEmbeds | None:
    """The step's image rows: ``parts`` holds, per scheduled span, (its first row in the batch, first
    position, end position, its request's items, ``embed(item_index) -> [length, D]``)."""
    rows, embeds = [], []
    for row0, start, end, items, embed in parts:
        for k, it in enumerate(items):
            lo, hi = max(start, it.placeholder.offset), min(end, it.placeholder.end)
            if lo < hi:
                rows.append(torch.arange(lo - start, hi - start) + row0)
                embeds.append(embed(k)[lo - it.placeholder.offset:hi - it.placeholder.offset])
    if not rows:
        return None
    return MultiModalEmbeds(torch.cat(rows), torch.cat(embeds))


__all__ = ["MultiModalItem", "PlaceholderRange", "block_extra_keys", "expand_image_placeholders",
           "gather_mm_embeds", "mark_dead"]

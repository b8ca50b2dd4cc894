"""Incremental detokenisation: a sequence's output text grown by decoding only its most recent tokens.

Decoding the whole output at every step costs time linear in its length, so quadratic over a generation.
Two offsets into the output ids cut the work to a small window: ``read_offset`` is where the text shown so
far ends, ``prefix_offset`` a point before it. Each step decodes ``ids[prefix_offset:]`` and
``ids[prefix_offset:read_offset]``; what the first decodes to beyond the second is the new text. The
context before ``read_offset`` lets tokenizers whose text depends on its neighbours (a leading space that
is dropped at the start, for one) decode the new tokens as they would within the whole output.

Text ending in U+FFFD (an incomplete UTF-8 character, as far as the tokens go) is held back and the
offsets stay put until a later token completes it, so the offsets only ever stop where the full decode
splits cleanly: the text built up equals ``tokenizer.decode(ids)``.

The engine decodes through :func:`fast_decoder`: for a transformers tokenizer backed by a ``tokenizers``
``Tokenizer`` that cleans up no spaces, the backend's own ``decode``, which returns the same text without
transformers' per-call Python layers (two decodes per token add up at large batches).

Stop strings are found here too (:meth:`IncrementalDetokenizer.advance`): only in text new since the
last update, and the shown text is cut where the first one begins. Until the sequence finishes, what it
reports (:meth:`IncrementalDetokenizer.get_next_output_text`) holds back the tail that could still grow
into a stop string, so a stream never shows part of one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class _BackendDecoder:
    """``decode`` straight through a ``tokenizers.Tokenizer``."""

    def __init__(self, backend: Any):
        self.backend = backend

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)


def fast_decoder(tokenizer: Any) -> Decoder:
    """What decodes like ``tokenizer.decode``: its ``tokenizers`` backend where transformers' decode adds
    nothing to the backend's text (its own ``decode``/``_decode``, no space clean-up), else the tokenizer."""
    try:
        from tokenizers import Tokenizer
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return tokenizer
    cls = type(tokenizer)
    if (isinstance(getattr(tokenizer, "_tokenizer", None), Tokenizer) and isinstance(tokenizer, TokenizersBackend)
            and cls.decode is PreTrainedTokenizerBase.decode and cls._decode is TokenizersBackend._decode
            and not getattr(tokenizer, "clean_up_tokenization_spaces", True)):
        return _BackendDecoder(tokenizer._tokenizer)
    return tokenizer


def stop_buffer_length(stop: Sequence[str]) -> int:
    """Characters to hold back from a stream: a stop string ``s`` that ends in new text starts at most
    ``len(s) - 1`` characters before it (see :meth:`IncrementalDetokenizer.advance`)."""
    return max((len(s) for s in stop), default=1) - 1


class IncrementalDetokenizer:
    """The output text of one sequence, kept up to date as its output ids grow."""

    def __init__(self) -> None:
        self.text = ""  # decode of ids[:read_offset]
        self.prefix_offset = 0
        self.read_offset = 0
        self.output_text = ""  # what the caller shows: the text, cut before a stop string

    def advance(self, tokenizer: Decoder, ids: list[int], end: int, skip_special_tokens: bool, last: bool,
                stop: Sequence[str] = ()) -> str | None:
        """Bring ``output_text`` up to ``ids[:end]``; returns the stop string that ended it, if one did.

        Only a stop string that ends in text new since the last update counts: one completed while
        ``min_tokens`` held stops back (``stop`` empty then) was passed over and must not cut the text now.
        """
        text = self.update(tokenizer, ids, end, skip_special_tokens, last)
        if text is None:
            return None
        prev = len(self.output_text)
        for s in stop:
            cut = text.find(s, max(0, prev - len(s) + 1))
            if cut >= 0:
                self.output_text = text[:cut]
                return s
        self.output_text = text
        return None

    def get_next_output_text(self, finished: bool, stop: Sequence[str] = ()) -> str:
        """The text to report: ``output_text``, less its last ``stop_buffer_length`` characters until the
        sequence has ``finished`` (vLLM's hold-back). Those could be the start of a stop string that a later
        token completes, which would cut them; so every text reported is a prefix of the final one.
        """
        held = 0 if finished else stop_buffer_length(stop)
        return self.output_text[: len(self.output_text) - held] if held else self.output_text

    def update(self, tokenizer: Decoder, ids: list[int], end: int, skip_special_tokens: bool,
               last: bool) -> str | None:
        """The text of ``ids[:end]``: the ids of the previous call, possibly with more after them.

        ``None`` while the text ends in an incomplete character, unless ``last``: then that text is
        returned as is (with its U+FFFD) and the offsets stay where they were.
        """
        window = tokenizer.decode(ids[self.prefix_offset : end], skip_special_tokens=skip_special_tokens)
        if window.endswith(REPLACEMENT_CHAR) and not last:
            return None
        prefix = tokenizer.decode(ids[self.prefix_offset : self.read_offset], skip_special_tokens=skip_special_tokens)
        text = self.text + window[len(prefix) :]
        if len(window) > len(prefix) and not window.endswith(REPLACEMENT_CHAR):
            self.text, self.prefix_offset, self.read_offset = text, self.read_offset, end
        return text

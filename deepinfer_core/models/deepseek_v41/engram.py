"""The Engram hashing of a DeepSeek-V4.1 checkpoint: its layout from the config and the tokenizer shipped
with the weights (the compressed-id map is derived from that tokenizer, and every hash multiplier from
the map's size, so the two must belong together: a mismatch is refused)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from deepinfer_core.model.errors import CheckpointError
from deepinfer_core.models.deepseek_v41.engram_hash import EngramHasher, EngramHashLayout, compressed_token_map


def _tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer, PretrainedConfig

    try:
        return AutoTokenizer.from_pretrained(str(folder), config=PretrainedConfig())
    except Exception as exc:
        raise CheckpointError(f"Engram needs the checkpoint's tokenizer to derive its n-gram ids; none could "
                              f"be loaded from {folder}: {exc}") from exc


#: the files a tokenizer folder's tokenizer is read from (the rest of a checkpoint folder is not)
_TOKENIZER_FILES = ("tokenizer", "special_tokens", "vocab", "merges", "added_tokens")


def token_map_of(folder: Path) -> tuple[list[int], int]:
    """:func:`compressed_token_map` of the tokenizer in ``folder``, kept per folder while its tokenizer files
    keep their sizes and times: decoding the whole vocabulary takes seconds at the release's size, and an
    engine rebuilt on the same checkpoint in one process would redo it."""
    folder = Path(folder).resolve()
    stamp = tuple(sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in folder.iterdir()
                         if f.name.startswith(_TOKENIZER_FILES))) if folder.is_dir() else ()
    token_map, size = _token_map(str(folder), stamp)
    return list(token_map), size


@functools.lru_cache(maxsize=4)
def _token_map(folder: str, stamp: tuple) -> tuple[tuple[int, ...], int]:
    token_map, size = compressed_token_map(_tokenizer(Path(folder)))
    return tuple(token_map), size


def engram_layout_of(text: dict[str, Any], tokenizer_dir: Path) -> EngramHashLayout:
    """The hash layout of the text config fields ``text`` with the tokenizer in ``tokenizer_dir`` (its
    ``num_rows`` and ``compressed_vocab_size`` are what the config's Engram fields must say)."""
    token_map, _ = token_map_of(Path(tokenizer_dir))
    return EngramHashLayout.build(layer_ids=text["engram_layer_ids"], max_ngram_size=text["engram_max_ngram_size"],
                                  n_heads=text["engram_n_heads"], vocab_size=text["engram_vocab_size"],
                                  token_map=token_map, pad_token_id=text.get("engram_pad_token_id", 2))


def engram_hasher(cfg: Any, path: Path, device: torch.device | str) -> EngramHasher:
    """The hasher of ``cfg``'s Engram layers, checked against the config's table rows and compressed vocab."""
    token_map, size = token_map_of(Path(path))
    if cfg.engram_compressed_vocab_size and size != cfg.engram_compressed_vocab_size:
        raise CheckpointError(f"the tokenizer in {path} maps to {size} compressed ids but the config says "
                              f"engram_compressed_vocab_size {cfg.engram_compressed_vocab_size}: it is not the "
                              "tokenizer this checkpoint's Engram tables were hashed with")
    layout = EngramHashLayout.build(layer_ids=cfg.engram_layer_ids, max_ngram_size=cfg.engram_max_ngram_size,
                                    n_heads=cfg.engram_n_heads, vocab_size=cfg.engram_vocab_size,
                                    token_map=token_map, compressed_vocab_size=size,
                                    pad_token_id=cfg.engram_pad_token_id)
    if list(layout.num_rows) != list(cfg.engram_num_embeddings):
        raise CheckpointError(f"engram_num_embeddings {cfg.engram_num_embeddings} do not match the hash layout's "
                              f"table rows {list(layout.num_rows)}")
    return EngramHasher(layout).to(device)

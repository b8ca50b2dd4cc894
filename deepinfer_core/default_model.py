"""The embedded default checkpoint: built deterministically on first use into a cache folder."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_NAME = "tiny"
DEFAULT_SEED = 0
_VERSION = "v2"


def cache_root() -> Path:
    root = os.environ.get("DEEPINFER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "deepinfer")
    return Path(root)


def default_model_path() -> Path:
    """A tiny random DeepSeek-V4 + tokenizer; nothing is downloaded."""
    from deepinfer_core.testing.tiny_model import build_tiny_checkpoint

    path = cache_root() / f"default-{DEFAULT_NAME}-{_VERSION}"
    if not (path / "config.json").is_file() or not (path / "tokenizer.json").is_file():
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        build_tiny_checkpoint(tmp, DEFAULT_NAME, seed=DEFAULT_SEED)
        tmp.replace(path) if not path.exists() else None
    return path

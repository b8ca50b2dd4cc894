"""The embedded default checkpoint: a small trained DeepSeek-V4 shipped as package data.

``tools/train_tiny.py`` reproduces it; when the folder is missing (a stripped install), a random tiny
model is built deterministically on first use into a cache folder instead.
"""

from __future__ import annotations

import os
from pathlib import Path

EMBEDDED_MODEL = Path(__file__).parent / "assets" / "deepseek-v4-tiny"
#: the trained tiny DeepSeek-V4 (an MTP layer), for what needs a V4: the MTP drafter, transformers' golden runs
EMBEDDED_V4_MODEL = Path(__file__).parent / "assets" / "deepseek-v4-tiny"
RANDOM_NAME = "tiny"
RANDOM_SEED = 0
_VERSION = "v2"


def cache_root() -> Path:
    root = os.environ.get("DEEPINFER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "deepinfer")
    return Path(root)


def default_model_path() -> Path:
    """The trained tiny model when shipped, else the random one."""
    if (EMBEDDED_MODEL / "model.safetensors").is_file():
        return EMBEDDED_MODEL
    return random_model_path()


def v4_model_path() -> Path:
    """The trained tiny V4 when shipped, else the random one."""
    if (EMBEDDED_V4_MODEL / "model.safetensors").is_file():
        return EMBEDDED_V4_MODEL
    return random_model_path()


def random_model_path() -> Path:
    """A tiny random DeepSeek-V4 + tokenizer, built once into the cache folder; nothing is downloaded."""
    from deepinfer_core.testing.tiny_model import build_tiny_checkpoint

    path = cache_root() / f"default-{RANDOM_NAME}-{_VERSION}"
    if not (path / "config.json").is_file() or not (path / "tokenizer.json").is_file():
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        build_tiny_checkpoint(tmp, RANDOM_NAME, seed=RANDOM_SEED)
        if not path.exists():
            tmp.replace(path)
    return path

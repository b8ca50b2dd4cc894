"""The embedded default checkpoint: a small trained DeepSeek-V4.1 with its DSpark drafter, shipped as
package data beside the small trained DeepSeek-V4 it replaced as the default (both share one tokenizer).

``tools/train_tiny_v41.py`` reproduces the V4.1 and ``tools/train_tiny.py`` the V4; when a folder is
missing (a stripped install), a random tiny DeepSeek-V4 is built deterministically on first use into a
cache folder instead.
"""

from __future__ import annotations

import os
from pathlib import Path

#: the default: the trained tiny DeepSeek-V4.1 (every V4.1 feature on, three DSpark stages)
EMBEDDED_MODEL = Path(__file__).parent / "assets" / "deepseek-v41-tiny"
#: the trained tiny DeepSeek-V4 (an MTP layer), for what needs a V4: the MTP drafter, transformers' golden runs
EMBEDDED_V4_MODEL = Path(__file__).parent / "assets" / "deepseek-v4-tiny"
RANDOM_NAME = "tiny"
RANDOM_SEED = 0
_VERSION = "v2"


def cache_root() -> Path:
    root = os.environ.get("DEEPINFER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "deepinfer")
    return Path(root)


def default_model_path() -> Path:
    """The trained tiny V4.1 when shipped, else the random tiny V4."""
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

"""The model registry: config.json ``architectures`` (then ``model_type``) -> the package that serves it.

Packages are imported lazily, on first use, as vLLM's ``model_executor/models/registry.py`` does: the
registry holds module names, and each module exposes ``ARCHITECTURE`` (an :class:`Architecture`).
Out-of-tree architectures (a plugin, a test) call :func:`register_architecture`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from deepinfer_core.model.errors import UnsupportedModelError

# The registry sits below everything it describes (config.py asks it which architecture a config.json
# names), so its annotations name those types in words: ModelConfig, CheckpointManifest, CacheLayout, Model.
ModelConfig = CheckpointManifest = CacheLayout = Model = Any


@dataclass(frozen=True)
class Architecture:
    """What one architecture declares; everything the engine needs of a model family goes through it.

    ``config_class`` parses config.json (``parse(path, raw)``); ``manifest(cfg)`` lists its parameters;
    ``cache_layout(cfg)`` its cache pools and branches; ``load_model(cfg, path, **options)`` builds a
    :class:`~deepinfer_core.models.interface.Model`; ``default_numerics(cfg)`` picks the numerics a
    checkpoint runs in by default; ``build_weights(cfg, params, hook, num_experts)`` makes its typed
    records of canonical-named tensors, after ``prepare_params(cfg, params, param_dtype)`` re-laid them
    (optional)."""

    name: str
    model_types: tuple[str, ...]
    config_class: type[ModelConfig]
    manifest: Callable[[ModelConfig], CheckpointManifest]
    cache_layout: Callable[[ModelConfig], CacheLayout]
    load_model: Callable[..., Model]
    default_numerics: Callable[[ModelConfig], str]
    build_weights: Callable[..., Any]
    prepare_params: Callable[..., None] | None = None
    #: speculative method -> the draft model's class, built by the target from the checkpoint's drafter
    #: weights (V4: ``{"mtp": DeepseekV4MTP}``); spec_decode reaches it as ``model.drafter``
    drafters: Mapping[str, Callable[..., Any]] = field(default_factory=dict)
    numerics: tuple[str, ...] = ("transformers",)
    #: numerics -> the KV-cache entry layout it stores by default (absent: "dense", the model's dtype)
    kv_layouts: Mapping[str, str] = field(default_factory=dict)
    #: bounded replay (:mod:`deepinfer_core.model.replay`): ``replay_layers(cfg)`` -> the layers a prefill runs
    #: on its tail only, or an UnsupportedModelError saying why this model's cannot be cut; None: not offered
    replay_layers: Callable[[ModelConfig], range] | None = None


#: architecture name -> (module exposing ARCHITECTURE, model_types it also answers to)
_REGISTRY: dict[str, tuple[str, tuple[str, ...]]] = {
    "DeepseekV4ForCausalLM": ("deepinfer_core.models.deepseek_v4", ("deepseek_v4",)),
    "DeepseekV41ForCausalLM": ("deepinfer_core.models.deepseek_v41", ("deepseek_v41",)),
}
#: architecture name -> keys that together identify its config in a form that names no architecture
#: (DeepSeek's flat ``inference/config.json``)
_FLAT_KEYS: dict[str, tuple[str, ...]] = {
    "DeepseekV41ForCausalLM": ("kv_source_layers", "index_source_layers", "compress_ratios", "n_layers"),
}
_LOADED: dict[str, Architecture] = {}
#: architecture name -> the module of its chat encoding (``encode_messages``, ``parse_completion`` and
#: ``CompletionStream``, as :mod:`deepinfer_core.chat` has them); absent: DeepSeek-V4's
_CHAT_ENCODINGS: dict[str, str] = {"DeepseekV41ForCausalLM": "deepinfer_core.chat_v41"}
DEFAULT_CHAT_ENCODING = "deepinfer_core.chat"


def register_architecture(name: str, module: str, model_types: tuple[str, ...] = (),
                          chat_encoding: str = DEFAULT_CHAT_ENCODING) -> None:
    """Serve config.json ``architectures: [name]`` (or one of ``model_types``) with ``module``'s
    ``ARCHITECTURE``; imported on first use. Chats are encoded by the module ``chat_encoding``."""
    _REGISTRY[name] = (module, tuple(model_types))
    _CHAT_ENCODINGS[name] = chat_encoding
    _LOADED.pop(name, None)


def get_chat_encoding(name: str) -> Any:
    """The chat-encoding module of the architecture ``name`` (imported on first use)."""
    return importlib.import_module(_CHAT_ENCODINGS.get(name, DEFAULT_CHAT_ENCODING))


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def get_architecture(name: str) -> Architecture:
    """The registered architecture ``name`` (its package imported on first use)."""
    if name not in _REGISTRY:
        raise UnsupportedModelError(f"no architecture {name!r} is registered; deepinfer serves "
                                    f"{supported_architectures()}")
    return _load(name)


def _load(name: str) -> Architecture:
    if name not in _LOADED:
        module, _ = _REGISTRY[name]
        arch = importlib.import_module(module).ARCHITECTURE
        if arch.name != name:
            raise UnsupportedModelError(f"{module}.ARCHITECTURE is {arch.name!r}, registered as {name!r}")
        _LOADED[name] = arch
    return _LOADED[name]


def resolve_architecture(raw: Mapping[str, Any], where: str = "config.json") -> Architecture:
    """The architecture serving a parsed config.json: the first of its ``architectures`` registered,
    else the one registered for its ``model_type``; an :class:`UnsupportedModelError` naming both and
    what is served otherwise."""
    names = raw.get("architectures") or []
    if isinstance(names, str):
        names = [names]
    model_type = raw.get("model_type")
    for name in names:
        if name in _REGISTRY:
            arch = _load(name)
            if model_type is not None and model_type not in arch.model_types:
                raise UnsupportedModelError(
                    f"{where}: architectures {names} is served by {name}, whose model_type is one of "
                    f"{list(arch.model_types)}, but the config says model_type {model_type!r}")
            return arch
    for name, (_, types) in _REGISTRY.items():
        if model_type in types:
            return _load(name)
    if not names and model_type is None:
        for name, keys in _FLAT_KEYS.items():
            if all(k in raw for k in keys):
                return _load(name)
    served = ", ".join(f"{n} (model_type {'/'.join(t)})" for n, (_, t) in sorted(_REGISTRY.items()))
    raise UnsupportedModelError(f"unsupported model_type {model_type!r} (architectures {names}) in {where}; "
                                f"deepinfer serves {served}")

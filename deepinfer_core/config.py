"""Configuration objects: the engine's, and the base of every model config (a model's own config lives
with its package under :mod:`deepinfer_core.models`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from deepinfer_core.model.errors import UnsupportedModelError

__all__ = ["CacheConfig", "EPLBConfig", "ModelConfig", "ParallelConfig", "SchedulerConfig", "StructuredOutputsConfig",
           "UnsupportedModelError", "resolve_dtype", "structured_outputs_config_of"]

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype | None, default: torch.dtype = torch.float32) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return default
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; choose one of {sorted(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]


@dataclass
class ModelConfig:
    """A model's hyper-parameters: its Hugging Face config object (attributes read through) and the
    architecture that serves it. :meth:`from_pretrained` asks the model registry which architecture a
    config.json names and returns that architecture's subclass."""

    hf_config: Any
    path: Path | None = None

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        from deepinfer_core.models.registry import resolve_architecture

        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"model folder {path} has no config.json")
        try:
            raw = json.loads(config_file.read_text())
        except json.JSONDecodeError as exc:
            raise UnsupportedModelError(f"{config_file} is not valid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise UnsupportedModelError(f"{config_file} is not a JSON object")
        arch = resolve_architecture(raw, str(config_file))
        return arch.config_class.parse(path, raw)

    @classmethod
    def parse(cls, path: Path, raw: dict[str, Any]) -> ModelConfig:
        """The config of the folder ``path`` whose config.json is ``raw`` (an architecture overrides this)."""
        raise NotImplementedError(f"{cls.__name__} does not parse config.json")

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelConfig:
        """The config of an in-memory Hugging Face config object, as its architecture parses it."""
        return cls(hf_config).architecture.config_class(hf_config)

    @property
    def architecture(self) -> Any:
        """The :class:`~deepinfer_core.models.registry.Architecture` serving this config (an architecture's
        config class names its own)."""
        from deepinfer_core.models.registry import resolve_architecture

        raw = {"model_type": getattr(self.hf_config, "model_type", None),
               "architectures": getattr(self.hf_config, "architectures", None)}
        return resolve_architecture(raw, "the model config")

    def __getattr__(self, name: str) -> Any:
        if name == "hf_config":
            raise AttributeError(name)
        return getattr(self.hf_config, name)

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.eos_token_id
        if eos is None:
            return []
        return list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]


@dataclass
class CacheConfig:
    """Paged memory: blocks of ``block_size`` source tokens, sized from a byte budget or a device fraction."""

    block_size: int = 128
    num_blocks: int | None = None
    num_window_blocks: int | None = None
    cpu_kv_cache_bytes: int = 2 << 30
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    enable_chunked_prefill: bool = True
    #: bounded replay: the tail tokens a prefill's late layers run on (model/replay.py); 0: the full prefill
    replay_keep: int = 0


@dataclass
class StructuredOutputsConfig:
    """Structured outputs for every request of the engine (vLLM's ``StructuredOutputsConfig``).

    ``disable_any_whitespace``: JSON output (``json`` schemas, ``json_object``, OpenAI's
    ``response_format``) is compact, one line with xgrammar's separators, instead of allowing free
    whitespace between tokens, which a model may fill ``max_tokens`` with. Off by default, as in vLLM; a
    request turns it on for itself with ``StructuredOutputsParams(disable_any_whitespace=True)``.
    ``backend``: only xgrammar is served ("auto" picks it)."""

    backend: str = "auto"
    disable_any_whitespace: bool = False


def structured_outputs_config_of(value: dict | StructuredOutputsConfig | None) -> StructuredOutputsConfig:
    """The engine argument ``structured_outputs_config`` (a dict of its fields, or one) checked."""
    if value is None:
        return StructuredOutputsConfig()
    if isinstance(value, dict):
        known = [f.name for f in fields(StructuredOutputsConfig)]
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(f"unknown structured_outputs_config keys {unknown}; known: {known}")
        value = StructuredOutputsConfig(**value)
    if not isinstance(value, StructuredOutputsConfig):
        raise ValueError(f"structured_outputs_config must be a dict or a StructuredOutputsConfig, "
                         f"got {type(value).__name__}")
    if value.backend not in ("auto", "xgrammar"):
        raise ValueError(f"structured_outputs_config.backend {value.backend!r} is not served; 'auto' or 'xgrammar'")
    if not isinstance(value.disable_any_whitespace, bool):
        raise ValueError("structured_outputs_config.disable_any_whitespace must be a bool, got "
                         f"{value.disable_any_whitespace!r}")
    return value


@dataclass
class EPLBConfig:
    """Expert-parallel load balancing (vLLM's names): ``num_redundant_experts`` extra physical expert slots
    hold replicas; the load of the last ``window_size`` steps is gathered and the experts rearranged every
    ``step_interval`` steps."""

    window_size: int = 1000
    step_interval: int = 3000
    num_redundant_experts: int = 0
    log_balancedness: bool = False


@dataclass
class ParallelConfig:
    data_parallel_size: int = 1
    expert_parallel_size: int = 1
    enable_eplb: bool = False
    eplb_config: EPLBConfig = field(default_factory=EPLBConfig)
    distributed_executor_backend: str | None = None  # "external_launcher": the ranks were started by torchrun

    def num_physical_experts(self, num_logical: int) -> int:
        redundant = self.eplb_config.num_redundant_experts if self.enable_eplb else 0
        return num_logical + redundant

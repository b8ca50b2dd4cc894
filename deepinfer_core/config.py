"""Configuration objects: the model (read from a Hugging Face ``config.json``) and the engine."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SUPPORTED_MODEL_TYPES = ("deepseek_v4",)
DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class UnsupportedModelError(ValueError):
    """The checkpoint is not a DeepSeek-V4 model (or its config is malformed)."""


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
    """DeepSeek-V4 hyper-parameters, read through transformers' ``DeepseekV4Config``."""

    hf_config: Any
    path: Path | None = None

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"model folder {path} has no config.json")
        try:
            raw = json.loads(config_file.read_text())
        except json.JSONDecodeError as exc:
            raise UnsupportedModelError(f"{config_file} is not valid JSON: {exc}") from exc
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"unsupported model_type {model_type!r} in {config_file}; deepinfer serves {SUPPORTED_MODEL_TYPES}"
            )
        from transformers import DeepseekV4Config

        try:
            hf_config = DeepseekV4Config.from_pretrained(str(path))
        except Exception as exc:
            raise UnsupportedModelError(f"invalid DeepSeek-V4 config in {config_file}: {exc}") from exc
        return cls(hf_config, path)

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelConfig:
        if getattr(hf_config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(f"unsupported model_type {getattr(hf_config, 'model_type', None)!r}")
        return cls(hf_config)

    def __getattr__(self, name: str) -> Any:
        if name == "hf_config":
            raise AttributeError(name)
        return getattr(self.hf_config, name)

    @property
    def rope_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def compress_rate(self, layer: int) -> int:
        layer_type = self.layer_types[layer]
        return 0 if layer_type == "sliding_attention" else int(self.compress_rates[layer_type])

    def is_csa(self, layer: int) -> bool:
        return self.layer_types[layer] == "compressed_sparse_attention"

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

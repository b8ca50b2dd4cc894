"""What a DeepSeek-V4 model needs in memory, from its config alone (``deepinfer plan CONFIG``): weight bytes
as stored (DeepSeek's published layout) and as loaded, per rank under N-way expert parallelism (attention,
shared experts and dense weights on every rank), KV bytes per token for each layer type, window and state
bytes per sequence, and the longest context / the most sequences that fit a device beside the weights
(activations and CUDA graph pools not counted)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from deepinfer_core.config import ModelConfig
from deepinfer_core.model.cache import bytes_per_state_slot, layer_bytes_per_block, layer_cache_specs
from deepinfer_core.model.kv_cache_spec import KVCacheSpec
from deepinfer_core.model.loader import (
    expected_file_names,
    expected_shapes,
    fp8_weight_names,
    manifest_of,
    parameter_dtype,
    quant_config,
)
from deepinfer_core.model.manifest import stored_bytes


@dataclass
class LayerKV:
    kind: str  # "sliding", "csa" (rate 4 with indexer), "hca" (rate 128) or "mtp"
    layers: int
    compressed_bytes_per_token: float  # kept for the whole sequence
    window_bytes_per_token: float  # kept for the sliding window only


@dataclass
class Footprint:
    stored_bytes: int
    stored_expert_bytes: int
    loaded_bytes: int  # the engine's parameters: FP8 / FP4 kept where the checkpoint has them
    loaded_expert_bytes: int
    dequantised_bytes: int  # every weight in the model dtype (float32 where the engine keeps float32)
    devices: int
    rank_bytes: int  # one rank's loaded weights under ``devices``-way expert parallelism
    kv: list[LayerKV]
    window_bytes_per_seq: int  # the window pools of one sequence (its last sliding_window tokens)
    state_bytes_per_seq: int  # its compressor state slot
    device_memory: int | None = None
    context: int = 0  # the context ``max_seqs`` is for
    longest_context: int | None = None  # of one sequence on one rank
    max_seqs: int | None = None  # of ``context`` tokens on one rank
    notes: list[str] = field(default_factory=list)

    @property
    def compressed_bytes_per_token(self) -> float:
        return sum(k.compressed_bytes_per_token for k in self.kv)

    def as_dict(self) -> dict:
        return {**asdict(self), "compressed_bytes_per_token": self.compressed_bytes_per_token}


def _kind(cfg: ModelConfig, layer: int) -> str:
    if layer >= cfg.num_hidden_layers:
        return "mtp"
    rate = cfg.compress_rate(layer)
    return "sliding" if not rate else ("csa" if cfg.is_csa(layer) else "hca")


def _loaded_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """:func:`expected_shapes` with each shared expert's w1 and w3 stacked into one ``w13``, as loaded."""
    out = {}
    for name, shape in expected_shapes(cfg, with_mtp=True).items():
        if name.endswith("shared_experts.w3.weight"):
            continue
        if name.endswith("shared_experts.w1.weight"):
            name, shape = name.removesuffix("w1.weight") + "w13", (2 * shape[0], shape[1])
        out[name] = shape
    return out


def weight_bytes(cfg: ModelConfig, dtype: torch.dtype, numerics: str) -> dict[str, int]:
    """Stored, loaded (quantised formats kept) and dequantised bytes, all and routed experts only."""
    out = dict.fromkeys(("stored", "stored_experts", "loaded", "loaded_experts", "dequantised"), 0)
    manifest = manifest_of(cfg)
    for name, shape in expected_file_names(cfg, with_mtp=True).items():
        b = stored_bytes(manifest.stored_format(name), shape)
        out["stored"] += b
        out["stored_experts"] += b if ".ffn.experts." in name else 0
    fp4 = quant_config(cfg).expert_dtype == "fp4"
    fp8 = fp8_weight_names(cfg, numerics) if quant_config(cfg).declared else set()
    for name, shape in _loaded_shapes(cfg).items():
        n, expert = math.prod(shape), ".ffn.experts." in name
        plain = n * parameter_dtype(cfg, name, dtype).itemsize
        if expert and fp4:
            kept = n // 2 + n // 32  # packed e2m1 + one e8m0 scale per 32
        elif name in fp8:  # E4M3 + a float32 scale per 128x128 tile
            kept = n + math.prod(shape[:-2]) * math.ceil(shape[-2] / 128) * math.ceil(shape[-1] / 128) * 4
        else:
            kept = plain
        out["dequantised"] += plain
        out["loaded"] += kept
        out["loaded_experts"] += kept if expert else 0
    return out


def footprint(cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16, numerics: str = "deepseek", devices: int = 1,
              device_memory: int | None = None, block_size: int = 128, context: int | None = None,
              redundant_experts: int = 0) -> Footprint:
    """The footprint of ``cfg`` on ``devices`` ranks (expert parallel over them, attention data parallel:
    every rank holds its own KV) of ``device_memory`` bytes each; ``context`` (default: the config's
    ``max_position_embeddings``) is the sequence length ``max_seqs`` counts; ``redundant_experts``: EPLB's
    replicas per MoE layer, spread over the ranks with the logical experts."""
    if devices < 1:
        raise ValueError(f"devices must be at least 1, got {devices}")
    if redundant_experts < 0:
        raise ValueError(f"redundant experts must be >= 0, got {redundant_experts}")
    w = weight_bytes(cfg, dtype, numerics)
    per_expert = w["loaded_experts"] / cfg.n_routed_experts
    slots = math.ceil((cfg.n_routed_experts + redundant_experts) / devices)
    rank = w["loaded"] - w["loaded_experts"] + slots * per_expert
    spec = KVCacheSpec.default(cfg, block_size, dtype, numerics)
    kinds: dict[str, LayerKV] = {}
    window_blocks = -(-cfg.sliding_window // block_size) + 1
    window_seq = 0
    for i, layer in enumerate(layer_cache_specs(cfg)):
        comp, window = layer_bytes_per_block(layer, spec)
        kv = kinds.setdefault(_kind(cfg, i), LayerKV(_kind(cfg, i), 0, 0.0, 0.0))
        kv.layers += 1
        kv.compressed_bytes_per_token += comp / block_size
        kv.window_bytes_per_token += window / block_size
        window_seq += window * window_blocks
    fp = Footprint(w["stored"], w["stored_experts"], w["loaded"], w["loaded_experts"], w["dequantised"], devices,
                   int(rank), list(kinds.values()), window_seq, bytes_per_state_slot(cfg, dtype, spec),
                   device_memory, context or cfg.max_position_embeddings)
    if device_memory is not None:
        free = device_memory - fp.rank_bytes
        fixed = fp.window_bytes_per_seq + fp.state_bytes_per_seq
        if free <= fixed:
            fp.longest_context, fp.max_seqs = 0, 0
            fp.notes.append(f"the weights of one rank ({fp.rank_bytes / 2**30:.1f} GiB) leave no room for KV")
        else:
            fp.longest_context = int((free - fixed) // fp.compressed_bytes_per_token)
            fp.max_seqs = int(free // (fixed + fp.context * fp.compressed_bytes_per_token))
    return fp

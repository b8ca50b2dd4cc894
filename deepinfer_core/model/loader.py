"""Safetensors loading in DeepSeek's tensor layout, lazily, tensor by tensor.

Accepted names: DeepSeek's own (``layers.N.attn.wq_a.weight``, ``layers.N.ffn.experts.E.w1.weight``,
``hc_head_fn``, ``mtp.0.*``), with or without a leading ``model.``, and the few leaf names transformers
keeps when it saves (``embed_tokens``, ``hc_head.hc_fn``). Routed experts are stacked on load into
``experts.w13`` [E, 2I, D] (gate rows then up rows) and ``experts.w2`` [E, D, I]. FP8 E4M3 weights with
128x128 block scales (``.scale`` or ``.weight_scale_inv``) are dequantised, unless ``keep_fp8``: then
the parameters FP8 mode keeps in E4M3 (:func:`~deepinfer_core.model.fp8.fp8_weight_names`) stay E4M3
with their scales as ``name + "_scale"``, routed experts stacked in E4M3 with stacked scales (an
unquantised expert is quantised as it is stacked). Where 128-row tiles would straddle the gate and up
halves (``moe_intermediate_size`` not a multiple of 128) the experts are stacked dequantised and left
for :func:`~deepinfer_core.model.fp8.quantize_params_fp8` to quantise whole.

The tensors, by canonical name, then become the typed records of :mod:`deepinfer_core.model.weights`
(:func:`build_weights`); :data:`_LAYOUT` is the one place that says which name fills which field.
"""

from __future__ import annotations

import functools
import json
import re
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from deepinfer_core.config import ModelConfig
from deepinfer_core.model.fp8 import (
    FP8_BLOCK,
    FP8_DTYPE,
    fp8_weight_names,
    quantize_fp8_block,
    quantize_params_fp8,
    scale_shape,
)
from deepinfer_core.model.fp8 import dequantize_fp8_block as dequantize_fp8
from deepinfer_core.model.weights import (
    Attention,
    Block,
    Compressor,
    Experts,
    Gate,
    HyperConnection,
    Indexer,
    Linear,
    ModelWeights,
    MoE,
    MTPBlock,
    OutputNorm,
    SharedExpert,
)


class CheckpointError(ValueError):
    """The checkpoint is malformed: a missing file or tensor, or a tensor of the wrong shape."""


_LEAF_RENAMES = [
    (re.compile(r"^embed_tokens\.weight$"), "embed.weight"),
    (re.compile(r"^lm_head\.weight$"), "head.weight"),
    (re.compile(r"(^|\.)hc_head\.hc_(fn|base|scale)$"), r"\1hc_head_\2"),
]
_FP32_PARAM = re.compile(r"(hc_|attn_sink|\.ape$|gate\.bias|norm\.weight$)")
_EXPERT = re.compile(r"^(.*\.ffn\.experts)\.(\d+)\.(w[123])\.weight$")


def canonical_name(name: str) -> str:
    if name.startswith("model."):
        name = name[len("model.") :]
    for pattern, repl in _LEAF_RENAMES:
        name = pattern.sub(repl, name)
    return name


def block_prefixes(cfg: ModelConfig) -> list[tuple[str, int]]:
    """(prefix, attention-layer index) of every decoder block, MTP blocks included."""
    blocks = [(f"layers.{i}.", i) for i in range(cfg.num_hidden_layers)]
    blocks += [(f"mtp.{j}.", -1) for j in range(cfg.num_nextn_predict_layers or 0)]
    return blocks


def expected_shapes(cfg: ModelConfig, with_mtp: bool) -> dict[str, tuple[int, ...]]:
    """Every parameter the engine needs, with its shape (after expert stacking)."""
    d, h, hd, n = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.hc_mult
    qr, g, olr = cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank
    e, inter = cfg.n_routed_experts, cfg.moe_intermediate_size
    mix = (2 + n) * n
    shapes: dict[str, tuple[int, ...]] = {
        "embed.weight": (cfg.vocab_size, d),
        "head.weight": (cfg.vocab_size, d),
        "norm.weight": (d,),
        "hc_head_fn": (n, n * d),
        "hc_head_base": (n,),
        "hc_head_scale": (1,),
    }
    for prefix, layer in block_prefixes(cfg):
        if layer < 0 and not with_mtp:
            continue
        p = prefix
        shapes.update({
            p + "attn_norm.weight": (d,), p + "ffn_norm.weight": (d,),
            p + "hc_attn_fn": (mix, n * d), p + "hc_attn_base": (mix,), p + "hc_attn_scale": (3,),
            p + "hc_ffn_fn": (mix, n * d), p + "hc_ffn_base": (mix,), p + "hc_ffn_scale": (3,),
            p + "attn.wq_a.weight": (qr, d), p + "attn.q_norm.weight": (qr,),
            p + "attn.wq_b.weight": (h * hd, qr), p + "attn.wkv.weight": (hd, d),
            p + "attn.norm.weight": (hd,), p + "attn.attn_sink": (h,),
            p + "attn.wo_a.weight": (g * olr, h * hd // g), p + "attn.wo_b.weight": (d, g * olr),
            p + "ffn.gate.weight": (e, d),
            p + "ffn.experts.w13": (e, 2 * inter, d), p + "ffn.experts.w2": (e, d, inter),
            p + "ffn.shared_experts.w1.weight": (inter, d), p + "ffn.shared_experts.w3.weight": (inter, d),
            p + "ffn.shared_experts.w2.weight": (d, inter),
        })
        rate = cfg.compress_rate(layer) if layer >= 0 else mtp_compress_rate(cfg)
        is_csa = layer >= 0 and cfg.is_csa(layer)
        if rate:
            c = 2 if is_csa else 1
            shapes.update({
                p + "attn.compressor.wkv.weight": (c * hd, d), p + "attn.compressor.wgate.weight": (c * hd, d),
                p + "attn.compressor.ape": (rate, c * hd), p + "attn.compressor.norm.weight": (hd,),
            })
        if is_csa:
            ih, idim = cfg.index_n_heads, cfg.index_head_dim
            shapes.update({
                p + "attn.indexer.wq_b.weight": (ih * idim, qr), p + "attn.indexer.weights_proj.weight": (ih, d),
                p + "attn.indexer.compressor.wkv.weight": (2 * idim, d),
                p + "attn.indexer.compressor.wgate.weight": (2 * idim, d),
                p + "attn.indexer.compressor.ape": (rate, 2 * idim),
                p + "attn.indexer.compressor.norm.weight": (idim,),
            })
        if layer >= 0 and cfg.mlp_layer_types[layer] == "hash_moe":
            shapes[p + "ffn.gate.tid2eid"] = (cfg.vocab_size, cfg.num_experts_per_tok)
        else:
            shapes[p + "ffn.gate.bias"] = (e,)
        if layer < 0:
            shapes.update({
                p + "e_proj.weight": (d, d), p + "h_proj.weight": (d, d), p + "enorm.weight": (d,),
                p + "hnorm.weight": (d,), p + "norm.weight": (d,),
                p + "hc_head_fn": (n, n * d), p + "hc_head_base": (n,), p + "hc_head_scale": (1,),
            })
    return shapes


def mtp_compress_rate(cfg: ModelConfig) -> int:
    """MTP blocks use plain sliding-window attention (no compressor weights are published for them)."""
    return 0


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({path / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"shard {f.name} listed in {index.name} is missing from {path}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if not found:
        raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {path}")
    return found


def _iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for key in handle.keys():
                yield key, handle.get_tensor(key)


def check_scale(name: str, weight: torch.Tensor, scale: torch.Tensor) -> None:
    """One scale per 128x128 tile of ``weight``, or a :class:`CheckpointError` naming both shapes."""
    want = scale_shape(*weight.shape[-2:])
    if tuple(scale.shape) != want:
        raise CheckpointError(
            f"block scale of {name} has shape {tuple(scale.shape)}, expected {want} "
            f"(one per {FP8_BLOCK}x{FP8_BLOCK} tile of its {tuple(weight.shape)} weight)"
        )


def parameter_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype parameter ``name`` is kept in when the model runs in ``dtype`` (hash-routing tables are
    integers; the parameters transformers keeps in float32 stay float32 under bf16/fp16)."""
    if name.endswith("tid2eid"):
        return torch.long
    if dtype in (torch.bfloat16, torch.float16) and _FP32_PARAM.search(name):
        return torch.float32
    return dtype


def load_weights(
    cfg: ModelConfig,
    path: Path,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    keep_fp8: bool = False,
    show_progress: bool = False,
    hook: Any = None,
) -> ModelWeights:
    """The checkpoint in ``path`` as typed records. ``keep_fp8`` (FP8 mode): E4M3 weights stay E4M3 and
    the FP8-eligible weights the checkpoint did not ship in E4M3 are quantised. ``hook`` (a plugin
    manager's hook relay): its ``deepinfer_process_weights`` is called once on the records."""
    params = read_checkpoint(cfg, path, dtype, device, keep_fp8, show_progress)
    if keep_fp8:
        quantize_params_fp8(params, cfg)
    return build_weights(cfg, params, hook)


def read_checkpoint(
    cfg: ModelConfig,
    path: Path,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    keep_fp8: bool = False,
    show_progress: bool = False,
) -> dict[str, torch.Tensor]:
    """Read every tensor once, rename, stack experts, cast; check names and shapes against the config."""
    files = checkpoint_files(path)
    raw_keys = []
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            raw_keys.extend(handle.keys())
    names = {canonical_name(k) for k in raw_keys}
    with_mtp = any(k.startswith("mtp.") for k in names)
    shapes = expected_shapes(cfg, with_mtp)
    params: dict[str, torch.Tensor] = {}
    filled_experts: set[str] = set()
    scales: dict[str, torch.Tensor] = {}
    pending_fp8: dict[str, torch.Tensor] = {}
    kept_fp8 = fp8_weight_names(cfg) if keep_fp8 else set()
    inter = cfg.moe_intermediate_size

    def param_dtype(name: str) -> torch.dtype:
        return parameter_dtype(name, dtype)

    def store_expert(name: str, m: re.Match, tensor: torch.Tensor, scale: torch.Tensor | None) -> None:
        prefix, expert, which = m.group(1), int(m.group(2)), m.group(3)
        if which in ("w1", "w3"):
            key = prefix + ".w13"
            rows = slice(0, inter) if which == "w1" else slice(inter, 2 * inter)
        else:
            key, rows = prefix + ".w2", slice(None)
        if key not in shapes or expert >= shapes[key][0]:
            raise CheckpointError(
                f"unexpected expert tensor {name} (the config has {cfg.n_routed_experts} experts)"
            )
        # stacked in E4M3 only where each expert's tiles are whole tiles of the stack
        fp8_stack = key in kept_fp8 and (which == "w2" or inter % FP8_BLOCK == 0)
        if key not in params:
            params[key] = torch.empty(shapes[key], dtype=FP8_DTYPE if fp8_stack else param_dtype(key), device=device)
            if fp8_stack:
                params[key + "_scale"] = torch.empty((shapes[key][0], *scale_shape(*shapes[key][1:])),
                                                     dtype=torch.float32, device=device)
        target = params[key][expert, rows]
        if tuple(tensor.shape) != tuple(target.shape):
            raise CheckpointError(f"tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
        if scale is not None:
            check_scale(name, tensor, scale)
        if fp8_stack:
            q, s = (tensor, scale) if scale is not None else quantize_fp8_block(tensor)
            tile_rows = slice(rows.start // FP8_BLOCK, rows.stop // FP8_BLOCK) if which != "w2" else slice(None)
            target.copy_(q)
            params[key + "_scale"][expert, tile_rows].copy_(s)
        else:
            target.copy_(tensor if scale is None else dequantize_fp8(tensor, scale))
        filled_experts.add(name)

    def store(name: str, tensor: torch.Tensor, scale: torch.Tensor | None = None) -> None:
        m = _EXPERT.match(name)
        if m:
            store_expert(name, m, tensor, scale)
            return
        if name not in shapes:
            return  # tensors the engine does not use (e.g. rotary buffers) are skipped
        if tuple(tensor.shape) != shapes[name]:
            raise CheckpointError(f"tensor {name} has shape {tuple(tensor.shape)}, expected {shapes[name]}")
        if scale is not None:
            check_scale(name, tensor, scale)
            if name in kept_fp8:
                params[name + "_scale"] = scale.to(device=device, dtype=torch.float32)
                params[name] = tensor.to(device=device)
                return
            tensor = dequantize_fp8(tensor, scale)
        params[name] = tensor.to(device=device, dtype=param_dtype(name))

    progress = tqdm(total=len(raw_keys), desc="loading weights", unit="tensor", disable=not show_progress)
    for key, tensor in _iter_tensors(files):
        progress.update(1)
        name = canonical_name(key)
        if name.endswith(".scale") or name.endswith(".weight_scale_inv"):
            base = name.rsplit(".", 1)[0] + ".weight"
            if base in pending_fp8:
                store(base, pending_fp8.pop(base), tensor)
            else:
                scales[base] = tensor
            continue
        if tensor.dtype == torch.float8_e4m3fn:
            if name in scales:
                store(name, tensor, scales.pop(name))
            else:
                pending_fp8[name] = tensor
            continue
        store(name, tensor)
    progress.close()
    if pending_fp8:
        raise CheckpointError(f"FP8 tensors without a block scale: {sorted(pending_fp8)[:5]}")
    if "head.weight" not in params and cfg.tie_word_embeddings and "embed.weight" in params:
        params["head.weight"] = params["embed.weight"]
    missing = [n for n in shapes if n not in params]
    for key in [k for k in shapes if k.endswith(("experts.w13", "experts.w2"))]:
        prefix, which = key.rsplit(".", 1)
        parts = ("w1", "w3") if which == "w13" else ("w2",)
        missing += [f"{prefix}.{e}.{w}.weight" for e in range(cfg.n_routed_experts) for w in parts
                    if f"{prefix}.{e}.{w}.weight" not in filled_experts and key in params]
    if missing:
        raise CheckpointError(f"checkpoint in {path} lacks {len(missing)} tensor(s), e.g. {missing[:5]}")
    _stack_shared_experts(params, inter, param_dtype)
    return params


def _stack_shared_experts(params: dict[str, torch.Tensor], inter: int, param_dtype) -> None:
    """w1 and w3 -> w13 [2I, D]; E4M3 halves with their scales stay E4M3 when their tiles stack whole,
    otherwise they are dequantised first (FP8 mode quantises the stacked projection afterwards)."""
    for w1_name in [n for n in params if n.endswith("shared_experts.w1.weight")]:
        prefix = w1_name[: -len("w1.weight")]
        halves = [prefix + "w1.weight", prefix + "w3.weight"]
        if halves[1] not in params:
            continue
        scales = [params.pop(h + "_scale", None) for h in halves]
        if all(s is not None for s in scales) and inter % FP8_BLOCK == 0:
            params[prefix + "w13_scale"] = torch.cat(scales, dim=0)
        elif any(s is not None for s in scales):
            for h, s in zip(halves, scales):
                if s is not None:
                    params[h] = dequantize_fp8(params[h], s).to(param_dtype(prefix + "w13"))
        params[prefix + "w13"] = torch.cat([params.pop(h) for h in halves], dim=0)


# --- typed records -------------------------------------------------------------------------------------

#: where each field of a record lives, relative to the record's prefix: a tensor's name (a
#: :class:`Linear` adds ``"_scale"`` for its block scales) or the prefix of a nested record; a list of
#: records numbers them (``layers.0.``, ``layers.1.``, ...)
_LAYOUT: dict[type, dict[str, str]] = {
    ModelWeights: {"embed": "embed.weight", "head": "head.weight", "output": "", "layers": "layers.",
                   "mtp": "mtp."},
    OutputNorm: {"hc": "hc_head_", "norm": "norm.weight"},
    HyperConnection: {"fn": "fn", "base": "base", "scale": "scale"},
    MTPBlock: {"enorm": "enorm.weight", "hnorm": "hnorm.weight", "e_proj": "e_proj.weight",
               "h_proj": "h_proj.weight", "block": "", "output": ""},
    Block: {"attn_hc": "hc_attn_", "attn_norm": "attn_norm.weight", "attn": "attn.", "ffn_hc": "hc_ffn_",
            "ffn_norm": "ffn_norm.weight", "moe": "ffn."},
    Attention: {"wq_a": "wq_a.weight", "q_norm": "q_norm.weight", "wq_b": "wq_b.weight", "wkv": "wkv.weight",
                "kv_norm": "norm.weight", "sinks": "attn_sink", "wo_a": "wo_a.weight", "wo_b": "wo_b.weight",
                "compressor": "compressor.", "indexer": "indexer."},
    Compressor: {"wkv": "wkv.weight", "wgate": "wgate.weight", "ape": "ape", "norm": "norm.weight"},
    Indexer: {"wq_b": "wq_b.weight", "weights_proj": "weights_proj.weight", "compressor": "compressor."},
    MoE: {"gate": "gate.", "experts": "experts.", "shared": "shared_experts."},
    Gate: {"weight": "weight", "bias": "bias", "tid2eid": "tid2eid"},
    Experts: {"w13": "w13", "w2": "w2"},
    SharedExpert: {"w13": "w13", "w2": "w2.weight"},
}


@functools.cache
def _fields(cls: type) -> list[tuple[str, str, Any, bool]]:
    """(field, relative name, type, optional) of each field of record type ``cls``."""
    hints = typing.get_type_hints(cls)
    out = []
    for name, rel in _LAYOUT[cls].items():
        hint, args = hints[name], typing.get_args(hints[name])
        optional = typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args
        if optional:
            hint = next(a for a in args if a is not type(None))
        out.append((name, rel, hint, optional))
    return out


def _build(cls: type, params: dict[str, torch.Tensor], prefix: str) -> Any:
    values = {}
    for name, rel, kind, optional in _fields(cls):
        full = prefix + rel
        if typing.get_origin(kind) is list:
            item = typing.get_args(kind)[0]
            found = {int(m.group(1)) for k in params if (m := re.match(re.escape(full) + r"(\d+)\.", k))}
            values[name] = [_build(item, params, f"{full}{i}.") for i in range(max(found, default=-1) + 1)]
        elif kind is torch.Tensor:
            if full not in params and not optional:
                raise CheckpointError(f"no tensor {full}")
            values[name] = params.get(full)
        elif kind is Linear:
            if full not in params:
                raise CheckpointError(f"no tensor {full}")
            values[name] = Linear(params[full], params.get(full + "_scale"))
        elif optional and not any(k.startswith(full) for k in params):
            values[name] = None
        else:
            values[name] = _build(kind, params, full)
    return cls(**values)


def build_weights(cfg: ModelConfig, params: dict[str, torch.Tensor], hook: Any = None) -> ModelWeights:
    """The records of ``params`` (canonical names, experts stacked, FP8 scales as ``name + "_scale"``),
    handed once to every plugin's ``deepinfer_process_weights`` when ``hook`` is given."""
    weights = _build(ModelWeights, params, "")
    if len(weights.layers) != cfg.num_hidden_layers:
        raise CheckpointError(f"found {len(weights.layers)} decoder layers, the config has {cfg.num_hidden_layers}")
    for i, layer in enumerate([*weights.layers, *(m.block for m in weights.mtp)]):
        if layer.moe.experts.w13.is_fp8 != layer.moe.experts.w2.is_fp8:
            raise CheckpointError(f"block {i}: routed experts' w13 and w2 must both be FP8 or neither")
    if hook is not None:
        hook.deepinfer_process_weights(weights=weights, model_config=cfg)
    return weights


def _named(record: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    for name, rel, *_ in _fields(type(record)):
        value, full = getattr(record, name), prefix + rel
        if value is None:
            continue
        if isinstance(value, list):
            for i, item in enumerate(value):
                yield from _named(item, f"{full}{i}.")
        elif isinstance(value, torch.Tensor):
            yield full, value
        elif isinstance(value, Linear):
            yield full, value.weight
            if value.scale is not None:
                yield full + "_scale", value.scale
        else:
            yield from _named(value, full)


def named_parameters(weights: ModelWeights) -> Iterator[tuple[str, torch.Tensor]]:
    """(canonical checkpoint name, tensor) of every weight in ``weights``, FP8 scales as ``name + "_scale"``."""
    return _named(weights, "")

"""Safetensors loading: every tensor checked against the config first, then read file by file straight
onto the target device.

Accepted layouts (one canonical name each, :func:`canonical_name`): DeepSeek's published one (flat names
as its ``inference/model.py`` declares them: ``layers.N.attn.kv_norm.weight``,
``layers.N.ffn.experts.E.w1.weight``, ``hc_head_fn``, ``mtp.0.*``), with or without a leading ``model.``;
what transformers' ``save_pretrained`` writes (``embed_tokens``, ``hc_head.hc_fn``, ``attn.norm`` for the
kv norm); and transformers' in-memory names (``model.layers.N.self_attn.q_a_proj.weight``, the merged
``mlp.experts.gate_up_proj`` [E, 2I, D] and ``down_proj``).

Formats in a file: float tensors; FP8 E4M3 weights with one scale per 128x128 tile (``.scale`` or
``.weight_scale_inv``; ``float8_e8m0fnu``, float32 or bf16); routed experts in packed FP4 e2m1 (int8 or
``float4_e2m1fn_x2`` [out, in/2], ``float8_e8m0fnu`` scales [out, in/32]) where ``config.json`` declares
``expert_dtype: "fp4"``. ``quantization_config`` is honoured: its block size and formats must be the
ones read here, and with ``scale_fmt: "ue8m0"`` every scale must be a power of two. An unknown, missing,
mis-shaped or mis-typed tensor is a :class:`CheckpointError` naming it and its file, raised before any
tensor is read; so is an unreadable (truncated, corrupted) file.

Routed experts are stacked on load into ``experts.w13`` [E, 2I, D] (gate rows then up rows) and
``experts.w2`` [E, D, I], only those of ``experts`` (a range) where given. Quantised tensors are
dequantised on the device, unless ``keep_fp8``: then the parameters FP8 mode keeps in E4M3
(:func:`~deepinfer_core.quant.fp8.fp8_weight_names`) stay E4M3 with their scales as ``name + "_scale"``,
FP4 experts stay packed (uint8 [E, 2I, D/2] with e8m0 scales [E, 2I, D/32]), FP8 experts are stacked in
E4M3 with stacked scales (an unquantised expert is quantised as it is stacked). Where 128-row tiles would
straddle the gate and up halves (``moe_intermediate_size`` not a multiple of 128) the experts are stacked
dequantised and left for :func:`~deepinfer_core.quant.fp8.quantize_params_fp8` to quantise whole.

Host memory: safetensors maps each file and one tensor at a time is copied to the device, so the peak
host copy is one tensor (its file's pages are the kernel's page cache, not the process's own memory).

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from deepinfer_core.config import ModelConfig
from deepinfer_core.quant.fp4 import E8M0_DTYPE, FP4_BLOCK, dequantize_fp4_block, e8m0_from_float, is_power_of_two
from deepinfer_core.quant.fp8 import (
    FP8_BLOCK,
    FP8_DTYPE,
    fp8_weight_names,
    quantize_fp8_block,
    quantize_params_fp8,
    scale_shape,
)
from deepinfer_core.quant.fp8 import dequantize_fp8_block as dequantize_fp8
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
    """The checkpoint is malformed: an unreadable file, a missing, unexpected, mis-shaped or mis-typed
    tensor, or a quantisation its config.json does not declare. The message names the tensor and file."""


# --- names ---------------------------------------------------------------------------------------------

#: transformers' in-memory names (``model.layers.N.self_attn.q_a_proj.weight``, the merged
#: ``mlp.experts.gate_up_proj``) -> DeepSeek's, applied in order; DeepSeek's own names pass unchanged
_TRANSFORMERS_RENAMES = [(re.compile(p), r) for p, r in [
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
    (r"\.attn\.sinks$", ".attn.attn_sink"),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.experts\.gate_up_proj$", ".experts.w13"),
    (r"\.experts\.down_proj$", ".experts.w2"),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.compressor\.position_bias$", ".compressor.ape"),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.q_b_proj\.", ".wq_b."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.kv_proj\.", ".wkv."),
    (r"\.compressor\.gate_proj\.", ".compressor.wgate."),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
]]
_LEAF_RENAMES = [
    (re.compile(r"^embed_tokens\.weight$"), "embed.weight"),
    (re.compile(r"^lm_head\.weight$"), "head.weight"),
    (re.compile(r"(^|\.)hc_head\.hc_(fn|base|scale)$"), r"\1hc_head_\2"),
    # what transformers' save_pretrained writes for the attention's kv_norm
    (re.compile(r"^((?:layers|mtp)\.\d+\.attn\.)norm\.weight$"), r"\1kv_norm.weight"),
    (re.compile(r"\.weight_scale_inv$"), ".scale"),
]
#: file entries that are not weights of the engine's model and are dropped: rotary buffers some exports
#: write, and the MTP layer's own copies of the embedding and head (it shares the main model's)
_IGNORED = re.compile(r"(\.rotary_emb\.inv_freq$|^mtp\.\d+\.(embed|embed_tokens|emb)\.weight$"
                      r"|^mtp\.\d+\.(head|lm_head)\.weight$)")
_FP32_PARAM = re.compile(r"(hc_|attn_sink|\.ape$|gate\.bias|norm\.weight$)")
_EXPERT = re.compile(r"^(.*\.ffn\.experts)\.(\d+)\.(w[123])\.weight$")
_MERGED_EXPERTS = re.compile(r"^(.*\.ffn\.experts)\.(w13|w2)$")


def canonical_name(name: str) -> str:
    """The engine's name of a checkpoint tensor: DeepSeek's published one (``layers.3.attn.kv_norm.weight``,
    block scales as ``.scale``), from DeepSeek's names with or without ``model.``, from what transformers'
    ``save_pretrained`` writes, or from transformers' in-memory module names."""
    name = name.removeprefix("model.")
    for pattern, repl in _TRANSFORMERS_RENAMES:
        name = pattern.sub(repl, name)
    for pattern, repl in _LEAF_RENAMES:
        name = pattern.sub(repl, name)
    return name


# --- what the config expects ---------------------------------------------------------------------------


def block_prefixes(cfg: ModelConfig) -> list[tuple[str, int]]:
    """(prefix, attention-layer index) of every decoder block, MTP blocks included."""
    blocks = [(f"layers.{i}.", i) for i in range(cfg.num_hidden_layers)]
    blocks += [(f"mtp.{j}.", -1) for j in range(cfg.num_nextn_predict_layers or 0)]
    return blocks


def expected_shapes(cfg: ModelConfig, with_mtp: bool, num_experts: int | None = None) -> dict[str, tuple[int, ...]]:
    """Every parameter the engine needs, with its shape (routed experts stacked: ``num_experts`` of them,
    all by default)."""
    d, h, hd, n = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.hc_mult
    qr, g, olr = cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank
    e, inter = cfg.n_routed_experts if num_experts is None else num_experts, cfg.moe_intermediate_size
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
            p + "attn.kv_norm.weight": (hd,), p + "attn.attn_sink": (h,),
            p + "attn.wo_a.weight": (g * olr, h * hd // g), p + "attn.wo_b.weight": (d, g * olr),
            p + "ffn.gate.weight": (cfg.n_routed_experts, d),
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
            shapes[p + "ffn.gate.bias"] = (cfg.n_routed_experts,)
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


def expected_file_names(cfg: ModelConfig, with_mtp: bool = True) -> dict[str, tuple[int, ...]]:
    """The tensors a checkpoint in DeepSeek's layout holds for ``cfg`` (routed experts one by one as
    ``...experts.E.w{1,2,3}.weight``), with their logical (unpacked) shapes; block scales not included."""
    inter, d = cfg.moe_intermediate_size, cfg.hidden_size
    out = {}
    for name, shape in expected_shapes(cfg, with_mtp).items():
        m = _MERGED_EXPERTS.match(name)
        if not m:
            out[name] = shape
            continue
        parts = {"w1": (inter, d), "w3": (inter, d)} if m.group(2) == "w13" else {"w2": (d, inter)}
        for e in range(cfg.n_routed_experts):
            out.update({f"{m.group(1)}.{e}.{w}.weight": s for w, s in parts.items()})
    return out


@dataclass(frozen=True)
class QuantConfig:
    """What ``config.json`` says about quantised tensors: FP8 block size and scale format, and the
    format of the routed experts (``"fp4"``: packed e2m1 with one ue8m0 scale per 32 inputs)."""

    block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)
    scale_fmt: str | None = None
    expert_dtype: str | None = None
    declared: bool = False


def quant_config(cfg: ModelConfig) -> QuantConfig:
    """``quantization_config`` and ``expert_dtype`` of ``cfg``, checked against what the engine reads."""
    where = f"{cfg.path / 'config.json' if cfg.path else 'config.json'}"
    qc = getattr(cfg, "quantization_config", None)
    expert_dtype = getattr(cfg, "expert_dtype", None)
    if qc is None:
        return QuantConfig(expert_dtype=expert_dtype)
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
    method, fmt = qc.get("quant_method"), qc.get("fmt", "e4m3")
    if method != "fp8" or fmt != "e4m3":
        raise CheckpointError(f"{where}: quantization_config quant_method {method!r} fmt {fmt!r} is not "
                              "supported (DeepSeek's block FP8: quant_method 'fp8', fmt 'e4m3')")
    block = tuple(qc.get("weight_block_size") or (FP8_BLOCK, FP8_BLOCK))
    if block != (FP8_BLOCK, FP8_BLOCK):
        raise CheckpointError(f"{where}: weight_block_size {list(block)} is not supported (only "
                              f"[{FP8_BLOCK}, {FP8_BLOCK}])")
    scale_fmt = qc.get("scale_fmt")
    if scale_fmt not in (None, "ue8m0"):
        raise CheckpointError(f"{where}: scale_fmt {scale_fmt!r} is not supported (None or 'ue8m0')")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise CheckpointError(f"{where}: activation_scheme {qc.get('activation_scheme')!r} is not supported "
                              "(only 'dynamic')")
    expert_dtype = qc.get("expert_dtype", expert_dtype)
    if expert_dtype not in (None, "fp4", "fp8", "bf16"):
        raise CheckpointError(f"{where}: expert_dtype {expert_dtype!r} is not supported (fp4, fp8 or bf16)")
    return QuantConfig(block, scale_fmt, expert_dtype, True)


# --- files ---------------------------------------------------------------------------------------------


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _index_weight_map(index)
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


def _index_weight_map(index: Path) -> dict[str, str]:
    try:
        return json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index} is not a safetensors index (JSON with a weight_map): {exc}") from exc


#: safetensors' dtype codes -> torch
_FILE_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
    "F4": torch.float4_e2m1fn_x2, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
    "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
_FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
_FP4_FILE_DTYPES = (torch.int8, torch.uint8, torch.float4_e2m1fn_x2)
_SCALE_DTYPES = (torch.float8_e8m0fnu, torch.float32, torch.bfloat16, torch.float16)


@dataclass
class _Entry:
    """One tensor of the checkpoint, as its file header describes it."""

    key: str  # its name in the file
    file: Path
    dtype: torch.dtype | str
    shape: tuple[int, ...]

    def where(self) -> str:
        return f"{self.key!r} in {self.file.name}"


def _open(f: Path, device: str = "cpu"):
    try:
        return safe_open(str(f), framework="pt", device=device)
    except Exception as exc:  # safetensors' own error type is not importable by a stable name
        raise CheckpointError(f"cannot read {f}: {exc} (truncated or not a safetensors file?)") from exc


def read_headers(path: Path) -> dict[str, _Entry]:
    """Canonical name -> file entry of every tensor in the checkpoint in ``path``; two entries of one
    canonical name, or an index that puts a tensor in a file that lacks it, are errors."""
    files = checkpoint_files(path)
    entries: dict[str, _Entry] = {}
    for f in files:
        with _open(f) as handle:
            for key in handle.keys():
                sl = handle.get_slice(key)
                code = sl.get_dtype()
                entry = _Entry(key, f, _FILE_DTYPES.get(code, code), tuple(sl.get_shape()))
                name = canonical_name(key)
                if name in entries:
                    raise CheckpointError(f"{entry.where()} and {entries[name].where()} are both the tensor {name}")
                entries[name] = entry
    index = path / "model.safetensors.index.json"
    if index.is_file():
        by_key = {e.key: e for e in entries.values()}
        for key, file in _index_weight_map(index).items():
            if key not in by_key or by_key[key].file.name != Path(file).name:
                found = f"it is in {by_key[key].file.name}" if key in by_key else "no shard holds it"
                raise CheckpointError(f"{index.name} puts tensor {key!r} in {file}, but {found}")
    return entries


# --- the plan: every file tensor checked and assigned before anything is read --------------------------


def check_scale(name: str, weight: torch.Tensor | tuple[int, ...], scale: torch.Tensor | tuple[int, ...],
                block: int = FP8_BLOCK) -> None:
    """One scale per 128x128 tile of ``weight``, or a :class:`CheckpointError` naming both shapes."""
    wshape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else tuple(weight)
    sshape = tuple(scale.shape) if isinstance(scale, torch.Tensor) else tuple(scale)
    want = scale_shape(*wshape[-2:], block)
    if sshape != want:
        raise CheckpointError(
            f"block scale of {name} has shape {sshape}, expected {want} "
            f"(one per {block}x{block} tile of its {wshape} weight)"
        )


@dataclass
class _Item:
    """How one weight of the file becomes (part of) a parameter."""

    name: str  # canonical name of the weight in the file
    entry: _Entry
    fmt: str  # "float", "int", "fp8" (E4M3 + 128x128 scales) or "fp4" (packed e2m1 + scales per 32)
    scale: _Entry | None = None
    target: str | None = None  # the parameter it fills (a stack for routed experts)
    expert: int | None = None  # position in the stack
    rows: slice | None = None  # rows of the stacked expert it fills (None: all)


def _fmt_of(name: str, entry: _Entry, scale: _Entry | None, expert: bool, quant: QuantConfig) -> str:
    where = entry.where()
    dtype = entry.dtype
    if dtype == torch.float8_e4m3fn:
        fmt = "fp8"
    elif expert and dtype in _FP4_FILE_DTYPES:
        if quant.expert_dtype != "fp4":
            raise CheckpointError(f"tensor {name} ({where}) is {dtype}, i.e. packed FP4, but config.json does "
                                  f"not declare expert_dtype 'fp4' (it has {quant.expert_dtype!r})")
        fmt = "fp4"
    elif dtype in _FLOAT_DTYPES:
        fmt = "float"
    elif name.endswith("tid2eid") and dtype in (torch.int32, torch.int64):
        fmt = "int"
    else:
        raise CheckpointError(f"tensor {name} ({where}) has dtype {dtype}, which the engine does not read there")
    if name.endswith("tid2eid") and fmt != "int":
        raise CheckpointError(f"tensor {name} ({where}) has dtype {dtype}; a hash-routing table is int32 or int64")
    if fmt in ("fp8", "fp4"):
        if scale is None:
            raise CheckpointError(f"{fmt.upper()} tensor {name} ({where}) has no block scale "
                                  f"({name.removesuffix('.weight')}.scale)")
        if scale.dtype not in _SCALE_DTYPES:
            raise CheckpointError(f"block scale of {name} ({scale.where()}) has dtype {scale.dtype}; expected "
                                  f"one of {[str(d) for d in _SCALE_DTYPES]}")
    elif scale is not None:
        raise CheckpointError(f"tensor {name} ({where}) is {dtype}, not quantised, but has a block scale "
                              f"({scale.where()})")
    if quant.expert_dtype == "fp4" and expert and fmt != "fp4":
        raise CheckpointError(f"config.json declares expert_dtype 'fp4' but routed expert {name} ({where}) "
                              f"is {dtype}")
    return fmt


def _check_shape(name: str, entry: _Entry, fmt: str, want: tuple[int, ...], scale: _Entry | None,
                 quant: QuantConfig) -> None:
    got = entry.shape
    if fmt == "fp4":
        stored = (*want[:-1], want[-1] // 2)
        if want[-1] % FP4_BLOCK or got != stored:
            raise CheckpointError(f"tensor {name} ({entry.where()}) has shape {got}, expected {stored} "
                                  f"(packed FP4: two values a byte of its {want} weight)")
        want_scale = (*want[:-1], want[-1] // FP4_BLOCK)
        if scale is not None and scale.shape != want_scale:
            raise CheckpointError(f"block scale of {name} ({scale.where()}) has shape {scale.shape}, expected "
                                  f"{want_scale} (one per {FP4_BLOCK} inputs of its {want} weight)")
        return
    if got != want:
        raise CheckpointError(f"tensor {name} ({entry.where()}) has shape {got}, expected {want}")
    if fmt == "fp8" and scale is not None:
        try:
            check_scale(name, got, scale.shape, quant.block[0])
        except CheckpointError as exc:
            raise CheckpointError(f"{exc} ({scale.where()})") from None


def _plan(cfg: ModelConfig, entries: dict[str, _Entry], shapes: dict[str, tuple[int, ...]],
          experts: range, quant: QuantConfig) -> tuple[list[_Item], dict[str, set[str]]]:
    """(items, stack name -> the formats of its experts in the file); raises on any tensor
    that is unknown, mis-shaped or mis-typed, and on any that is missing."""
    inter = cfg.moe_intermediate_size
    scales = {n.removesuffix(".scale") + ".weight": e for n, e in entries.items() if n.endswith(".scale")}
    items: list[_Item] = []
    unknown: list[str] = []
    stack_fmt: dict[str, set[str]] = {}
    filled: set[str] = set()
    for name, entry in entries.items():
        if name.endswith(".scale"):
            weight = name.removesuffix(".scale") + ".weight"
            expected = weight in shapes or (_EXPERT.match(weight) and not _IGNORED.search(weight))
            if weight not in entries and not expected:  # (an expected weight is reported missing below)
                unknown.append(f"{name} ({entry.where()}: a block scale without its weight)")
            continue
        if _IGNORED.search(name):
            continue
        scale = scales.get(name)
        m, merged = _EXPERT.match(name), _MERGED_EXPERTS.match(name)
        if m:
            prefix, e, which = m.group(1), int(m.group(2)), m.group(3)
            key = prefix + (".w13" if which in ("w1", "w3") else ".w2")
            if key not in shapes or e >= cfg.n_routed_experts:
                unknown.append(f"{name} ({entry.where()}; the config has {cfg.n_routed_experts} experts)")
                continue
            fmt = _fmt_of(name, entry, scale, True, quant)
            want = shapes[key][1:] if which == "w2" else (inter, shapes[key][2])
            _check_shape(name, entry, fmt, want, scale, quant)
            if e not in experts:
                continue
            stack_fmt.setdefault(key, set()).add(fmt)
            if which == "w2":
                rows = slice(0, shapes[key][1])
            else:
                rows = slice(0, inter) if which == "w1" else slice(inter, 2 * inter)
            items.append(_Item(name, entry, fmt, scale, key, e - experts.start, rows))
            filled.add(f"{key}:{e}:{which}")
        elif merged and name in shapes:
            fmt = _fmt_of(name, entry, scale, True, quant)
            if fmt != "float":
                raise CheckpointError(f"merged experts {name} ({entry.where()}) are {entry.dtype}: quantised "
                                      "merged experts are not read; use DeepSeek's per-expert layout")
            _check_shape(name, entry, fmt, (cfg.n_routed_experts, *shapes[name][1:]), None, quant)
            stack_fmt[name] = {fmt}
            items.append(_Item(name, entry, fmt, None, name))
            parts = ("w1", "w3") if name.endswith("w13") else ("w2",)
            filled.update(f"{name}:{e}:{w}" for e in experts for w in parts)
        elif name in shapes:
            fmt = _fmt_of(name, entry, scale, False, quant)
            _check_shape(name, entry, fmt, shapes[name], scale, quant)
            items.append(_Item(name, entry, fmt, scale, name))
            filled.add(name)
        else:
            unknown.append(f"{name} ({entry.where()})")
    if unknown:
        raise CheckpointError(f"{len(unknown)} tensor(s) the config does not have: {', '.join(unknown[:8])}"
                              + (" ..." if len(unknown) > 8 else ""))
    missing = [n for n in shapes if not _MERGED_EXPERTS.match(n) and n not in filled]
    missing = [n for n in missing if not (n == "head.weight" and cfg.tie_word_embeddings and "embed.weight" in filled)]
    for key in [k for k in shapes if _MERGED_EXPERTS.match(k)]:
        prefix, which = key.rsplit(".", 1)
        parts = ("w1", "w3") if which == "w13" else ("w2",)
        missing += [f"{prefix}.{e}.{w}.weight" for e in experts for w in parts if f"{key}:{e}:{w}" not in filled]
    if missing:
        raise CheckpointError(f"checkpoint lacks {len(missing)} tensor(s), e.g. {missing[:5]}")
    return items, stack_fmt


# --- reading -------------------------------------------------------------------------------------------


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
    experts: range | None = None,
    keep_fp4: bool | None = None,
    numerics: str = "transformers",
) -> ModelWeights:
    """The checkpoint in ``path`` as typed records. ``keep_fp8`` (FP8 mode): E4M3 weights stay E4M3,
    packed FP4 routed experts stay packed FP4, and the FP8-eligible weights the checkpoint did not ship
    quantised are quantised. ``keep_fp4`` (default: ``keep_fp8``): packed FP4 experts stay packed
    whatever ``keep_fp8`` says. ``experts``: the routed experts to load (a contiguous range of ids, all by
    default); the stacks then hold only those, in order. ``hook`` (a plugin manager's hook relay): its
    ``deepinfer_process_weights`` is called once on the records. ``numerics``: which weights FP8 mode
    keeps in E4M3 (:func:`~deepinfer_core.quant.fp8.fp8_weight_names`)."""
    params = read_checkpoint(cfg, path, dtype, device, keep_fp8, show_progress, experts, keep_fp4, numerics)
    if keep_fp8:
        quantize_params_fp8(params, cfg, numerics)
    return build_weights(cfg, params, hook, num_experts=None if experts is None else len(experts))


def _scale_values(name: str, scale: torch.Tensor, entry: _Entry, quant: QuantConfig, fmt: str) -> torch.Tensor:
    """A block scale as float32 (e8m0 is exact), checked: finite and positive, and a power of two where
    the config says ue8m0 (and always for FP4)."""
    s = scale.float()
    if not bool(torch.isfinite(s).all() and (s > 0).all()):
        raise CheckpointError(f"block scale of {name} ({entry.where()}) holds non-finite or non-positive values")
    if (quant.scale_fmt == "ue8m0" or fmt == "fp4") and scale.dtype != torch.float8_e8m0fnu and not is_power_of_two(s):
        raise CheckpointError(f"block scale of {name} ({entry.where()}) is not a power of two, but "
                              + ("FP4 scales are ue8m0" if fmt == "fp4" else "config.json says scale_fmt 'ue8m0'"))
    return s


def read_checkpoint(
    cfg: ModelConfig,
    path: Path,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    keep_fp8: bool = False,
    show_progress: bool = False,
    experts: range | None = None,
    keep_fp4: bool | None = None,
    numerics: str = "transformers",
) -> dict[str, torch.Tensor]:
    """Check every tensor's name, shape and dtype against the config (before reading any), then read them
    file by file straight onto ``device``, dequantising there (or keeping them quantised with
    ``keep_fp8``), stacking the routed experts; block scales come back as ``name + "_scale"``."""
    path = Path(path)
    entries = read_headers(path)
    quant = quant_config(cfg)
    experts = range(cfg.n_routed_experts) if experts is None else experts
    if experts.step != 1 or experts.start < 0 or experts.stop > cfg.n_routed_experts or not len(experts):
        raise ValueError(f"experts must be a non-empty contiguous range within 0..{cfg.n_routed_experts}, "
                         f"got {experts}")
    with_mtp = any(n.startswith("mtp.") and not _IGNORED.search(n) for n in entries)
    shapes = expected_shapes(cfg, with_mtp, len(experts))
    items, stack_fmt = _plan(cfg, entries, shapes, experts, quant)

    device = torch.device(device)
    dev = str(device) if device.type != "cuda" or device.index is not None else "cuda:0"
    kept_fp8 = fp8_weight_names(cfg, numerics) if keep_fp8 else set()
    inter = cfg.moe_intermediate_size
    acc = torch.float32  # dequantised in float32 (as a float32 checkpoint of the same values), then cast
    params: dict[str, torch.Tensor] = {}

    def param_dtype(name: str) -> torch.dtype:
        return parameter_dtype(name, dtype)

    def stack_layout(key: str) -> str:
        """How stack ``key`` is kept: "fp4" (packed), "fp8" (E4M3 + tile scales) or "float"."""
        fmts = stack_fmt[key]
        if "fp4" in fmts and (keep_fp8 if keep_fp4 is None else keep_fp4):
            return "fp4"  # then all are: packed FP4 needs expert_dtype "fp4", which admits nothing else
        if not keep_fp8:
            return "float"
        whole_tiles = key.endswith(".w2") or inter % FP8_BLOCK == 0
        return "fp8" if key in kept_fp8 and whole_tiles else "float"

    def stack(key: str, layout: str) -> torch.Tensor:
        if key not in params:
            shape = shapes[key]
            if layout == "fp4":
                params[key] = torch.empty((*shape[:-1], shape[-1] // 2), dtype=torch.uint8, device=device)
                params[key + "_scale"] = torch.empty((*shape[:-1], shape[-1] // FP4_BLOCK), dtype=E8M0_DTYPE,
                                                     device=device)
            elif layout == "fp8":
                params[key] = torch.empty(shape, dtype=FP8_DTYPE, device=device)
                params[key + "_scale"] = torch.empty((shape[0], *scale_shape(*shape[1:])), dtype=torch.float32,
                                                     device=device)
            else:
                params[key] = torch.empty(shape, dtype=param_dtype(key), device=device)
        return params[key]

    def dequantized(item: _Item, tensor: torch.Tensor, scale: torch.Tensor | None, out: torch.dtype) -> torch.Tensor:
        if item.fmt == "fp8":
            return dequantize_fp8(tensor, scale, dtype=acc).to(out)
        if item.fmt == "fp4":
            return dequantize_fp4_block(tensor, scale, dtype=out)
        return tensor.to(out)

    handles: dict[Path, Any] = {}

    def get(entry: _Entry) -> torch.Tensor:
        if entry.file not in handles:
            handles[entry.file] = _open(entry.file, dev).__enter__()
        try:
            tensor = handles[entry.file].get_tensor(entry.key)
        except Exception as exc:
            raise CheckpointError(f"cannot read tensor {entry.where()}: {exc}") from exc
        # on the CPU a tensor may be a view of the file's mapping, which would keep every page of the
        # file read so far resident for as long as it lives
        return tensor.clone() if device.type == "cpu" else tensor

    def close_files() -> None:
        for handle in handles.values():
            handle.__exit__(None, None, None)
        handles.clear()

    ordered = sorted(items, key=lambda i: (str(i.entry.file), i.entry.key))
    progress = tqdm(total=len(items), desc="loading weights", unit="tensor", disable=not show_progress)
    try:
        for n, item in enumerate(ordered):
            if n and item.entry.file != ordered[n - 1].entry.file:  # one file mapped at a time
                close_files()
            progress.update(1)
            tensor = get(item.entry).to(device)
            scale = None
            if item.scale is not None:
                scale = _scale_values(item.name, get(item.scale).to(device), item.scale, quant, item.fmt)
                if item.fmt == "fp4":
                    scale = e8m0_from_float(scale)
            if item.fmt == "fp4" and tensor.dtype != torch.uint8:
                tensor = tensor.view(torch.uint8)
            key = item.target
            if item.expert is None and key in stack_fmt:  # transformers' merged experts: all of them at once
                params[key] = tensor[experts.start : experts.stop].to(param_dtype(key)).contiguous()
            elif item.expert is not None:
                layout = stack_layout(key)
                target = stack(key, layout)[item.expert, item.rows]
                if layout == "fp4":
                    target.copy_(tensor)
                    params[key + "_scale"][item.expert, item.rows].copy_(scale)
                elif layout == "fp8":
                    if item.fmt == "fp8":
                        q, s = tensor, scale
                    else:
                        q, s = quantize_fp8_block(dequantized(item, tensor, scale, acc))
                    tiles = slice(None) if key.endswith(".w2") else slice(item.rows.start // FP8_BLOCK,
                                                                         item.rows.stop // FP8_BLOCK)
                    target.copy_(q)
                    params[key + "_scale"][item.expert, tiles].copy_(s)
                else:
                    target.copy_(dequantized(item, tensor, scale, target.dtype))
            elif item.fmt == "fp8" and key in kept_fp8:
                params[key], params[key + "_scale"] = tensor, scale
            else:
                params[key] = dequantized(item, tensor, scale, param_dtype(key))
    finally:
        progress.close()
        close_files()
    if "head.weight" not in params and cfg.tie_word_embeddings and "embed.weight" in params:
        params["head.weight"] = params["embed.weight"]
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
                "kv_norm": "kv_norm.weight", "sinks": "attn_sink", "wo_a": "wo_a.weight", "wo_b": "wo_b.weight",
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


def build_weights(cfg: ModelConfig, params: dict[str, torch.Tensor], hook: Any = None,
                  num_experts: int | None = None) -> ModelWeights:
    """The records of ``params`` (canonical names, experts stacked, FP8/FP4 scales as ``name + "_scale"``),
    handed once to every plugin's ``deepinfer_process_weights`` when ``hook`` is given. ``num_experts``:
    how many routed experts each stack holds (all by default; fewer where only a range was loaded)."""
    params = {canonical_name(k): v for k, v in params.items()}
    weights = _build(ModelWeights, params, "")
    if len(weights.layers) != cfg.num_hidden_layers:
        raise CheckpointError(f"found {len(weights.layers)} decoder layers, the config has {cfg.num_hidden_layers}")
    want = cfg.n_routed_experts if num_experts is None else num_experts
    for i, layer in enumerate([*weights.layers, *(m.block for m in weights.mtp)]):
        ex = layer.moe.experts
        if ex.w13.format != ex.w2.format:
            raise CheckpointError(f"block {i}: routed experts' w13 is {ex.w13.format} and w2 {ex.w2.format}; "
                                  "both must have one format")
        if ex.w13.weight.shape[0] != want or ex.w2.weight.shape[0] != want:
            raise CheckpointError(f"block {i}: the expert stacks hold {ex.w13.weight.shape[0]} experts, "
                                  f"expected {want}")
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

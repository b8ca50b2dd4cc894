"""Safetensors loading driven by an architecture's checkpoint manifest
(:mod:`deepinfer_core.model.manifest`): every tensor checked against the manifest first, then read file
by file straight onto the target device. Nothing here knows a parameter name; file names are mapped to
canonical ones by the manifest's renames (for DeepSeek-V4: its published names, what transformers'
``save_pretrained`` writes, and transformers' in-memory names with merged experts [E, 2I, D]).

Formats in a file: float tensors; FP8 E4M3 weights with one scale per 128x128 tile (``.scale`` or
``.weight_scale_inv``; ``float8_e8m0fnu``, float32 or bf16); routed experts in packed FP4 e2m1 (int8 or
``float4_e2m1fn_x2`` [out, in/2], ``float8_e8m0fnu`` scales [out, in/32]) where ``config.json`` declares
``expert_dtype: "fp4"``. ``quantization_config`` is honoured: its block size and formats must be the
ones read here, and with ``scale_fmt: "ue8m0"`` every scale must be a power of two. An unknown, missing,
mis-shaped or mis-typed tensor is a :class:`CheckpointError` naming it and its file, raised before any
tensor is read; so is an unreadable (truncated, corrupted) file, and a weight holding NaN or an infinity
(float and FP8 weights are checked on the device as they are read, one reduction each, the results
brought to the host once per file).

Routed experts are stacked on load into ``experts.w13`` [E, 2I, D] (gate rows then up rows) and
``experts.w2`` [E, D, I], only those of ``experts`` (a range) where given. Quantised tensors are
dequantised on the device, unless ``keep_fp8``: then the parameters FP8 mode keeps in E4M3
(the manifest's ``fp8_names``) stay E4M3 with their scales as ``name + "_scale"``,
FP4 experts stay packed (uint8 [E, 2I, D/2] with e8m0 scales [E, 2I, D/32]), FP8 experts are stacked in
E4M3 with stacked scales (an unquantised expert is quantised as it is stacked). Where 128-row tiles would
straddle the gate and up halves (``moe_intermediate_size`` not a multiple of 128) the experts are stacked
dequantised and left for :func:`~deepinfer_core.quant.fp8.quantize_params_fp8` to quantise whole.
An architecture may re-lay the parameters once read (``Architecture.prepare_params``: V4 stacks each
shared expert's w1 and w3).

Host memory: safetensors maps each file and one tensor at a time is copied to the device, so the peak
host copy is one tensor (its file's pages are the kernel's page cache, not the process's own memory).

The tensors, by canonical name, then become the architecture's typed records
(``Architecture.build_weights``, :mod:`deepinfer_core.model.records`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from deepinfer_core.config import ModelConfig
from deepinfer_core.model.errors import CheckpointError
from deepinfer_core.model.manifest import EXPERT_FILE_NAME, CheckpointManifest
from deepinfer_core.quant.fp4 import E8M0_DTYPE, FP4_BLOCK, dequantize_fp4_block, e8m0_from_float, is_power_of_two
from deepinfer_core.quant.fp8 import FP8_BLOCK, FP8_DTYPE, quantize_fp8_block, quantize_params_fp8, scale_shape
from deepinfer_core.quant.fp8 import dequantize_fp8_block as dequantize_fp8

__all__ = ["CheckpointError", "QuantConfig", "check_scale", "checkpoint_files", "expected_file_names",
           "expected_shapes", "fp8_weight_names", "has_drafter_weights", "load_weights", "manifest_of",
           "parameter_dtype", "quant_config", "read_checkpoint", "read_headers"]

_EXPERT = EXPERT_FILE_NAME


# --- what the config expects ---------------------------------------------------------------------------


def manifest_of(cfg: ModelConfig) -> CheckpointManifest:
    """The checkpoint manifest of ``cfg``'s architecture, built once per config object."""
    manifest = cfg.__dict__.get("_manifest")
    if manifest is None:
        manifest = cfg.__dict__["_manifest"] = cfg.architecture.manifest(cfg)
    return manifest


def expected_shapes(cfg: ModelConfig, with_mtp: bool, num_experts: int | None = None) -> dict[str, tuple[int, ...]]:
    """Every parameter a checkpoint of ``cfg`` holds, with its shape (routed experts stacked: ``num_experts``
    of them, all by default); the drafter's with ``with_mtp``."""
    return manifest_of(cfg).shapes(with_mtp, num_experts)


def expected_file_names(cfg: ModelConfig, with_mtp: bool = True) -> dict[str, tuple[int, ...]]:
    """The tensors a checkpoint in the published layout holds for ``cfg`` (routed experts one by one as
    ``...experts.E.w{1,2,3}.weight``), with their logical (unpacked) shapes; block scales not included."""
    return manifest_of(cfg).file_names(with_mtp)


def fp8_weight_names(cfg: ModelConfig, numerics: str = "transformers") -> set[str]:
    """Every parameter name (after the architecture's re-layout, drafter included) that FP8 mode keeps in
    E4M3 under ``numerics``."""
    return manifest_of(cfg).fp8_names(numerics)


def parameter_dtype(cfg: ModelConfig, name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype parameter ``name`` is kept in when the model runs in ``dtype`` (index tables are
    integers; the parameters the manifest marks float32 stay float32 under bf16/fp16)."""
    return manifest_of(cfg).parameter_dtype(name, dtype)


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
    want = manifest_of(cfg).fp8_block
    block = tuple(qc.get("weight_block_size") or want)
    if block != want:
        raise CheckpointError(f"{where}: weight_block_size {list(block)} is not supported (this architecture "
                              f"publishes {list(want)})")
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


def read_headers(path: Path, manifest: CheckpointManifest) -> dict[str, _Entry]:
    """Canonical name (``manifest``'s) -> file entry of every tensor in the checkpoint in ``path``; two
    entries of one canonical name, or an index that puts a tensor in a file that lacks it, are errors."""
    files = checkpoint_files(path)
    entries: dict[str, _Entry] = {}
    for f in files:
        with _open(f) as handle:
            for key in handle.keys():
                sl = handle.get_slice(key)
                code = sl.get_dtype()
                entry = _Entry(key, f, _FILE_DTYPES.get(code, code), tuple(sl.get_shape()))
                name = manifest.canonical_name(key)
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


def has_drafter_weights(cfg: ModelConfig, path: Path) -> bool:
    """Does the checkpoint in ``path`` carry the drafter's (MTP) tensors?"""
    manifest = manifest_of(cfg)
    drafter = set(manifest.drafter_file_names())
    return any(n in drafter for n in read_headers(Path(path), manifest))


# --- the plan: every file tensor checked and assigned before anything is read --------------------------


def check_scale(name: str, weight: torch.Tensor | tuple[int, ...], scale: torch.Tensor | tuple[int, ...],
                block: int | tuple[int, int] = FP8_BLOCK) -> None:
    """One scale per ``block`` tile of ``weight`` (128x128 by default), or a :class:`CheckpointError`
    naming both shapes."""
    wshape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else tuple(weight)
    sshape = tuple(scale.shape) if isinstance(scale, torch.Tensor) else tuple(scale)
    rows, cols = (block, block) if isinstance(block, int) else block
    want = (-(-wshape[-2] // rows), -(-wshape[-1] // cols))
    if sshape != want:
        raise CheckpointError(
            f"block scale of {name} has shape {sshape}, expected {want} "
            f"(one per {rows}x{cols} tile of its {wshape} weight)"
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
                 block: tuple[int, int]) -> None:
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
            check_scale(name, got, scale.shape, block)
        except CheckpointError as exc:
            raise CheckpointError(f"{exc} ({scale.where()})") from None


def _plan(cfg: ModelConfig, manifest: CheckpointManifest, entries: dict[str, _Entry],
          shapes: dict[str, tuple[int, ...]], experts: range, quant: QuantConfig,
          drafter_experts: range | None = None) -> tuple[list[_Item], dict[str, set[str]]]:
    """(items, stack name -> the formats of its experts in the file); raises on any tensor
    that is unknown, mis-shaped or mis-typed, and on any that is missing."""
    num_experts = manifest.num_experts

    def stack_experts(key: str) -> range:
        """The experts of stack ``key`` to load: ``experts`` for the target's, ``drafter_experts`` (all by
        default) of a drafter's own size."""
        full = manifest.rows[key].shape[0]
        if full == num_experts:
            return experts
        return range(full) if drafter_experts is None else drafter_experts

    scales = {n.removesuffix(".scale") + ".weight": e for n, e in entries.items() if n.endswith(".scale")}
    items: list[_Item] = []
    unknown: list[str] = []
    stack_fmt: dict[str, set[str]] = {}
    filled: set[str] = set()
    for name, entry in entries.items():
        if name.endswith(".scale"):
            weight = name.removesuffix(".scale") + ".weight"
            expected = weight in shapes or (_EXPERT.match(weight) and not manifest.is_ignored(weight))
            if weight not in entries and not expected:  # (an expected weight is reported missing below)
                unknown.append(f"{name} ({entry.where()}: a block scale without its weight)")
            continue
        if manifest.is_ignored(name):
            continue
        scale = scales.get(name)
        m = _EXPERT.match(name)
        merged = name in shapes and manifest.rows[name].experts
        if m:
            prefix, e, which = m.group(1), int(m.group(2)), m.group(3)
            key = prefix + (".w13" if which in ("w1", "w3") else ".w2")
            total = manifest.rows[key].shape[0] if key in manifest.rows else num_experts
            if key not in shapes or e >= total:
                unknown.append(f"{name} ({entry.where()}; the config has {total} experts there)")
                continue
            fmt = _fmt_of(name, entry, scale, True, quant)
            inter = shapes[key][1] // 2  # w13 stacks the gate (w1) rows, then the up (w3) rows
            want = shapes[key][1:] if which == "w2" else (inter, shapes[key][2])
            _check_shape(name, entry, fmt, want, scale, manifest.block_of(name))
            if e not in stack_experts(key):
                continue
            stack_fmt.setdefault(key, set()).add(fmt)
            if which == "w2":
                rows = slice(0, shapes[key][1])
            else:
                rows = slice(0, inter) if which == "w1" else slice(inter, 2 * inter)
            items.append(_Item(name, entry, fmt, scale, key, e - stack_experts(key).start, rows))
            filled.add(f"{key}:{e}:{which}")
        elif merged:
            fmt = _fmt_of(name, entry, scale, True, quant)
            if fmt != "float":
                raise CheckpointError(f"merged experts {name} ({entry.where()}) are {entry.dtype}: quantised "
                                      "merged experts are not read; use DeepSeek's per-expert layout")
            _check_shape(name, entry, fmt, (num_experts, *shapes[name][1:]), None, manifest.block_of(name))
            stack_fmt[name] = {fmt}
            items.append(_Item(name, entry, fmt, None, name))
            parts = ("w1", "w3") if name.endswith("w13") else ("w2",)
            filled.update(f"{name}:{e}:{w}" for e in experts for w in parts)
        elif name in shapes:
            fmt = _fmt_of(name, entry, scale, False, quant)
            _check_shape(name, entry, fmt, shapes[name], scale, manifest.block_of(name))
            items.append(_Item(name, entry, fmt, scale, name))
            filled.add(name)
        else:
            unknown.append(f"{name} ({entry.where()})")
    if unknown:
        raise CheckpointError(f"{len(unknown)} tensor(s) the config does not have: {', '.join(unknown[:8])}"
                              + (" ..." if len(unknown) > 8 else ""))
    stacks = [n for n in shapes if manifest.rows[n].experts]
    missing = [n for n in shapes if n not in stacks and n not in filled]
    missing = [n for n in missing if not (n in manifest.tied and manifest.tied[n] in filled)]
    for key in stacks:
        prefix, which = key.rsplit(".", 1)
        parts = ("w1", "w3") if which == "w13" else ("w2",)
        missing += [f"{prefix}.{e}.{w}.weight" for e in stack_experts(key) for w in parts
                    if f"{key}:{e}:{w}" not in filled]
    if missing:
        raise CheckpointError(f"checkpoint lacks {len(missing)} tensor(s), e.g. {missing[:5]}")
    return items, stack_fmt


# --- reading -------------------------------------------------------------------------------------------


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
) -> Any:
    """The checkpoint in ``path`` as the architecture's typed records. ``keep_fp8`` (FP8 mode): E4M3 weights stay E4M3,
    packed FP4 routed experts stay packed FP4, and the FP8-eligible weights the checkpoint did not ship
    quantised are quantised. ``keep_fp4`` (default: ``keep_fp8``): packed FP4 experts stay packed
    whatever ``keep_fp8`` says. ``experts``: the routed experts to load (a contiguous range of ids, all by
    default); the stacks then hold only those, in order. ``hook`` (a plugin manager's hook relay): its
    ``deepinfer_process_weights`` is called once on the records. ``numerics``: which weights FP8 mode
    keeps in E4M3 (the manifest's :meth:`~deepinfer_core.model.manifest.CheckpointManifest.fp8_names`)."""
    params = read_checkpoint(cfg, path, dtype, device, keep_fp8, show_progress, experts, keep_fp4, numerics)
    if keep_fp8:
        quantize_params_fp8(params, fp8_weight_names(cfg, numerics), ue8m0=numerics == "deepseek")
    return cfg.architecture.build_weights(cfg, params, hook, num_experts=None if experts is None else len(experts))


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


def _nonfinite_code(tensor: torch.Tensor, fmt: str) -> torch.Tensor | None:
    """A 0-dim code on ``tensor``'s device, computed without a host sync: 0 when every value is finite, 1
    when one is infinite, 2 or 3 when one is NaN; None for a format that holds neither (integer tables,
    packed FP4). A float tensor costs one reduction (min and max propagate NaN and reach an infinity), and
    no copy of it; E4M3 has no infinity, and its NaN is every bit but the sign set."""
    if not tensor.numel() or fmt not in ("float", "fp8"):
        return None
    if fmt == "fp8":
        return ((tensor.view(torch.uint8) & 0x7F) == 0x7F).any().long() * 2
    lo, hi = torch.aminmax(tensor)
    return (lo.isnan() | hi.isnan()).long() * 2 + (lo.isinf() | hi.isinf()).long()


def _refuse_nonfinite(checks: list[tuple[_Item, torch.Tensor]]) -> None:
    """A :class:`CheckpointError` naming every tensor of ``checks`` whose code (:func:`_nonfinite_code`)
    is not 0; the codes come to the host together, once. ``checks`` is emptied."""
    if not checks:
        return
    codes = torch.stack([code for _, code in checks]).tolist()
    bad = [f"{item.name} ({item.entry.where()}: {'NaN' if code >= 2 else 'infinity'})"
           for (item, _), code in zip(checks, codes) if code]
    checks.clear()
    if bad:
        raise CheckpointError(f"{len(bad)} weight(s) hold non-finite values: {', '.join(bad[:8])}"
                              + (" ..." if len(bad) > 8 else ""))


def _check_span(name: str, span: range, total: int, what: str = "") -> None:
    if span.step != 1 or span.start < 0 or span.stop > total or not len(span):
        raise ValueError(f"{name} must be a non-empty contiguous range within 0..{total}{what}, got {span}")


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
    exclude: frozenset[str] = frozenset(),
    drafter_experts: range | None = None,
) -> dict[str, torch.Tensor]:
    """Check every tensor's name, shape and dtype against the config (before reading any), then read them
    file by file straight onto ``device``, dequantising there (or keeping them quantised with
    ``keep_fp8``), stacking the routed experts; block scales come back as ``name + "_scale"``. A float or
    FP8 weight holding NaN or an infinity is a :class:`CheckpointError` naming it and its file. ``exclude``:
    canonical names checked but not read (the architecture places them itself: V4.1's Engram tables).
    ``drafter_experts``: the experts to read of a drafter's own stacks (DSpark's; a contiguous range, all by
    default)."""
    path = Path(path)
    manifest = manifest_of(cfg)
    entries = read_headers(path, manifest)
    quant = quant_config(cfg)
    num_experts = manifest.num_experts
    experts = range(num_experts) if experts is None else experts
    _check_span("experts", experts, num_experts)
    drafter = set(manifest.drafter_file_names())
    with_drafter = any(n in drafter for n in entries)
    if drafter_experts is not None:
        own = min((r.shape[0] for r in manifest.rows.values()
                   if r.experts and r.drafter and r.shape[0] != num_experts), default=0)
        _check_span("drafter_experts", drafter_experts, own, " (the drafter's own experts)")
    shapes = manifest.shapes(with_drafter, len(experts), None if drafter_experts is None else len(drafter_experts))
    items, stack_fmt = _plan(cfg, manifest, entries, shapes, experts, quant, drafter_experts)

    device = torch.device(device)
    dev = str(device) if device.type != "cuda" or device.index is not None else "cuda:0"
    kept_fp8 = manifest.fp8_names(numerics) if keep_fp8 else set()
    kept_fp8 |= {r.name for r in manifest.rows.values() if r.kept}
    acc = torch.float32  # dequantised in float32 (as a float32 checkpoint of the same values), then cast
    params: dict[str, torch.Tensor] = {}

    def param_dtype(name: str) -> torch.dtype:
        return manifest.parameter_dtype(name, dtype)

    def stack_layout(key: str) -> str:
        """How stack ``key`` is kept: "fp4" (packed), "fp8" (E4M3 + tile scales) or "float"."""
        fmts = stack_fmt[key]
        if "fp4" in fmts and (keep_fp8 if keep_fp4 is None else keep_fp4):
            return "fp4"  # then all are: packed FP4 needs expert_dtype "fp4", which admits nothing else
        if not keep_fp8:
            return "float"
        whole_tiles = key.endswith(".w2") or shapes[key][1] // 2 % FP8_BLOCK == 0
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
            return dequantize_fp8(tensor, scale, manifest.block_of(item.name), dtype=acc).to(out)
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
    checks: list[tuple[_Item, torch.Tensor]] = []  # the file's weights' non-finite codes, read at its end
    progress = tqdm(total=len(items), desc="loading weights", unit="tensor", disable=not show_progress)
    try:
        for n, item in enumerate(ordered):
            if n and item.entry.file != ordered[n - 1].entry.file:  # one file mapped at a time
                _refuse_nonfinite(checks)
                close_files()
            progress.update(1)
            if item.target in exclude:
                continue
            tensor = get(item.entry).to(device)
            code = _nonfinite_code(tensor, item.fmt)
            if code is not None:
                checks.append((item, code))
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
                kept_table = manifest.rows[key].kept  # a table keeps its power-of-two scales as E8M0 bytes
                params[key], params[key + "_scale"] = tensor, e8m0_from_float(scale) if kept_table else scale
            else:
                params[key] = dequantized(item, tensor, scale, param_dtype(key))
        _refuse_nonfinite(checks)
    finally:
        progress.close()
        close_files()
    for name, source in manifest.tied.items():
        if name not in params and source in params:
            params[name] = params[source]
    prepare = cfg.architecture.prepare_params
    if prepare is not None:
        prepare(cfg, params, param_dtype)
    return params

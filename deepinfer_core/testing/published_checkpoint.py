"""Tiny checkpoints in the layout DeepSeek published, and their dequantised twins.

:func:`to_published` writes float tensors as the architecture's checkpoint manifest says the published
files store them (:meth:`~deepinfer_core.model.manifest.CheckpointManifest.stored_format`): canonical
names, ``fp8`` linears in E4M3 with ``float8_e8m0fnu`` scales per 128x128 tile, ``fp4`` routed experts
e2m1 packed two a byte as int8 [out, in/2] with ``float8_e8m0fnu`` scales [out, in/32], ``bf16``,
``fp32`` and ``int32`` tensors as such. For DeepSeek-V4, :func:`build_published_checkpoint` writes a
random tiny model (the weights of :func:`~deepinfer_core.testing.tiny_model.build_tiny_checkpoint`) that
way (flat names as DeepSeek's ``inference/model.py`` declares them, ``mtp.0.*`` included) with a
``config.json`` carrying ``quantization_config`` and ``expert_dtype: "fp4"``; optionally in shards
with an index. :func:`write_dequantised_copy` writes the same values in float32 without quantisation
(its own unpacking, not the loader's), the reference a published checkpoint must load equal to.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from deepinfer_core.config import ModelConfig
from deepinfer_core.model.loader import manifest_of
from deepinfer_core.model.manifest import CheckpointManifest
from deepinfer_core.quant.fp4 import E2M1_VALUES, quantize_fp4_block
from deepinfer_core.quant.fp8 import quantize_fp8_block

QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                       "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}

def to_published(tensors: dict[str, torch.Tensor], manifest: CheckpointManifest) -> dict[str, torch.Tensor]:
    """Float tensors under any name ``manifest`` maps -> its canonical names, stored formats and
    quantisation."""
    out: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        name = manifest.canonical_name(key)
        fmt = manifest.stored_format(name)
        if fmt == "fp4":
            packed, scale = quantize_fp4_block(value)
            out[name], out[name.removesuffix(".weight") + ".scale"] = packed.view(torch.int8), scale
        elif fmt == "fp8":
            q, scale = quantize_fp8_block(value, manifest.block_of(name), ue8m0=True)
            exponent = torch.log2(scale).round().to(torch.int32) + 127
            out[name] = q
            out[name.removesuffix(".weight") + ".scale"] = exponent.to(torch.uint8).view(torch.float8_e8m0fnu)
        else:
            out[name] = value.to({"int32": torch.int32, "bf16": torch.bfloat16, "fp32": torch.float32}[fmt])
    return {k: v.contiguous() for k, v in out.items()}


def _e8m0_values(scale: torch.Tensor) -> torch.Tensor:
    return torch.pow(2.0, scale.view(torch.uint8).to(torch.float64) - 127)


def dequantised(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Published tensors -> float32 tensors of the same values under the same names, scales dropped."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    out = {}
    for name, value in tensors.items():
        if name.endswith(".scale"):
            continue
        scale = tensors.get(name.removesuffix(".weight") + ".scale")
        if scale is None:
            out[name] = value if name.endswith("tid2eid") else value.to(torch.float32)
            continue
        s = _e8m0_values(scale) if scale.dtype == torch.float8_e8m0fnu else scale.to(torch.float64)
        if value.dtype == torch.float8_e4m3fn:
            n, k = value.shape
            full = s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
            out[name] = (value.to(torch.float64) * full).to(torch.float32)
        else:  # packed FP4: element 2j in the low nibble of byte j
            b = value.view(torch.uint8).long()
            vals = torch.empty((b.shape[0], 2 * b.shape[1]), dtype=torch.float64)
            vals[:, 0::2], vals[:, 1::2] = table[b & 15], table[b >> 4]
            out[name] = (vals * s.repeat_interleave(32, 1)).to(torch.float32)
    return out


def random_checkpoint_tensors(manifest: CheckpointManifest, value: Any, with_drafter: bool = True
                              ) -> dict[str, torch.Tensor]:
    """Every tensor the checkpoint file holds, in manifest order, as ``value(name, shape)`` makes it
    (unquantised: :func:`to_published` stores them as the release does); the drafter's left out unless
    ``with_drafter``."""
    tensors: dict[str, torch.Tensor] = {}
    for row in manifest.rows.values():
        if not row.in_file or (row.drafter and not with_drafter):
            continue
        for name, shape in row.file_parts():
            tensors[name] = value(name, shape)
    return tensors


def write_tensors(path: Path, tensors: dict[str, torch.Tensor], shards: int = 1) -> list[str]:
    """``tensors`` as ``model.safetensors``, or as ``shards`` files plus ``model.safetensors.index.json``
    (a weight and its scale may land in different shards, as nothing in the format forbids)."""
    from safetensors.torch import save_file

    for old in list(path.glob("*.safetensors")) + list(path.glob("model.safetensors.index.json")):
        old.unlink()
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    names, files, weight_map = sorted(tensors), [], {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        chunk = names[i::shards]
        save_file({n: tensors[n] for n in chunk}, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, file))
        files.append(file)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return files


def _read_all(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


def build_published_checkpoint(path: str | Path, name: str = "tiny", seed: int = 0, with_mtp: bool = True,
                               shards: int = 1, **overrides: Any) -> Path:
    """A random tiny model (config ``name`` with ``overrides``) in the published layout, in ``path``."""
    from deepinfer_core.testing.tiny_model import build_tiny_checkpoint

    path = Path(path)
    build_tiny_checkpoint(path, name, seed, with_mtp, **overrides)
    write_tensors(path, to_published(_read_all(path), manifest_of(ModelConfig.from_pretrained(path))), shards)
    config = json.loads((path / "config.json").read_text())
    config.update(quantization_config=dict(QUANTIZATION_CONFIG), expert_dtype="fp4", torch_dtype="bfloat16")
    config.pop("dtype", None)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "deepinfer_tiny.json").write_text(json.dumps({"name": name, "seed": seed, "layout": "published"}))
    return path


def write_dequantised_copy(src: str | Path, dst: str | Path) -> Path:
    """A copy of the published checkpoint ``src`` with every tensor dequantised to float32 and the
    quantisation keys removed from ``config.json``: the same model, unquantised."""
    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst)
    write_tensors(dst, dequantised(_read_all(src)))
    config = json.loads((dst / "config.json").read_text())
    config.pop("quantization_config", None)
    config.pop("expert_dtype", None)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst

"""The trained tiny V4.1's tensors in the release's layout, unquantised (``tools/train_tiny_v41.py``).

model.py's flat names, minus the stages' tied ``mtp.N.embed`` / ``mtp.N.head``; each tensor in the format
the manifest gives its role, except that the linears and experts the release stores in FP8 / FP4 are kept
bf16 (``config.json`` declares no ``quantization_config``): ``hc_*``, sinks and router biases float32,
every other float bf16, and the Engram tables E4M3 with one E8M0 scale per 32 values, the only form
model.py reads them in. :func:`round_to_storage` puts the stored values back into the training module, so
the model trained next (the drafter on the frozen target) and the checks after saving see exactly what
the engine loads.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

TIED = re.compile(r"^mtp\.\d+\.(embed|head)\.")


def stored_tensors(module: torch.nn.Module, manifest: Any) -> dict[str, torch.Tensor]:
    """Every parameter of ``module`` (model.py's names) as the checkpoint stores it."""
    from deepinfer_core.models.deepseek_v41.manifest import stored_format
    from deepinfer_core.testing.published_checkpoint import to_published

    out: dict[str, torch.Tensor] = {}
    for name, p in module.state_dict().items():
        if TIED.match(name) or name.endswith("engram.embed.scale"):
            continue
        value = p.detach().float()
        if name.endswith("engram.embed.weight"):  # E4M3 rows, an E8M0 scale per 32 values
            out.update(to_published({name: value}, manifest))
        elif stored_format(name) == "fp32":
            out[name] = value.clone()
        else:
            out[name] = value.to(torch.bfloat16)
    return out


def dequantised_table(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E4M3 [rows, d] with E8M0 [rows, d / 32] -> float32 (exact)."""
    s = torch.pow(2.0, scale.view(torch.uint8).float() - 127)
    return (weight.float().unflatten(-1, (-1, 32)) * s.unsqueeze(-1)).flatten(-2)


@torch.no_grad()
def round_to_storage(module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Set every parameter of ``module`` to the value ``tensors`` (from :func:`stored_tensors`) stores."""
    params = dict(module.named_parameters())
    for name, value in tensors.items():
        if name.endswith("engram.embed.scale"):
            continue
        if name.endswith("engram.embed.weight"):
            value = dequantised_table(value, tensors[name.removesuffix("weight") + "scale"])
        params[name].copy_(value.float())


def write_checkpoint(out: Path, tensors: dict[str, torch.Tensor], config: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")

"""DeepSeek's own DeepSeek-V4.1 ``inference/model.py`` made trainable, for ``tools/train_tiny_v41.py``.

The release folder is passed by path (it is not part of this repository); its ``kernel.py`` is the test
suite's torch stand-in (``tests/models/v41_reference.py``) with every quantisation step off. What changes
against inference, and why it leaves the forward's arithmetic as model.py's:

* ``Transformer.forward`` is called without its ``inference_mode`` decorator (``__wrapped__``), under the
  harness's :class:`ReferenceMode` (CUDA's tie order for ``topk``), the head returning every position;
* every parameter is float32 and trainable, except the indexers (their output is a top-k of indices, which
  no loss reaches: they run under ``no_grad`` with their random weights) and the routers' ``bias``
  (moved by the aux-loss-free balancing rule, not by gradients);
* the Engram tables are float32 tensors with unit scales (model.py keeps them E4M3; they are quantised so on
  save); the n-gram hashes, computed under ``inference_mode``, are cloned so autograd may save them;
* the caches model.py writes during a prefill (window rings, compressed KV, index keys, compressor tails)
  are detached before each forward: a prefill overwrites every entry it reads, and without the detach the
  next backward would walk into the previous step's freed graph.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]


def harness(reference: Path):
    """The suite's model.py harness, pointed at the release folder ``reference`` (its ``inference/``)."""
    sys.path.insert(0, str(REPO / "tests" / "models"))
    import v41_reference as ref

    ref.REFERENCE_DIR = Path(reference)
    ref.require_reference()
    return ref


def init_value(name: str, shape: tuple[int, ...], n_layers: int, gen: torch.Generator) -> torch.Tensor:
    """The initial value of parameter ``name`` (model.py's flat names): unit norms, zero sinks and
    Markov/confidence heads, small hyper-connection projections, 1/sqrt(fan_in) matrices with the residual
    writers (``wo_b``, ``w2``, Engram's ``wkv``) scaled down by sqrt(2 * layers)."""
    def randn(std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    last = name.rsplit(".", 1)[-1]
    if name.endswith(("norm.weight", "q_weight", "k_weight")):
        return torch.ones(shape)
    if last == "attn_sink" or name.endswith(("gate.bias", "markov_head.head.weight", "confidence_head.proj.weight")):
        return torch.zeros(shape)
    if "hc_" in name:
        if last.endswith("_fn"):
            return randn(0.01)
        if last.endswith("_scale"):
            return torch.ones(shape)
        return torch.zeros(shape)
    if name == "embed.weight" or name.endswith("markov_head.embed.weight"):
        return randn(1.0)
    if name.endswith("engram.embed.weight"):
        return randn(0.5)
    std = shape[-1] ** -0.5
    if name.endswith(("wo_b.weight", "w2.weight", "engram.wkv.weight")):
        std /= math.sqrt(2 * n_layers)
    return randn(std)


class TrainableV41:
    """model.py's ``Transformer`` for the flat config ``flat``, float32, ready to train (``module``)."""

    def __init__(self, ref: Any, flat: dict, tokenizer, seq_len: int, batch: int, seed: int):
        self.ref = ref
        m = ref.import_model(quant=False)
        self.m = m
        margs = ref._model_args(m, {**flat, "temperature": 0}, False, seq_len, batch)
        with ref._default_dtype(torch.float32):
            model = m.Transformer(margs, tokenizer)
        self.module, self.args = model, margs
        gen = torch.Generator().manual_seed(seed)
        for mname, mod in model.named_modules():
            prefix = f"{mname}." if mname else ""
            for pname, p in list(mod.named_parameters(recurse=False)):
                name = prefix + pname
                if isinstance(mod, m.ParallelEngramEmbedding) and pname == "scale":
                    value, trainable = torch.ones(p.shape), False
                else:
                    value = init_value(name, tuple(p.shape), margs.n_layers, gen)
                    trainable = ".indexer." not in name and not name.endswith("gate.bias")
                setattr(mod, pname, nn.Parameter(value.float(), requires_grad=trainable))
            if isinstance(mod, m.Indexer):
                mod.forward = torch.no_grad()(mod.forward)
        for mod in model.modules():  # model.py reads a quantised weight's scale through ``weight.scale``
            if isinstance(mod, m.Linear):
                mod.weight.scale = mod.scale
        if model.engram_hash is not None:
            hashes = model.engram_hash.forward
            model.engram_hash.forward = lambda *a, **k: hashes(*a, **k).clone()
        self.forward_fn = m.Transformer.forward.__wrapped__

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Every parameter once, by model.py's name (the stages' tied embedding and head not repeated)."""
        return self.module.named_parameters()

    def routers(self, drafter: bool) -> list[nn.Module]:
        """The target's routers, or the drafter stages'."""
        return [mod.gate for mod in self.module.modules()
                if isinstance(mod, self.m.MoE) and (mod.layer_id >= self.args.n_layers) == drafter]

    def detach_caches(self) -> None:
        for mod in self.module.modules():
            for bname, buf in mod._buffers.items():
                if buf is not None and buf.grad_fn is not None:
                    mod._buffers[bname] = buf.detach()

    @contextmanager
    def mode(self, widen: bool = False) -> Iterator[None]:
        with self.ref.ReferenceMode(widen), self.ref._all_positions(self.module.head):
            yield

    def forward(self, ids: torch.Tensor, widen: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill ``ids`` [B, S] from position 0 -> (logits [B, S, V], main_hidden [B, S, D * targets]):
        model.py's ``Transformer.forward`` with every position's logits."""
        self.detach_caches()
        with self.mode(widen):
            _, logits, main_hidden = self.forward_fn(self.module, ids, 0)
        return logits, main_hidden

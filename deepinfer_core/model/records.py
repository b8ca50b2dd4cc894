"""Typed weight records, the building blocks every architecture's weights are made of, and the generic
mapping between records and checkpoint names.

An architecture declares its records as dataclasses and a layout: record type -> {field: relative
name}, where a relative name is a tensor's name (a :class:`Linear` adds ``"_scale"`` for its block
scales) or the prefix of a nested record; a list of records numbers them (``layers.0.``,
``layers.1.``, ...). :func:`build_records` fills records from canonical names, :func:`named_tensors`
walks them back. Tensors keep the checkpoint's layout; a backend may re-lay them in
``deepinfer_process_weights`` by replacing fields.
"""

from __future__ import annotations

import functools
import re
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

import torch

from deepinfer_core.model.errors import CheckpointError

#: record type -> {field name: relative checkpoint name}
Layout = Mapping[type, Mapping[str, str]]


@dataclass
class Linear:
    """``x @ weight.T`` for a logical weight [N, K] (stacked experts: [E, N, K]), kept in one of three
    formats (:attr:`format`):

    * ``"float"``: ``weight`` [N, K] in a float dtype, ``scale`` None;
    * ``"fp8"``: ``weight`` E4M3 [N, K], ``scale`` one float32 per 128x128 tile ``[ceil(N/128), ceil(K/128)]``;
    * ``"fp4"``: ``weight`` uint8 [N, K/2], two e2m1 values a byte along K (the even one in the low
      nibble), ``scale`` ``float8_e8m0fnu`` [N, K/32], one power of two per 32 inputs
      (:mod:`deepinfer_core.quant.fp4`)."""

    weight: torch.Tensor
    scale: torch.Tensor | None = None

    @property
    def format(self) -> str:
        if self.scale is None:
            return "float"
        return "fp4" if self.weight.dtype in (torch.uint8, torch.float4_e2m1fn_x2) else "fp8"

    @property
    def is_fp8(self) -> bool:
        return self.format == "fp8"

    @property
    def is_fp4(self) -> bool:
        return self.format == "fp4"


@dataclass
class Experts:
    """Routed experts, stacked: ``w13`` [E, 2I, D] (gate rows, then up rows) and ``w2`` [E, D, I], both
    in one :attr:`Linear.format` (FP4: packed [E, 2I, D/2] and [E, D, I/2] with scales per 32 inputs)."""

    w13: Linear
    w2: Linear

    @property
    def is_fp8(self) -> bool:
        return self.w13.is_fp8 and self.w2.is_fp8

    @property
    def is_fp4(self) -> bool:
        return self.w13.is_fp4 and self.w2.is_fp4


def records(root: object, leaves: tuple[type, ...] = ()) -> Iterator[object]:
    """``root`` (a record or a list of them) and every record nested in it, depth first; the records of a
    type in ``leaves`` are yielded but not entered."""
    if isinstance(root, list):
        for item in root:
            yield from records(item, leaves)
        return
    if not is_dataclass(root):
        return
    yield root
    if isinstance(root, leaves):
        return
    for f in fields(root):
        yield from records(getattr(root, f.name), leaves)


@functools.cache
def _fields(cls: type, layout: tuple[tuple[str, str], ...]) -> list[tuple[str, str, Any, bool]]:
    """(field, relative name, type, optional) of each field of record type ``cls``."""
    hints = typing.get_type_hints(cls)
    out = []
    for name, rel in layout:
        hint, args = hints[name], typing.get_args(hints[name])
        optional = typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args
        if optional:
            hint = next(a for a in args if a is not type(None))
        out.append((name, rel, hint, optional))
    return out


def _record_fields(cls: type, layout: Layout) -> list[tuple[str, str, Any, bool]]:
    return _fields(cls, tuple(layout[cls].items()))


def build_records(cls: type, params: Mapping[str, torch.Tensor], layout: Layout, prefix: str = "") -> Any:
    """A ``cls`` record filled from ``params`` (canonical names, FP8/FP4 scales as ``name + "_scale"``);
    an absent optional nested record is None, an absent required tensor a :class:`CheckpointError`."""
    values = {}
    for name, rel, kind, optional in _record_fields(cls, layout):
        full = prefix + rel
        if typing.get_origin(kind) is list:
            item = typing.get_args(kind)[0]
            found = {int(m.group(1)) for k in params if (m := re.match(re.escape(full) + r"(\d+)\.", k))}
            values[name] = [build_records(item, params, layout, f"{full}{i}.")
                            for i in range(max(found, default=-1) + 1)]
        elif kind is torch.Tensor:
            if full not in params and not optional:
                raise CheckpointError(f"no tensor {full}")
            values[name] = params.get(full)
        elif kind is Linear:
            if full not in params and not optional:
                raise CheckpointError(f"no tensor {full}")
            values[name] = Linear(params[full], params.get(full + "_scale")) if full in params else None
        elif optional and not any(k.startswith(full) for k in params):
            values[name] = None
        else:
            values[name] = build_records(kind, params, layout, full)
    return cls(**values)


def named_tensors(record: Any, layout: Layout, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(canonical checkpoint name, tensor) of every tensor in ``record``, FP8/FP4 scales as
    ``name + "_scale"``; a tensor shared by two fields (tied embeddings) comes once per name."""
    for name, rel, *_ in _record_fields(type(record), layout):
        value, full = getattr(record, name), prefix + rel
        if value is None:
            continue
        if isinstance(value, list):
            for i, item in enumerate(value):
                yield from named_tensors(item, layout, f"{full}{i}.")
        elif isinstance(value, torch.Tensor):
            yield full, value
        elif isinstance(value, Linear):
            yield full, value.weight
            if value.scale is not None:
                yield full + "_scale", value.scale
        else:
            yield from named_tensors(value, layout, full)

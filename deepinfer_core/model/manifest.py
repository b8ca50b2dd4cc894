"""A checkpoint manifest: one row per parameter an architecture reads, from which the loader's checks,
the footprint and ``deepinfer plan``, the FP8/FP4 name sets and the tiny-checkpoint builders derive.

Rows carry canonical names (the architecture's own naming, DeepSeek's published one for the V4 family),
the logical shape (routed experts stacked [E, N, K]: the file holds them one expert at a time), how the
published files store the tensor and how the engine keeps it. File names in other layouts are mapped
to canonical ones by the manifest's ``renames``; entries matching ``ignored`` are dropped.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

#: how a published checkpoint stores a tensor
STORED_FORMATS = ("fp8", "fp4", "bf16", "fp32", "int32")
#: routed experts stored one by one: ``<stack>.E.w1.weight`` (w13's gate rows), ``.w3`` (up rows), ``.w2``
EXPERT_FILE_NAME = re.compile(r"^(.*\.ffn\.experts)\.(\d+)\.(w[123])\.weight$")


def stored_bytes(stored: str, shape: tuple[int, ...], block: tuple[int, int] = (128, 128)) -> int:
    """Bytes of one file tensor of logical ``shape`` [.., out, in] stored as ``stored``, its block scale
    included (FP8: one per ``block`` tile, 128x128 by default; FP4: one e8m0 per 32 values)."""
    n = math.prod(shape)
    if stored == "fp4":
        return n // 2 + n // 32
    if stored == "fp8":
        return n + math.prod(shape[:-2]) * math.ceil(shape[-2] / block[0]) * math.ceil(shape[-1] / block[1])
    return n * (2 if stored == "bf16" else 4)


@dataclass(frozen=True)
class TensorSpec:
    """One parameter of an architecture.

    ``fp8``: the numerics under which FP8 mode keeps it in E4M3 (``"transformers"``, ``"deepseek"``).
    ``fp32``: kept in float32 when the model runs in bf16/fp16. ``integer``: an index table (kept int64).
    ``experts``: a routed-expert stack, [E, N, K]. ``in_file``: False for a parameter the loader makes
    from others (a stacked shared expert); ``loaded``: False for a file tensor the loader folds into such
    a parameter. ``drafter``: part of the checkpoint's draft model (optional in a checkpoint). ``block``: the
    (rows, columns) one FP8 scale covers (DeepSeek-V4: 128x128 tiles; V4.1: 32x32, its Engram tables 1x32).
    ``group``: what part of the model the tensor serves where that is not the text model (``"vision"``)."""

    name: str
    shape: tuple[int, ...]
    stored: str = "fp32"
    fp8: frozenset[str] = frozenset()
    fp32: bool = False
    integer: bool = False
    experts: bool = False
    in_file: bool = True
    loaded: bool = True
    drafter: bool = False
    block: tuple[int, int] = (128, 128)
    group: str = "text"
    kept: bool = False  # stays FP8 with its block scales in every mode (a lookup table read a few rows at a time)

    def __post_init__(self) -> None:
        if self.stored not in STORED_FORMATS:
            raise ValueError(f"{self.name}: stored format {self.stored!r} is not one of {STORED_FORMATS}")

    def stored_bytes(self) -> int:
        """Bytes in the published files, block scales included."""
        return sum(stored_bytes(self.stored, shape, self.block) for _, shape in self.file_parts())

    def file_parts(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """(file name, logical shape) of each tensor a published checkpoint holds for this parameter:
        one per expert and half for a stack, the parameter itself otherwise."""
        if not self.experts:
            yield self.name, self.shape
            return
        e, n, k = self.shape
        prefix, which = self.name.rsplit(".", 1)
        parts = {"w1": (n // 2, k), "w3": (n // 2, k)} if which == "w13" else {"w2": (n, k)}
        for i in range(e):
            for w, shape in parts.items():
                yield f"{prefix}.{i}.{w}.weight", shape


@dataclass
class CheckpointManifest:
    """Every parameter of one model configuration, by canonical name."""

    rows: dict[str, TensorSpec]
    renames: list[tuple[re.Pattern[str], str]] = field(default_factory=list)
    ignored: re.Pattern[str] = re.compile(r"(?!)")
    #: parameter -> the one it may be tied to (a head tied to the embedding)
    tied: dict[str, str] = field(default_factory=dict)
    #: the ``quantization_config.weight_block_size`` the architecture's FP8 linears are published in
    fp8_block: tuple[int, int] = (128, 128)

    @classmethod
    def of(cls, rows: Iterable[TensorSpec], **kw) -> CheckpointManifest:
        return cls({r.name: r for r in rows}, **kw)

    @property
    def num_experts(self) -> int:
        """Routed experts per stack of the target model (0: none)."""
        return next((r.shape[0] for r in self.rows.values() if r.experts and not r.drafter),
                    next((r.shape[0] for r in self.rows.values() if r.experts), 0))

    def block_of(self, file_name: str) -> tuple[int, int]:
        """The FP8 scale tile of tensor ``file_name`` (an expert's part: its stack's)."""
        m = EXPERT_FILE_NAME.match(file_name)
        key = f"{m.group(1)}.{'w2' if m.group(3) == 'w2' else 'w13'}" if m else file_name
        row = self.rows.get(key)
        return row.block if row is not None else self.fp8_block

    def drafter_file_names(self) -> Iterator[str]:
        """File names (canonical) of the drafter's tensors, experts both stacked and one by one."""
        for r in self.rows.values():
            if r.drafter and r.in_file:
                yield r.name
                if r.experts:
                    yield from (n for n, _ in r.file_parts())

    def canonical_name(self, name: str) -> str:
        for pattern, repl in self.renames:
            name = pattern.sub(repl, name)
        return name

    def is_ignored(self, name: str) -> bool:
        return bool(self.ignored.search(name))

    def shapes(self, with_drafter: bool = True, num_experts: int | None = None,
               drafter_experts: int | None = None) -> dict[str, tuple[int, ...]]:
        """Every parameter a checkpoint holds, with its shape (the target's routed-expert stacks of
        ``num_experts``, all by default; a drafter's stacks of another size of ``drafter_experts``, all by
        default)."""
        return {r.name: self._resized(r, num_experts, drafter_experts) for r in self.rows.values()
                if r.in_file and (with_drafter or not r.drafter)}

    def _resized(self, r: TensorSpec, num_experts: int | None, drafter_experts: int | None) -> tuple[int, ...]:
        if r.experts and num_experts is not None and r.shape[0] == self.num_experts:
            return (num_experts, *r.shape[1:])
        if r.experts and r.drafter and drafter_experts is not None and r.shape[0] != self.num_experts:
            return (drafter_experts, *r.shape[1:])
        return r.shape

    def loaded_shapes(self, with_drafter: bool = True, num_experts: int | None = None,
                      drafter_experts: int | None = None) -> dict[str, tuple[int, ...]]:
        """Every parameter the model holds once loaded (after the architecture's re-layout), with its shape:
        stacks of the target's expert count at ``num_experts`` slots, a drafter's stacks of another count
        (DSpark's own experts) at ``drafter_experts`` (all by default)."""
        return {r.name: self._resized(r, num_experts, drafter_experts) for r in self.rows.values()
                if r.loaded and (with_drafter or not r.drafter)}

    def file_names(self, with_drafter: bool = True) -> dict[str, tuple[int, ...]]:
        """The tensors a published checkpoint holds (experts one by one), with logical shapes; block
        scales not included."""
        out = {}
        for r in self.rows.values():
            if r.in_file and (with_drafter or not r.drafter):
                out.update(r.file_parts())
        return out

    def fp8_names(self, numerics: str = "transformers") -> set[str]:
        """Parameters FP8 mode keeps in E4M3 under ``numerics``."""
        return {r.name for r in self.rows.values() if numerics in r.fp8}

    def parameter_dtype(self, name: str, dtype: torch.dtype) -> torch.dtype:
        """The dtype parameter ``name`` is kept in when the model runs in ``dtype``."""
        row = self.rows.get(name)
        if row is not None and row.integer:
            return torch.long
        if dtype in (torch.bfloat16, torch.float16) and row is not None and row.fp32:
            return torch.float32
        return dtype

    def stored_format(self, file_name: str) -> str:
        """How the published files store tensor ``file_name`` (an expert's part: its stack's format)."""
        m = EXPERT_FILE_NAME.match(file_name)
        key = f"{m.group(1)}.{'w2' if m.group(3) == 'w2' else 'w13'}" if m else file_name
        row = self.rows.get(key)
        if row is None:
            raise KeyError(f"{file_name} is not a parameter of this model")
        return row.stored

    def stored_bytes(self, with_drafter: bool = True) -> dict[str, int]:
        """Parameter -> bytes in the published files."""
        return {r.name: r.stored_bytes() for r in self.rows.values()
                if r.in_file and (with_drafter or not r.drafter)}

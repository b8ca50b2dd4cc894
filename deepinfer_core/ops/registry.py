"""Op registration (what plugins contribute) and resolution into an :class:`OpTable`."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from deepinfer_core.ops.catalogue import CATALOGUE

logger = logging.getLogger(__name__)


class OpRegistrationError(ValueError):
    """A plugin registered an op wrongly (unknown name, duplicate priority, not callable)."""


class MissingOpError(LookupError):
    """The chosen backend provides no implementation of an op the model needs."""


@dataclass(frozen=True)
class BuildContext:
    """What a predicate sees when ops are resolved: decided once per engine, never per call."""

    backend: str
    dtype: Any = None
    device: Any = None
    model_config: Any = None
    #: batch-invariant mode: an op the catalogue does not mark batch-invariant resolves only to an
    #: implementation registered with ``batch_invariant=True``
    batch_invariant: bool = False
    #: judge on cheap probes only (is the library importable, does the device qualify) and run nothing on
    #: the device: listings such as ``deepinfer backends`` set it; an engine build never does, so a
    #: predicate may then run its one-off self-check
    probe_only: bool = False


@dataclass
class OpImpl:
    op: str
    fn: Callable
    priority: int
    provider: str
    predicate: Callable[[BuildContext], bool] | None = None
    batch_invariant: bool = False  # declared by the provider: one row's result never depends on the others
    syncs_host: bool = False  # declared by the provider: waits for values read back to the host (no graphs)

    def applies(self, ctx: BuildContext) -> bool:
        return self.verdict(ctx) == CHOSEN

    def verdict(self, ctx: BuildContext) -> str:
        """:data:`CHOSEN` when this implementation may serve under ``ctx``, else why not."""
        batch_invariant_mode = getattr(ctx, "batch_invariant", False)
        if batch_invariant_mode and not (self.batch_invariant or CATALOGUE[self.op].batch_invariant):
            return DECLINED
        return CHOSEN if self.predicate is None or bool(self.predicate(ctx)) else DECLINED


#: verdicts of :meth:`OpRegistry.explain`
CHOSEN, SHADOWED, DECLINED = "chosen", "shadowed", "declined by its predicate"


@dataclass
class OpRegistry:
    """Collects implementations; handed to ``deepinfer_register_ops`` hooks."""

    impls: dict[str, list[OpImpl]] = field(default_factory=dict)
    current_provider: str = "<unknown>"

    def register(
        self,
        op: str,
        fn: Callable,
        priority: int = 0,
        predicate: Callable[[BuildContext], bool] | None = None,
        batch_invariant: bool = False,
        syncs_host: bool = False,
    ) -> None:
        """Offer ``fn`` for ``op`` at ``priority`` (higher wins) where ``predicate(ctx)`` holds.

        ``batch_invariant``: one row's result never depends on the other rows of the call (see
        :data:`~deepinfer_core.ops.catalogue.CATALOGUE`). ``syncs_host``: ``fn`` waits for values read
        back from the device, so a step that calls it cannot be captured in a graph
        (:meth:`OpTable.syncs_host`).
        """
        who = self.current_provider
        if op not in CATALOGUE:
            raise OpRegistrationError(f"{who} registered unknown op {op!r}; known ops: {sorted(CATALOGUE)}")
        if not callable(fn):
            raise OpRegistrationError(f"{who} registered a non-callable for op {op!r}: {fn!r}")
        for other in self.impls.get(op, []):
            if other.priority == priority:
                raise OpRegistrationError(
                    f"op {op!r} registered twice at priority {priority}: by {other.provider} and by {who}; "
                    "give one of them a different priority"
                )
        self.impls.setdefault(op, []).append(
            OpImpl(op, fn, priority, who, predicate, batch_invariant, syncs_host)
        )

    def candidates(self, op: str) -> list[OpImpl]:
        return sorted(self.impls.get(op, []), key=lambda i: -i.priority)

    def explain(self, op: str, ctx: BuildContext) -> list[tuple[OpImpl, str]]:
        """Every implementation of ``op``, highest priority first, with its verdict under ``ctx`` (what
        listings show): the one :meth:`select` picks is :data:`CHOSEN`, later ones that apply are
        :data:`SHADOWED`, the others say why not; a predicate that raises is reported, not raised."""
        rows, chosen = [], False
        for impl in self.candidates(op):
            try:
                verdict = impl.verdict(ctx)
            except Exception as exc:
                verdict = f"predicate raised {type(exc).__name__}: {exc}"
            if verdict == CHOSEN and chosen:
                verdict = SHADOWED
            chosen = chosen or verdict == CHOSEN
            rows.append((impl, verdict))
        return rows

    def select(self, op: str, ctx: BuildContext) -> OpImpl | None:
        """The implementation that serves ``op`` under ``ctx`` (``None``: none applies); predicates below
        the chosen one are not asked."""
        return next((impl for impl in self.candidates(op) if impl.applies(ctx)), None)


class OpTable:
    """Resolved ops as plain attributes: ``ops.rms_norm(x, w, eps)`` calls the chosen kernel directly."""

    def __init__(self, chosen: dict[str, OpImpl]):
        self.chosen = dict(chosen)
        for name, impl in chosen.items():
            setattr(self, name, impl.fn)

    def provider(self, op: str) -> str:
        return self.chosen[op].provider

    def syncs_host(self, ops: Iterable[str]) -> list[str]:
        """Those of ``ops`` (in the order given) whose chosen implementation was registered with
        ``syncs_host=True``: a step that runs any of them cannot be captured in a graph."""
        return [op for op in ops if op in self.chosen and self.chosen[op].syncs_host]

    def __repr__(self) -> str:
        rows = ", ".join(f"{k}<-{v.provider}" for k, v in sorted(self.chosen.items()))
        return f"OpTable({rows})"


def resolve_ops(
    registry: OpRegistry,
    ctx: BuildContext,
    fallback: OpRegistry | None = None,
) -> OpTable:
    """Pick one implementation per catalogued op; missing ops are an error unless ``fallback`` fills them."""
    chosen: dict[str, OpImpl] = {}
    missing = []
    for op in CATALOGUE:
        impl = registry.select(op, ctx)
        if impl is None and fallback is not None:
            impl = fallback.select(op, ctx)
            if impl is not None:
                logger.warning("backend %s has no %r: using the cpu_ref reference (slow)", ctx.backend, op)
        if impl is None:
            missing.append(op)
        else:
            chosen[op] = impl
    if missing and ctx.batch_invariant:
        raise MissingOpError(
            f"backend {ctx.backend!r} provides no batch-invariant implementation for ops {missing} "
            "(batch_invariant=True needs one registered with batch_invariant=True for every op the "
            "catalogue does not mark batch-invariant)"
        )
    if missing:
        raise MissingOpError(
            f"backend {ctx.backend!r} provides no implementation for ops {missing}; install a kernel pack "
            "that does, or pass allow_reference_fallback=True to use the slow cpu_ref versions"
        )
    return OpTable(chosen)

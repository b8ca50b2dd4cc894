"""The fixed-shape mode of a collective that a decode graph can hold."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class FixedShapeCollective:
    """A collective that eagerly exchanges its sizes first (a host read) and, inside :meth:`graph_shapes`,
    runs at shapes every rank knows without asking: the decode graph's forward (captured, or replayed
    uncaptured), which every rank runs at the same padded token count in the same step. Subclasses read
    ``fixed_shapes`` to pick the mode."""

    fixed_shapes = False  # True inside graph_shapes()
    graph_safe = True  # the fixed-shape mode reads nothing back to the host

    @contextmanager
    def graph_shapes(self) -> Iterator[None]:
        before, self.fixed_shapes = self.fixed_shapes, True
        try:
            yield
        finally:
            self.fixed_shapes = before

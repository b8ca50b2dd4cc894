"""The logical -> physical expert map of expert parallel with redundant experts (EPLB).

``num_physical`` expert slots (logical experts + redundant replicas) are sharded contiguously over the
ranks: rank ``r`` holds slots ``[r * P / world, (r + 1) * P / world)``. ``phy2log[layer, slot]`` is the
logical expert a slot serves in each main MoE layer; the router's logical top-k ids become slots through
:meth:`ExpertMap.physical`, which spreads a logical expert's (token, k) pairs over its replicas round robin
in order of the pairs (deterministic; any replica gives the same output since replicas hold the same weights).
MTP layers keep the initial layout (they are not rebalanced). A drafter with experts of its own (DSpark)
has a map of its own, over its own dispatcher, whose layers are its MoE layers.

Graph safety: :meth:`ExpertMap.physical` reads no count back to the host, and its device tables are
allocated once per (layer, device) at the widest layout (every redundant slot one expert's), then rewritten
in place by :meth:`ExpertMap.set`, so that a decode graph captured before a rearrangement reads the new
layout when replayed after it.
"""

from __future__ import annotations

import torch


def initial_phy2log(num_logical: int, num_physical: int, world: int) -> torch.Tensor:
    """The layout before any load is known: rank ``r`` serves logical experts ``[r * E / world, (r + 1) *
    E / world)`` (its contiguous checkpoint slice), its extra slots replicas of those, cycled."""
    if num_physical % world:
        raise ValueError(f"{num_physical} physical experts cannot be split evenly over {world} ranks")
    if num_physical < num_logical:
        raise ValueError(f"{num_physical} physical experts cannot hold {num_logical} logical ones")
    per_rank = num_physical // world
    if num_logical % world:  # no even slice per rank: slot s serves s mod E
        return torch.arange(num_physical) % num_logical
    own = num_logical // world
    slots = [r * own + (j % own) for r in range(world) for j in range(per_rank)]
    return torch.tensor(slots, dtype=torch.long)


def log2phy_of(phy2log: torch.Tensor, num_logical: int, width: int | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``phy2log[layers, P]`` -> (``log2phy[layers, E, width]`` in ascending slot order, -1 padded (``width``
    None: the most replicas any expert has); ``logcnt[layers, E]``)."""
    layers, num_physical = phy2log.shape
    logcnt = torch.zeros((layers, num_logical), dtype=torch.long)
    logcnt.scatter_add_(1, phy2log, torch.ones_like(phy2log))
    if bool((logcnt == 0).any()):
        raise ValueError("every logical expert needs at least one physical slot")
    width = int(logcnt.max()) if width is None else width
    log2phy = torch.full((layers, num_logical, width), -1, dtype=torch.long)
    for layer in range(layers):
        seen = [0] * num_logical
        for slot, e in enumerate(phy2log[layer].tolist()):
            log2phy[layer, e, seen[e]] = slot
            seen[e] += 1
    return log2phy, logcnt


class ExpertMap:
    """Per main MoE layer, which logical expert each physical slot serves (``phy2log[layers, P]``), and
    the initial layout for any other layer (``layer=None``: MTP)."""

    def __init__(self, phy2log: torch.Tensor, num_logical: int, world: int, initial: torch.Tensor | None = None):
        self.num_logical, self.world = num_logical, world
        self.num_physical = phy2log.shape[1]
        if self.num_physical % world:
            raise ValueError(f"{self.num_physical} physical experts cannot be split evenly over {world} ranks")
        self.slots_per_rank = self.num_physical // world
        self.width = self.num_physical - num_logical + 1  # the most replicas one expert can have
        self.initial = phy2log[0].clone() if initial is None else initial.clone()
        init_l2p, init_cnt = log2phy_of(self.initial.unsqueeze(0), num_logical, self.width)
        self._initial_tables = (init_l2p[0], init_cnt[0])
        self._device_tables: dict[tuple[int | None, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
        self.set(phy2log)

    @classmethod
    def create(cls, num_layers: int, num_logical: int, num_physical: int, world: int) -> ExpertMap:
        first = initial_phy2log(num_logical, num_physical, world)
        return cls(first.expand(num_layers, -1).clone(), num_logical, world, first)

    def set(self, phy2log: torch.Tensor) -> None:
        """Adopt a new layout (the weights must be moved to match: :mod:`~deepinfer_core.parallel.eplb_transfer`)."""
        self.phy2log = phy2log.to("cpu", torch.long).clone()
        self.log2phy, self.logcnt = log2phy_of(self.phy2log, self.num_logical, self.width)
        for (layer, _), (l2p, cnt) in self._device_tables.items():  # in place: graphs hold these tensors
            if layer is not None:
                l2p.copy_(self.log2phy[layer])
                cnt.copy_(self.logcnt[layer])

    def row(self, layer: int | None) -> torch.Tensor:
        return self.initial if layer is None else self.phy2log[layer]

    def local_slots(self, rank: int) -> range:
        return range(rank * self.slots_per_rank, (rank + 1) * self.slots_per_rank)

    def local_logical(self, rank: int, layer: int | None = None) -> list[int]:
        """The logical expert of each of ``rank``'s slots, in slot order."""
        slots = self.local_slots(rank)
        return self.row(layer)[slots.start:slots.stop].tolist()

    def _tables(self, layer: int | None, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (layer, device)
        if key not in self._device_tables:
            l2p, cnt = self._initial_tables if layer is None else (self.log2phy[layer], self.logcnt[layer])
            self._device_tables[key] = (l2p.to(device), cnt.to(device))
        return self._device_tables[key]

    def physical(self, layer: int | None, logical_ids: torch.Tensor) -> torch.Tensor:
        """The slot each (token, k) pair goes to, ids flattened in pair order: the ``i``-th pair of a
        logical expert goes to its replica ``i mod count``."""
        flat = logical_ids.reshape(-1)
        l2p, cnt = self._tables(layer, flat.device)
        order = torch.argsort(flat, stable=True)
        per_expert = torch.zeros(self.num_logical, dtype=flat.dtype, device=flat.device)
        per_expert.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would read its size back
        starts = torch.cumsum(per_expert, 0) - per_expert
        occurrence = torch.empty_like(flat)
        occurrence[order] = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
        return l2p[flat, occurrence % cnt[flat]]

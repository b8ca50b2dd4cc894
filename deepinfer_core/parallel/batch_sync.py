"""Each step's graph, agreed by the expert-parallel ranks before it runs (vLLM's
``coordinate_batch_across_dp``).

Under expert parallel every rank's forward meets its peers' in each MoE layer's dispatch and combine. A
decode graph holds those collectives at fixed shapes (:mod:`.ep_padded`) that follow from its token count,
so in a step either every rank replays a graph of the same batch size and query length, or every rank runs
eagerly (the collectives then exchange their sizes first). Before each forward, each rank says what it
wants, one small all-reduce (max) on the host group combines it, and all take the same decision:

* a graph when every rank's step fits one (decodes of one query length; a rank with nothing scheduled,
  a placeholder step, fits any): the size bucket of the largest rank's batch, each rank its own
  context bucket (the context changes no collective's shape);
* eagerly otherwise (a prefill chunk anywhere, unequal query lengths).

Every rank calls :meth:`BatchCoordinator.agree` exactly once per forward of the target model, real or
placeholder, in the same order; that is the invariant that keeps the collectives lined up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

_NONE = 1 << 40  # "no query length": the placeholder's entry in the min of query lengths


@dataclass(frozen=True)
class StepShape:
    """What one rank wants for its next forward."""

    num_seqs: int  # sequences of the step; 0: a placeholder step (nothing scheduled on this rank)
    query_len: int = 1  # new tokens per sequence
    graphable: bool = True  # its batch fits a graph (a placeholder's always does)


@dataclass(frozen=True)
class AgreedShape:
    """A step every rank replays a graph for: the largest rank's ``num_seqs`` and the common query length."""

    num_seqs: int
    query_len: int


def combine_shapes(shapes: list[StepShape]) -> AgreedShape | None:
    """The decision all ranks take from every rank's wish (the reference for :meth:`BatchCoordinator.agree`)."""
    busy = [s for s in shapes if s.num_seqs]
    if not busy or not all(s.graphable for s in busy) or len({s.query_len for s in busy}) != 1:
        return None
    return AgreedShape(max(s.num_seqs for s in busy), busy[0].query_len)


class BatchCoordinator:
    """One rank's side of the agreement, over a host (gloo) group of the expert-parallel ranks."""

    def __init__(self, group: object | None, world_size: int):
        self.group, self.world_size = group, world_size
        self.num_agreements = 0  # forwards agreed on so far (the same on every rank)

    def agree(self, shape: StepShape) -> AgreedShape | None:
        """The step every rank runs (None: eagerly), from this rank's ``shape`` and its peers'. A
        collective: every rank calls it once per forward."""
        busy = shape.num_seqs > 0
        wish = torch.tensor([shape.num_seqs, int(busy and not shape.graphable),
                             shape.query_len if busy else 0, -shape.query_len if busy else -_NONE],
                            dtype=torch.long)
        if self.world_size > 1:
            dist.all_reduce(wish, op=dist.ReduceOp.MAX, group=self.group)
        self.num_agreements += 1
        num_seqs, eager, longest, shortest = wish.tolist()
        if not num_seqs or eager or longest != -shortest:
            return None
        return AgreedShape(num_seqs, longest)


def coordinator_for(model: object) -> BatchCoordinator | None:
    """The agreement a graph runner of ``model`` needs: under expert parallel (``model.ep``) one over the
    ranks' host group; None otherwise."""
    ep = getattr(model, "ep", None)
    if ep is None:
        return None
    from deepinfer_core.parallel.process_group import host_group

    return BatchCoordinator(host_group(), ep.world)

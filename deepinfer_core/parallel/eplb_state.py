"""EPLB in the engine: every expert-parallel rank keeps the per-step expert load of the last
``window_size`` steps; every ``step_interval`` steps (all ranks step in lock-step) the window is summed
over the ranks (all-reduce), DeepSeek's policy computes the new slot layout of every main MoE layer, and
the expert weights are moved between ranks before the next step. The same on every rank: the policy is
deterministic and sees the same gathered load.

A drafter whose MoE has experts of its own (DeepSeek-V4.1's DSpark stages: their own dispatcher, slot map
and recorder, see :mod:`.ep`) is a second group: its load is windowed and gathered the same way, and every
rearrangement rebalances its layers too, by its own load.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.distributed as dist

from deepinfer_core.config import EPLBConfig
from deepinfer_core.model.records import Experts
from deepinfer_core.parallel.ep import drafter_stacks
from deepinfer_core.parallel.eplb import EplbRecorder
from deepinfer_core.parallel.eplb_policy import gpu_loads, rebalance_experts
from deepinfer_core.parallel.eplb_transfer import move_experts
from deepinfer_core.parallel.expert_map import ExpertMap

logger = logging.getLogger(__name__)


def eplb_config_of(value: dict | EPLBConfig | None, enable_eplb: bool, expert_parallel_size: int) -> EPLBConfig:
    """The engine argument ``eplb_config`` (a dict of EPLBConfig's fields, or one) checked."""
    if value is None:
        config = EPLBConfig()
    elif isinstance(value, EPLBConfig):
        config = value
    elif isinstance(value, dict):
        unknown = sorted(set(value) - {f.name for f in fields(EPLBConfig)})
        if unknown:
            raise ValueError(f"unknown eplb_config keys {unknown}; known: {[f.name for f in fields(EPLBConfig)]}")
        config = EPLBConfig(**value)
    else:
        raise ValueError(f"eplb_config must be a dict or an EPLBConfig, got {type(value).__name__}")
    for name in ("window_size", "step_interval"):
        if not isinstance(getattr(config, name), int) or getattr(config, name) < 1:
            raise ValueError(f"eplb_config.{name} must be an integer >= 1, got {getattr(config, name)!r}")
    redundant = config.num_redundant_experts
    if not isinstance(redundant, int) or redundant < 0:
        raise ValueError(f"eplb_config.num_redundant_experts must be an integer >= 0, got {redundant!r}")
    if enable_eplb and expert_parallel_size <= 1:
        raise ValueError("enable_eplb needs expert parallel (enable_expert_parallel with data_parallel_size > 1)")
    if redundant and not enable_eplb:
        raise ValueError("num_redundant_experts needs enable_eplb")
    return config


def balancedness(load: torch.Tensor, expert_map: ExpertMap) -> dict[str, float]:
    """Mean over layers of the max and mean rank load, and their ratio (1.0: perfectly even), when a
    logical expert's tokens split evenly over its replicas."""
    per_rank = gpu_loads(load.double(), expert_map.phy2log, expert_map.logcnt, expert_map.world)
    top, mean = per_rank.max(-1).values, per_rank.mean(-1)
    ratio = torch.where(top > 0, mean / top.clamp_min(1e-12), torch.ones_like(top))
    return {"max": float(top.mean()), "mean": float(mean.mean()), "balancedness": float(ratio.mean())}


@dataclass
class ExpertGroup:
    """MoE layers that share one dispatcher and slot map: ``stacks[layer]`` holds this rank's slots of
    the map's ``layer``, ``window[step % window_size, layer, expert]`` the load of the last steps."""

    name: str
    dispatcher: Any
    recorder: EplbRecorder
    stacks: list[Experts]
    window: torch.Tensor

    @classmethod
    def of(cls, name: str, dispatcher: Any, recorder: EplbRecorder, stacks: list[Experts], window_size: int
           ) -> ExpertGroup:
        layers, experts = recorder.step_counts.shape
        if len(stacks) != layers or dispatcher.expert_map.phy2log.shape[0] != layers:
            raise ValueError(f"the {name} expert group's recorder, slot map and stacks disagree on its layers")
        window = torch.zeros((window_size, layers, experts), dtype=torch.long, device=recorder.step_counts.device)
        return cls(name, dispatcher, recorder, stacks, window)

    @property
    def expert_map(self) -> ExpertMap:
        return self.dispatcher.expert_map


class EplbState:
    """A rank's EPLB bookkeeping over its model (whose routed stacks hold its physical slots): the target's
    expert group, and the drafter's where it has one of its own (``model.drafter.ep`` with a slot map and
    ``model.drafter.expert_load``)."""

    def __init__(self, model: Any, dispatcher: Any, config: EPLBConfig, num_nodes: int = 1, num_groups: int = 1):
        self.model, self.dispatcher, self.config = model, dispatcher, config
        self.num_nodes, self.num_groups = num_nodes, num_groups
        target = ExpertGroup.of("target", dispatcher, model.expert_load,
                                [block.moe.experts for block in model.weights.layers], config.window_size)
        self.groups = [target]
        drafter = getattr(model, "drafter", None)
        if getattr(getattr(drafter, "ep", None), "expert_map", None) is not None and drafter.expert_load is not None:
            self.groups.append(ExpertGroup.of("drafter", drafter.ep, drafter.expert_load, drafter_stacks(model),
                                              config.window_size))
        self.expert_map: ExpertMap = target.expert_map
        self.recorder: EplbRecorder = target.recorder
        self.window = target.window
        self.steps = 0
        self.history: list[dict[str, Any]] = []  # one entry per rearrangement

    @property
    def group(self) -> object | None:
        return getattr(self.dispatcher.comm, "group", None)

    def step(self) -> dict[str, Any] | None:
        """After every step (real or placeholder, on every rank): the step's load into the window, and a
        rearrangement every ``step_interval`` steps (its statistics, else None)."""
        for g in self.groups:
            counts = g.recorder.step_counts
            g.window[self.steps % self.config.window_size].copy_(counts)
            counts.zero_()
        self.steps += 1
        if self.steps % self.config.step_interval:
            return None
        return self.rearrange()

    def gathered_load(self, group: ExpertGroup | None = None) -> torch.Tensor:
        """``group``'s window (None: the target's) summed over the steps and the ranks, on the host."""
        load = (group or self.groups[0]).window.sum(0)
        if self.dispatcher.world > 1:
            dist.all_reduce(load, group=self.group)
        return load.cpu()

    def rearrange(self, load: torch.Tensor | dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
        """Rebalance every group and move the weights. ``load``: the target's ``[layers, logical]``, or a
        group name -> its load; a group given none uses its window, summed over the ranks. A collective:
        every rank calls it at the same point, with the same ``load``. The target's statistics, with the
        drafter's under ``"drafter"``."""
        loads = load if isinstance(load, dict) else {} if load is None else {"target": load}
        unknown = sorted(set(loads) - {g.name for g in self.groups})
        if unknown:
            raise ValueError(f"no expert group {unknown}; this model's: {[g.name for g in self.groups]}")
        stats = {"step": self.steps}
        for g in self.groups:
            given = loads.get(g.name)
            moved = self._rearrange(g, self.gathered_load(g) if given is None else given.to("cpu", torch.long))
            if g is self.groups[0]:
                stats.update(moved)
            else:
                stats[g.name] = moved
        self.history.append(stats)
        if self.config.log_balancedness and self.dispatcher.rank == 0:
            for name, s in [("target", stats)] + [(g.name, stats[g.name]) for g in self.groups[1:]]:
                logger.info("EPLB at step %d (%s experts): balancedness %.3f -> %.3f (max/mean rank load "
                            "%.1f/%.1f -> %.1f/%.1f), %d expert slots moved", self.steps, name,
                            s["before"]["balancedness"], s["after"]["balancedness"], s["before"]["max"],
                            s["before"]["mean"], s["after"]["max"], s["after"]["mean"], s["moved_slots"])
        return stats

    def _rearrange(self, g: ExpertGroup, load: torch.Tensor) -> dict[str, Any]:
        emap, world = g.expert_map, g.dispatcher.world
        before = balancedness(load, emap)
        phy2log, _, _ = rebalance_experts(load, emap.num_physical, self.num_groups, self.num_nodes, world)
        old = emap.phy2log.clone()
        moved = 0
        for layer, stack in enumerate(g.stacks):
            moved += move_experts(stack, old[layer].tolist(), phy2log[layer].tolist(), g.dispatcher.rank, world,
                                  self.group)
        emap.set(phy2log)
        return {"moved_slots": moved, "before": before, "after": balancedness(load, emap), "tokens": int(load.sum())}

    def summary(self) -> dict[str, Any]:
        out = {"steps": self.steps, "config": asdict(self.config), "phy2log": self.expert_map.phy2log.tolist(),
               "history": list(self.history)}
        for g in self.groups[1:]:
            out[f"{g.name}_phy2log"] = g.expert_map.phy2log.tolist()
        return out

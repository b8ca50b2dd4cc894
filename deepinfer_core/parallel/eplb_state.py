"""EPLB in the engine: every expert-parallel rank keeps the per-step expert load of the last
``window_size`` steps; every ``step_interval`` steps (all ranks step in lock-step) the window is summed
over the ranks (all-reduce), DeepSeek's policy computes the new slot layout of every main MoE layer, and
the expert weights are moved between ranks before the next step. The same on every rank: the policy is
deterministic and sees the same gathered load.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, fields
from typing import Any

import torch
import torch.distributed as dist

from deepinfer_core.config import EPLBConfig
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


class EplbState:
    """A rank's EPLB bookkeeping over its model (whose routed stacks hold its physical slots)."""

    def __init__(self, model: Any, dispatcher: Any, config: EPLBConfig, num_nodes: int = 1, num_groups: int = 1):
        self.model, self.dispatcher, self.config = model, dispatcher, config
        self.expert_map: ExpertMap = dispatcher.expert_map
        self.recorder: EplbRecorder = model.expert_load
        self.num_nodes, self.num_groups = num_nodes, num_groups
        layers, experts = self.recorder.step_counts.shape
        self.window = torch.zeros((config.window_size, layers, experts), dtype=torch.long,
                                  device=self.recorder.step_counts.device)
        self.steps = 0
        self.history: list[dict[str, Any]] = []  # one entry per rearrangement

    @property
    def group(self) -> object | None:
        return getattr(self.dispatcher.comm, "group", None)

    def step(self) -> dict[str, Any] | None:
        """After every step (real or placeholder, on every rank): the step's load into the window, and a
        rearrangement every ``step_interval`` steps (its statistics, else None)."""
        counts = self.recorder.step_counts
        self.window[self.steps % self.config.window_size].copy_(counts)
        counts.zero_()
        self.steps += 1
        if self.steps % self.config.step_interval:
            return None
        return self.rearrange()

    def gathered_load(self) -> torch.Tensor:
        load = self.window.sum(0)
        if self.dispatcher.world > 1:
            dist.all_reduce(load, group=self.group)
        return load.cpu()

    def rearrange(self, load: torch.Tensor | None = None) -> dict[str, Any]:
        """Rebalance for ``load[layers, logical]`` (None: the window, summed over the ranks) and move the
        weights. A collective: every rank calls it at the same point, with the same ``load``."""
        load = self.gathered_load() if load is None else load.to("cpu", torch.long)
        emap, world = self.expert_map, self.dispatcher.world
        before = balancedness(load, emap)
        phy2log, _, _ = rebalance_experts(load, emap.num_physical, self.num_groups, self.num_nodes, world)
        old = emap.phy2log.clone()
        moved = 0
        for layer, block in enumerate(self.model.weights.layers):
            moved += move_experts(block.moe.experts, old[layer].tolist(), phy2log[layer].tolist(),
                                  self.dispatcher.rank, world, self.group)
        emap.set(phy2log)
        stats = {"step": self.steps, "moved_slots": moved, "before": before, "after": balancedness(load, emap),
                 "tokens": int(load.sum())}
        self.history.append(stats)
        if self.config.log_balancedness and self.dispatcher.rank == 0:
            logger.info("EPLB at step %d: balancedness %.3f -> %.3f (max/mean rank load %.1f/%.1f -> %.1f/%.1f), "
                        "%d expert slots moved", self.steps, before["balancedness"], stats["after"]["balancedness"],
                        before["max"], before["mean"], stats["after"]["max"], stats["after"]["mean"], moved)
        return stats

    def summary(self) -> dict[str, Any]:
        return {"steps": self.steps, "config": asdict(self.config), "phy2log": self.expert_map.phy2log.tolist(),
                "history": list(self.history)}

"""Cluster topology: which devices exist, how they connect, and how ranks are placed on them."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field


@dataclass
class DeviceInfo:
    index: int
    kind: str
    numa_node: int = -1
    peers: list[int] = field(default_factory=list)


@dataclass
class ClusterTopology:
    hosts: list[str]
    devices: list[DeviceInfo]

    @property
    def num_devices(self) -> int:
        return len(self.devices)


@dataclass
class ParallelPlan:
    """Rank -> device placement for data-parallel attention and expert-parallel MoE."""

    data_parallel_size: int
    expert_parallel_size: int
    device_of_rank: dict[int, int]


def single_host_cpu_topology() -> ClusterTopology:
    cores = os.cpu_count() or 1
    return ClusterTopology(hosts=[socket.gethostname()], devices=[DeviceInfo(0, f"cpu ({cores} cores)")])


def plan_single_host(
    topology: ClusterTopology, data_parallel_size: int = 1, expert_parallel_size: int = 1
) -> ParallelPlan:
    world = max(data_parallel_size, expert_parallel_size)
    n = max(topology.num_devices, 1)
    return ParallelPlan(data_parallel_size, expert_parallel_size, {r: r % n for r in range(world)})

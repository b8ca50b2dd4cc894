"""The CUDA devices of this host: name and capability, NVLink peers and the NUMA node of each GPU.

NVLink peers come from ``nvidia-smi topo -m`` when it is available (an ``NV<n>`` entry between two
GPUs); without it, from ``torch.cuda.can_device_access_peer`` (which PCIe peer-to-peer also passes).
The NUMA node is read from ``/sys/bus/pci/devices/<bus id>/numa_node`` (-1 when unknown). Devices are
numbered as torch numbers them (after ``CUDA_VISIBLE_DEVICES``); nvidia-smi's numbering is mapped
through PCI bus ids.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
from pathlib import Path

from deepinfer_core.topology import ClusterTopology, DeviceInfo

SYSFS_PCI = Path("/sys/bus/pci/devices")


def normalize_bus_id(bus_id: str) -> str:
    """``00000000:1B:00.0`` / ``0000:1b:00.0`` -> ``0000:1b:00.0`` (the sysfs spelling)."""
    bus_id = bus_id.strip().lower()
    domain, _, rest = bus_id.rpartition(":")
    domain, _, bus = domain.rpartition(":") if domain.count(":") else ("", "", domain)
    domain = (domain or "0")[-4:].rjust(4, "0")
    return f"{domain}:{bus.rjust(2, '0')}:{rest}"


def numa_node(bus_id: str | None, sysfs: Path = SYSFS_PCI) -> int:
    if not bus_id:
        return -1
    try:
        return int((sysfs / normalize_bus_id(bus_id) / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return -1


def parse_topo_matrix(text: str) -> dict[int, list[int]]:
    """NVLink peers per GPU from ``nvidia-smi topo -m``: GPU i -> [j, ...] with an ``NV<n>`` entry."""
    text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", text)  # nvidia-smi underlines the header (ANSI codes)
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    start = next((i for i, ln in enumerate(lines) if re.search(r"\bGPU\d+\b", ln)), None)
    if start is None:  # the first line naming GPUs is the column header; the rows follow it
        return {}
    columns = [int(c[3:]) if re.fullmatch(r"GPU\d+", c) else None for c in lines[start].split()]
    peers: dict[int, list[int]] = {}
    for ln in lines[start + 1 :]:
        cells = ln.split()
        if not cells or not re.fullmatch(r"GPU\d+", cells[0]):
            continue
        gpu = int(cells[0][3:])
        peers[gpu] = [col for col, cell in zip(columns, cells[1:]) if col is not None and col != gpu
                      and cell.upper().startswith("NV")]
    return peers


def _nvidia_smi(*args: str) -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _smi_bus_ids() -> dict[str, int]:
    out = _nvidia_smi("--query-gpu=index,pci.bus_id", "--format=csv,noheader")
    ids = {}
    for line in (out or "").splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            ids[normalize_bus_id(parts[1])] = int(parts[0])
    return ids


def torch_bus_id(props) -> str | None:
    """The PCI bus id torch reports for a device (``None`` on torch builds without it)."""
    bus, dev, dom = (getattr(props, a, None) for a in ("pci_bus_id", "pci_device_id", "pci_domain_id"))
    if bus is None or dev is None:
        return None
    return f"{int(dom or 0):04x}:{int(bus):02x}:{int(dev):02x}.0"


def discover(sysfs: Path = SYSFS_PCI) -> ClusterTopology:
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    bus_ids = [torch_bus_id(torch.cuda.get_device_properties(i)) for i in range(count)]
    smi_index = _smi_bus_ids()
    topo = _nvidia_smi("topo", "-m")
    nvlink = parse_topo_matrix(topo) if topo else {}
    devices = []
    for i in range(count):
        props = torch.cuda.get_device_properties(i)
        kind = f"cuda ({props.name}, sm{props.major}{props.minor}, {props.total_memory // 2**30} GiB)"
        mine = smi_index.get(bus_ids[i]) if bus_ids[i] else None
        if nvlink and mine is not None and all(b in smi_index for b in bus_ids if b):
            to_torch = {smi_index[b]: j for j, b in enumerate(bus_ids) if b}
            peers = sorted(to_torch[p] for p in nvlink.get(mine, []) if p in to_torch)
        else:
            peers = [j for j in range(count) if j != i and torch.cuda.can_device_access_peer(i, j)]
        devices.append(DeviceInfo(i, kind, numa_node(bus_ids[i], sysfs), peers))
    return ClusterTopology(hosts=[socket.gethostname()], devices=devices)

"""The NPUs of this host: name and memory from ``torch.npu``, interconnect peers from ``npu-smi info -t
topo`` (an ``HCCS`` or ``SIO`` entry between two NPUs), NUMA node unknown (-1).

The parser is tested on a matrix in the layout npu-smi prints; it was never run against an Ascend 950's
npu-smi, whose legend may name further link kinds.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
from typing import Any

from deepinfer_core.topology import ClusterTopology, DeviceInfo

PEER_LINKS = ("HCCS", "SIO")


def parse_topo_matrix(text: str) -> dict[int, list[int]]:
    """Peers per NPU from ``npu-smi info -t topo``: NPU i -> [j, ...] with an HCCS/SIO entry."""
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    start = next((i for i, ln in enumerate(lines) if re.search(r"\bNPU\d+\b", ln)), None)
    if start is None:
        return {}
    columns = [int(c[3:]) if re.fullmatch(r"NPU\d+", c) else None for c in lines[start].split()]
    peers: dict[int, list[int]] = {}
    for ln in lines[start + 1 :]:
        cells = ln.split()
        if not cells or not re.fullmatch(r"NPU\d+", cells[0]):
            continue
        me = int(cells[0][3:])
        peers[me] = [col for col, cell in zip(columns, cells[1:]) if col is not None and col != me
                     and cell.upper().startswith(PEER_LINKS)]
    return peers


def _npu_smi_topo() -> str | None:
    exe = shutil.which("npu-smi")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, "info", "-t", "topo"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def discover(npu: Any = None) -> ClusterTopology:
    """The visible NPUs (``torch.npu``, or ``npu`` given); none when torch_npu is unavailable."""
    devices = []
    count = npu.device_count() if npu is not None and npu.is_available() else 0
    topo = _npu_smi_topo() if count else None
    links = parse_topo_matrix(topo) if topo else {}
    for i in range(count):
        props = npu.get_device_properties(i)
        gib = int(getattr(props, "total_memory", 0)) // 2**30
        kind = f"npu ({npu.get_device_name(i)}, {gib} GiB)"
        devices.append(DeviceInfo(i, kind, -1, sorted(p for p in links.get(i, []) if p < count)))
    return ClusterTopology(hosts=[socket.gethostname()], devices=devices)

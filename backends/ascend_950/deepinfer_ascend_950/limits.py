"""On-chip buffer capacities of one Ascend 950 (``dav-3510``) AI core, in bytes: the one place they are
stated.

Source: the target resource limits TileLang's Ascend AutoSchedule pass plans against (TileLang 0.1.15,
``src/.../auto_schedule.cc``): Unified Buffer 248 KiB physical, of which SIMT vector functions
(``T.SimtVF``, ``asc_vf_call``) reserve 32 KiB for thread context; L1 512 KiB; L0A 64 KiB; L0B 64 KiB;
L0C 256 KiB. They are the figures the kernel compiler itself schedules with, not a measurement on a
chip (none was available).
"""

from __future__ import annotations

KiB = 1024

UB_PHYSICAL = 248 * KiB
SIMT_VF_RESERVED = 32 * KiB
L1 = 512 * KiB
L0A = 64 * KiB
L0B = 64 * KiB
L0C = 256 * KiB

#: TileLang storage scope -> capacity (the Unified Buffer's without a SIMT region)
SCOPE_CAPACITY = {
    "shared": UB_PHYSICAL,
    "shared.dyn": UB_PHYSICAL,
    "shared.l1": L1,
    "shared.l1.dyn": L1,
    "shared.l0a": L0A,
    "shared.l0b": L0B,
    "shared.l0c": L0C,
    "shared.l0c.dyn": L0C,
}

#: scope -> the buffer it lives in
BUFFER_OF_SCOPE = {
    "shared": "UB", "shared.dyn": "UB",
    "shared.l1": "L1", "shared.l1.dyn": "L1",
    "shared.l0a": "L0A", "shared.l0b": "L0B",
    "shared.l0c": "L0C", "shared.l0c.dyn": "L0C",
}


def capacity(buffer: str, simt_vf: bool = False) -> int:
    """Bytes of ``buffer`` ("UB", "L1", "L0A", "L0B", "L0C") a kernel may use; the UB loses the SIMT
    thread context when the kernel has a SIMT region."""
    if buffer == "UB":
        return UB_PHYSICAL - (SIMT_VF_RESERVED if simt_vf else 0)
    return {"L1": L1, "L0A": L0A, "L0B": L0B, "L0C": L0C}[buffer]

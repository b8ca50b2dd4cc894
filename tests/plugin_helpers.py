"""Fake installed distributions for the plugin tests, without installing anything.

A fake distribution is a ``<name>-<version>.dist-info`` directory (``METADATA`` + ``entry_points.txt``)
plus module files in a temporary directory put on ``sys.path``: ``importlib.metadata`` discovers it
exactly as it discovers a pip-installed one.
"""

from __future__ import annotations

import importlib
import sys
import textwrap
from pathlib import Path

from deepinfer_core import plugins

REPO = Path(__file__).resolve().parents[1]

# distributions of this repository the tests rely on: dist name -> (source dir, entry points)
REPO_DISTS = {
    "deepinfer-cpu-ref": (
        "backends/cpu_ref",
        {plugins.BACKEND_GROUP: {"cpu_ref": "deepinfer_cpu_ref.plugin"}},
    ),
    "deepinfer-nvidia-sm100": (
        "backends/nvidia_sm100",
        {plugins.BACKEND_GROUP: {"nvidia_sm100": "deepinfer_nvidia_sm100.plugin"}},
    ),
    "deepinfer-ascend-950": (
        "backends/ascend_950",
        {plugins.BACKEND_GROUP: {"ascend_950": "deepinfer_ascend_950.plugin"}},
    ),
    "deepinfer-example-kernels": (
        "plugins/deepinfer-example-kernels",
        {plugins.KERNEL_GROUP: {"example_fused_rms_norm": "deepinfer_example_kernels.plugin"}},
    ),
}


class FakeDists:
    """Writes fake distributions into ``site`` (which the caller puts on ``sys.path``)."""

    def __init__(self, site: Path):
        self.site = site
        self.modules: list[str] = []

    def add(
        self,
        dist: str,
        entry_points: dict[str, dict[str, str]],
        modules: dict[str, str] | None = None,
        version: str = "1.0",
    ) -> None:
        for name, source in (modules or {}).items():
            (self.site / f"{name}.py").write_text(textwrap.dedent(source))
            self.modules.append(name)
        info = self.site / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        lines = []
        for group, eps in entry_points.items():
            lines.append(f"[{group}]")
            lines.extend(f"{name} = {value}" for name, value in eps.items())
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
        importlib.invalidate_caches()

    def ensure_repo_dists(self, monkeypatch) -> None:
        """Make this repository's backends and example pack visible, faking those not pip-installed."""
        installed = {**plugins.installed_backends(), **plugins.installed_kernel_packs()}
        for dist, (src, eps) in REPO_DISTS.items():
            names = [name for group in eps.values() for name in group]
            if all(name in installed for name in names):
                continue
            monkeypatch.syspath_prepend(str(REPO / src))
            self.add(dist, eps, version="0.1.0")

    def cleanup(self) -> None:
        for name in self.modules:
            sys.modules.pop(name, None)


GOOD_BACKEND = """
from deepinfer_core.hookspecs import BackendInfo, hookimpl
from deepinfer_cpu_ref.ops import ALL_OPS

NAME = {name!r}
OPS = {ops!r}

@hookimpl
def deepinfer_backend_info():
    return BackendInfo(name=NAME, device_type="cpu", version="9.9",
                       is_available=lambda: ({available!r}, {reason!r}))

@hookimpl
def deepinfer_register_ops(registry, backend):
    if backend.name != NAME:
        return
    for op in (OPS if OPS is not None else ALL_OPS):
        registry.register(op, ALL_OPS[op], priority=0)
"""


def backend_source(name: str, ops: list[str] | None = None, available: bool = True, reason: str = "") -> str:
    """Source of a backend module named ``name`` registering cpu_ref's functions for ``ops`` (None: all)."""
    return GOOD_BACKEND.format(name=name, ops=ops, available=available, reason=reason)


def kernel_pack_source(body: str) -> str:
    """Source of a kernel pack whose ``deepinfer_register_ops(registry, backend)`` runs ``body``."""
    return (
        "from deepinfer_core.hookspecs import hookimpl\n"
        "from deepinfer_cpu_ref.ops import ALL_OPS\n\n"
        "@hookimpl\n"
        "def deepinfer_register_ops(registry, backend):\n" + textwrap.indent(textwrap.dedent(body), "    ")
    )

"""Plugin discovery and loading: backends by name, kernel packs by allowlist, ops resolved once.

Discovery reads entry-point metadata only. A backend module is imported when it is asked for by name
(or listed by ``deepinfer backends``); kernel packs are imported when ``DEEPINFER_PLUGINS`` allows them
(unset = all installed packs, empty string = none).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, PackageNotFoundError, entry_points, version
from typing import Any

import pluggy

from deepinfer_core import hookspecs
from deepinfer_core.hookspecs import BackendInfo
from deepinfer_core.ops.registry import BuildContext, OpRegistry, OpTable, resolve_ops

logger = logging.getLogger(__name__)

BACKEND_GROUP = "deepinfer.backends"
KERNEL_GROUP = "deepinfer.kernels"
ALLOWLIST_ENV = "DEEPINFER_PLUGINS"
REFERENCE_BACKEND = "cpu_ref"


class PluginError(RuntimeError):
    """A plugin could not be found, imported, validated or registered."""


class BackendUnavailableError(PluginError):
    """The backend is installed but cannot run here (no device, missing library)."""


@dataclass
class LoadedBackend:
    info: BackendInfo
    pm: pluggy.PluginManager
    entry_point: EntryPoint
    kernel_packs: list[str] = field(default_factory=list)

    @property
    def hook(self) -> Any:
        return self.pm.hook


def _describe(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    where = f"{dist.name} {dist.version}" if dist is not None else "unknown distribution"
    return f"entry point {ep.name!r} ({ep.value}) of {where}"


#: group -> (the import path's stamp when read, its entry points)
_ENTRY_POINTS: dict[str, tuple[tuple, tuple[EntryPoint, ...]]] = {}


def _path_stamp() -> tuple:
    """The import path with each folder's modification time and entry count: installing or removing a
    distribution adds or removes a ``*.dist-info`` entry in a folder of the path (the count changes even
    within one tick of the file system's clock)."""
    stamp = []
    for entry in sys.path:
        try:
            stamp.append((entry, os.stat(entry or ".").st_mtime_ns, len(os.listdir(entry or "."))))
        except OSError:  # a missing folder, or a zip archive
            stamp.append((entry, None, None))
    return tuple(stamp)


def _entry_points(group: str) -> tuple[EntryPoint, ...]:
    """``importlib.metadata.entry_points(group=group)``, read again only when the import path changed:
    scanning every installed distribution's metadata costs about 10 ms, and an engine asks several times."""
    stamp = _path_stamp()
    held = _ENTRY_POINTS.get(group)
    if held is None or held[0] != stamp:
        held = _ENTRY_POINTS[group] = (stamp, tuple(entry_points(group=group)))
    return held[1]


def installed_backends() -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in _entry_points(BACKEND_GROUP)}


def installed_kernel_packs() -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in _entry_points(KERNEL_GROUP)}


def allowed_kernel_packs() -> dict[str, EntryPoint]:
    packs = installed_kernel_packs()
    allow = os.environ.get(ALLOWLIST_ENV)
    if allow is None:
        return packs
    names = {n.strip() for n in allow.split(",") if n.strip()}
    return {name: ep for name, ep in packs.items() if name in names}


def _new_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    return pm


def _import_and_register(pm: pluggy.PluginManager, ep: EntryPoint) -> Any:
    try:
        module = ep.load()
    except Exception as exc:  # any import failure is reported with its origin
        raise PluginError(f"cannot import {_describe(ep)}: {type(exc).__name__}: {exc}") from exc
    try:
        pm.register(module, name=f"{ep.group}:{ep.name}")
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"invalid hook implementation in {_describe(ep)}: {exc}") from exc
    except ValueError as exc:  # pluggy: the same module object is already registered (under another name)
        raise PluginError(f"cannot register {_describe(ep)}: {exc}") from exc
    return module


_LOADED: dict[tuple[str, tuple[str, ...]], LoadedBackend] = {}


def load_backend(name: str, require_available: bool = True) -> LoadedBackend:
    """Import the backend ``name`` and the allowed kernel packs; idempotent within a process."""
    backends = installed_backends()
    if name not in backends:
        known = ", ".join(sorted(backends)) or "none"
        raise PluginError(
            f"unknown backend {name!r}; installed backends: {known} "
            f"(entry-point group {BACKEND_GROUP!r}; e.g. pip install deepinfer[nvidia])"
        )
    packs = allowed_kernel_packs()
    key = (name, tuple(sorted(packs)))
    if key not in _LOADED:
        ep = backends[name]
        pm = _new_manager()
        _import_and_register(pm, ep)
        try:
            info = pm.hook.deepinfer_backend_info()
        except Exception as exc:
            raise PluginError(
                f"deepinfer_backend_info of {_describe(ep)} raised {type(exc).__name__}: {exc}"
            ) from exc
        if info is None:
            raise PluginError(f"{_describe(ep)} implements no deepinfer_backend_info hook")
        for pack_ep in packs.values():
            _import_and_register(pm, pack_ep)
        _LOADED[key] = LoadedBackend(info, pm, ep, sorted(packs))
    loaded = _LOADED[key]
    if require_available:
        ok, reason = loaded.info.is_available()
        if not ok:
            raise BackendUnavailableError(
                f"backend {name!r} ({_describe(loaded.entry_point)}) is not available here: {reason}"
            )
    return loaded


def collect_registry(loaded: LoadedBackend) -> OpRegistry:
    """Ask every registered plugin for its ops, remembering who registered what."""
    registry = OpRegistry()
    kwargs = {"registry": registry, "backend": loaded.info}
    # call the validated hook implementations one by one (pluggy's order: backend first), passing only
    # the arguments each one declares, as pluggy does
    for impl in loaded.pm.hook.deepinfer_register_ops.get_hookimpls():
        plugin_name = impl.plugin_name
        registry.current_provider = plugin_name
        try:
            impl.function(*(kwargs[arg] for arg in impl.argnames))
        except Exception as exc:
            dist = _dist_of(loaded, plugin_name)
            raise PluginError(f"plugin {plugin_name} ({dist}) raised while registering ops: {exc}") from exc
    return registry


def _dist_of(loaded: LoadedBackend, plugin_name: str) -> str:
    group, _, ep_name = plugin_name.partition(":")
    eps = installed_backends() if group == BACKEND_GROUP else installed_kernel_packs()
    ep = eps.get(ep_name)
    return _describe(ep) if ep is not None else "unknown distribution"


def build_op_table(
    backend: str,
    dtype: Any = None,
    device: Any = None,
    model_config: Any = None,
    allow_reference_fallback: bool = False,
    batch_invariant: bool = False,
) -> OpTable:
    """Resolve every catalogued op for ``backend`` once; the result is called directly on the hot path.

    With ``batch_invariant`` the ops the catalogue does not mark batch-invariant resolve to
    implementations registered as batch-invariant (see :class:`~deepinfer_core.ops.registry.BuildContext`).
    """
    loaded = load_backend(backend)
    ctx = BuildContext(backend=backend, dtype=dtype, device=device, model_config=model_config,
                       batch_invariant=batch_invariant)
    fallback = None
    if allow_reference_fallback and backend != REFERENCE_BACKEND:
        fallback = collect_registry(load_backend(REFERENCE_BACKEND))
    return resolve_ops(collect_registry(loaded), ctx, fallback)


def describe_backends() -> list[dict[str, str]]:
    """One row per installed backend: available or the exact reason not (used by the CLI)."""
    rows = []
    for name, ep in sorted(installed_backends().items()):
        dist = getattr(ep, "dist", None)
        row = {"name": name, "distribution": dist.name if dist else "?"}
        row["version"] = dist.version if dist else "?"
        try:
            info = load_backend(name, require_available=False).info
        except PluginError as exc:
            row.update(device="?", available="no", reason=str(exc))
            rows.append(row)
            continue
        row["device"] = info.device_type
        try:  # is_available/details must not raise; a plugin that breaks the contract is reported, not fatal
            ok, reason = info.is_available()
            row.update(available="yes" if ok else "no", reason=reason)
        except Exception as exc:
            why = f"is_available() of {_describe(ep)} raised {type(exc).__name__}: {exc}"
            row.update(available="no", reason=why)
        try:
            row.update({k: str(v) for k, v in info.details().items()})
        except Exception as exc:
            row["details_error"] = f"details() raised {type(exc).__name__}: {exc}"
        row.update(collect_env(name))
        rows.append(row)
    return rows


def collect_env(backend: str) -> dict[str, str]:
    """What every plugin of ``backend`` reports through ``deepinfer_collect_env`` (for bug reports)."""
    try:
        loaded = load_backend(backend, require_available=False)
        reports = loaded.hook.deepinfer_collect_env()
    except Exception as exc:  # diagnostics never take the listing down
        return {"env_error": f"deepinfer_collect_env raised {type(exc).__name__}: {exc}"}
    return {k: str(v) for report in reports for k, v in (report or {}).items()}


def probe_library(module: str, dists: tuple[str, ...] = ()) -> str:
    """``"<version>"`` when ``module`` imports, else ``"missing: <reason>"``; never raises."""
    try:
        if importlib.util.find_spec(module) is None:
            return "missing: not installed"
    except Exception as exc:  # a broken parent package or finder
        return f"missing: {type(exc).__name__}: {exc}"
    try:
        mod = importlib.import_module(module)
    except (Exception, SystemExit) as exc:  # a broken extension build may even call sys.exit
        return f"missing: import failed: {type(exc).__name__}: {exc}"
    found = getattr(mod, "__version__", None)
    for dist in dists:
        if found:
            break
        try:
            found = version(dist)
        except PackageNotFoundError:
            continue
    return str(found) if found else "installed (version unknown)"

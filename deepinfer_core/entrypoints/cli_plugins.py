"""``deepinfer backends`` and ``deepinfer ops``: what is installed, what runs here, who serves each op."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from deepinfer_core import plugins
from deepinfer_core.ops.catalogue import CATALOGUE
from deepinfer_core.ops.registry import CHOSEN, DECLINED, BuildContext, OpRegistry

# keys of a describe_backends() row that are not backend details
_ROW_KEYS = ("name", "distribution", "version", "device", "available", "reason")
_DTYPES = ("float32", "float64", "bfloat16", "float16", "float8_e4m3fn")


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    lines = []
    for cells in [headers, *rows]:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip())
    return lines


def _dist_of_ep(ep: Any) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    return (dist.name, dist.version) if dist is not None else ("?", "?")


def _allowlist_note() -> str:
    allow = os.environ.get(plugins.ALLOWLIST_ENV)
    if allow is None:
        return f"{plugins.ALLOWLIST_ENV} unset: every installed pack loads"
    return f"{plugins.ALLOWLIST_ENV}={allow!r}"


# --- deepinfer backends ----------------------------------------------------------------------------


def add_backends_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def collect_backends() -> dict[str, Any]:
    """Every installed backend (availability, reason, details) and every installed kernel pack."""
    backends = []
    for row in plugins.describe_backends():
        entry: dict[str, Any] = {k: row.get(k, "") for k in _ROW_KEYS}
        entry["available"] = row.get("available") == "yes"
        entry["details"] = {k: v for k, v in row.items() if k not in _ROW_KEYS}
        backends.append(entry)
    allowed = plugins.allowed_kernel_packs()
    packs = []
    for name, ep in sorted(plugins.installed_kernel_packs().items()):
        dist, version = _dist_of_ep(ep)
        packs.append(
            {
                "name": name,
                "distribution": dist,
                "version": version,
                "module": ep.value,
                "loaded": name in allowed,
            }
        )
    return {"backends": backends, "kernel_packs": packs, "allowlist": os.environ.get(plugins.ALLOWLIST_ENV)}


def run_backends(args: argparse.Namespace) -> int:
    data = collect_backends()
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    out = []
    if not data["backends"]:
        out.append(
            f"no backends installed (entry-point group {plugins.BACKEND_GROUP!r}); pip install deepinfer[cpu]"
        )
    headers = ["BACKEND", "DISTRIBUTION", "VERSION", "DEVICE", "AVAILABLE", "REASON"]
    rows = [
        [
            b["name"],
            b["distribution"],
            b["version"],
            b["device"],
            "yes" if b["available"] else "no",
            b["reason"],
        ]
        for b in data["backends"]
    ]
    lines = _table(headers, rows)
    out.append(lines[0])
    for line, b in zip(lines[1:], data["backends"]):
        out.append(line)
        out.extend(f"    {key}: {value}" for key, value in b["details"].items())
    out.append("")
    if data["kernel_packs"]:
        rows = [
            [p["name"], p["distribution"], p["version"], "yes" if p["loaded"] else "no"]
            for p in data["kernel_packs"]
        ]
        out.extend(_table(["KERNEL PACK", "DISTRIBUTION", "VERSION", "LOADED"], rows))
    else:
        out.append(f"no kernel packs installed (entry-point group {plugins.KERNEL_GROUP!r})")
    out.append(f"({_allowlist_note()})")
    print("\n".join(out))
    return 0


# --- deepinfer ops ---------------------------------------------------------------------------------


def add_ops_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", required=True, help="backend name, as listed by `deepinfer backends`")
    parser.add_argument(
        "--dtype", choices=_DTYPES, default=None, help="model dtype the predicates see (default: unspecified)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="ask the backend which implementation would serve each op here and on its own device, "
        f"without that device (backends whose plugin module defines {DRY_RUN_ATTRIBUTE}()); nothing runs",
    )


#: optional attribute of a backend's plugin module: ``(dtype) -> {column: {op: implementation}}``, e.g.
#: ``{"here": ..., "npu": ...}``, judged on probes alone
DRY_RUN_ATTRIBUTE = "dry_run_plans"


def run_dry_run(loaded: plugins.LoadedBackend, args: argparse.Namespace) -> int:
    plans_of = getattr(loaded.entry_point.load(), DRY_RUN_ATTRIBUTE, None)
    if plans_of is None:
        print(f"deepinfer ops: error: backend {args.backend!r} has no dry run ({DRY_RUN_ATTRIBUTE})", file=sys.stderr)
        return 1
    ok, reason = loaded.info.is_available()
    plans = plans_of(_dtype(args.dtype))
    if args.json:
        print(json.dumps({"backend": args.backend, "available": ok, "reason": reason, "dtype": args.dtype,
                          "plans": plans}, indent=2))
        return 0
    columns = list(plans)
    rows = [[op, *(plans[c].get(op, "") for c in columns)] for op in CATALOGUE]
    out = [f"backend {args.backend}: " + ("available here" if ok else f"NOT available here: {reason}"),
           f"dry run (nothing runs), dtype={args.dtype or 'backend default'}", ""]
    out.extend(_table(["OP", *(c.upper() for c in columns)], rows))
    print("\n".join(out))
    return 0


def _provider(loaded: plugins.LoadedBackend, plugin_name: str) -> dict[str, str]:
    group, _, ep_name = plugin_name.partition(":")
    if group == plugins.BACKEND_GROUP:
        kind = "backend"
        ep = (
            loaded.entry_point
            if ep_name == loaded.entry_point.name
            else plugins.installed_backends().get(ep_name)
        )
    elif group == plugins.KERNEL_GROUP:
        kind, ep = "kernel pack", plugins.installed_kernel_packs().get(ep_name)
    else:
        kind, ep = "plugin", None
    dist, version = _dist_of_ep(ep) if ep is not None else ("?", "?")
    return {
        "provider": plugin_name,
        "name": ep_name or plugin_name,
        "kind": kind,
        "distribution": dist,
        "distribution_version": version,
    }


def _qualname(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _reason(impl: Any, verdict: str, ctx: BuildContext) -> dict[str, str]:
    """``{"reason": ...}`` where a declining predicate can say why (its ``reason(ctx)``), else ``{}``."""
    explain = getattr(impl.predicate, "reason", None)
    if verdict != DECLINED or not callable(explain):
        return {}
    try:
        reason = explain(ctx)
    except Exception as exc:
        reason = f"reason raised {type(exc).__name__}: {exc}"
    return {"reason": reason} if reason else {}


def resolve_table(
    loaded: plugins.LoadedBackend, registry: OpRegistry, ctx: BuildContext
) -> list[dict[str, Any]]:
    """For each catalogued op: the implementation the core's resolution picks under ``ctx`` and every
    alternative with its verdict (:meth:`~deepinfer_core.ops.registry.OpRegistry.explain`)."""
    rows = []
    for op in CATALOGUE:
        chosen: dict[str, Any] | None = None
        alternatives = []
        for impl, verdict in registry.explain(op, ctx):
            entry = {
                **_provider(loaded, impl.provider),
                "priority": impl.priority,
                "function": _qualname(impl.fn),
                "batch_invariant": impl.batch_invariant,
                "syncs_host": impl.syncs_host,
            }
            if verdict == CHOSEN:
                chosen = entry
            else:
                alternatives.append({**entry, "status": verdict, **_reason(impl, verdict, ctx)})
        rows.append({"op": op, "chosen": chosen, "alternatives": alternatives})
    return rows


def _dtype(name: str | None) -> Any:
    if name is None:
        return None
    import torch

    return getattr(torch, name)


def run_ops(args: argparse.Namespace) -> int:
    try:
        loaded = plugins.load_backend(args.backend, require_available=False)
        registry = plugins.collect_registry(loaded)
    except plugins.PluginError as exc:
        print(f"deepinfer ops: error: {exc}", file=sys.stderr)
        return 1
    if getattr(args, "dry_run", False):
        return run_dry_run(loaded, args)
    ok, reason = loaded.info.is_available()
    ctx = BuildContext(backend=args.backend, dtype=_dtype(args.dtype))
    rows = resolve_table(loaded, registry, ctx)
    missing = [r["op"] for r in rows if r["chosen"] is None]
    backend = _provider(loaded, f"{plugins.BACKEND_GROUP}:{loaded.entry_point.name}")
    if args.json:
        print(
            json.dumps(
                {
                    "backend": args.backend,
                    "distribution": backend["distribution"],
                    "distribution_version": backend["distribution_version"],
                    "device": loaded.info.device_type,
                    "available": ok,
                    "reason": reason,
                    "kernel_packs": loaded.kernel_packs,
                    "dtype": args.dtype,
                    "ops": rows,
                    "missing": missing,
                },
                indent=2,
            )
        )
        return 0

    def who(entry: dict[str, Any]) -> str:
        return f"{entry['name']} [{entry['kind']}]"

    out = [
        f"backend {args.backend} ({backend['distribution']} {backend['distribution_version']}, "
        f"device {loaded.info.device_type}): " + ("available" if ok else f"NOT available here: {reason}"),
        f"kernel packs loaded: {', '.join(loaded.kernel_packs) or 'none'} ({_allowlist_note()})",
        f"build context: dtype={args.dtype or 'unspecified'}",
        "",
    ]
    table = []
    for r in rows:
        c = r["chosen"]
        alts = "; ".join(
            f"{who(a)} ({a['distribution']}) priority {a['priority']}: {a['status']}"
            + (f" ({a['reason']})" if a.get("reason") else "")
            for a in r["alternatives"]
        )
        if c is None:
            table.append([r["op"], "MISSING", "", "", alts])
        else:
            table.append(
                [
                    r["op"],
                    who(c),
                    f"{c['distribution']} {c['distribution_version']}",
                    str(c["priority"]),
                    alts,
                ]
            )
    out.extend(_table(["OP", "PROVIDER", "DISTRIBUTION", "PRIORITY", "SHADOWED ALTERNATIVES"], table))
    syncing = [r["op"] for r in rows if r["chosen"] is not None and r["chosen"]["syncs_host"]]
    if syncing:
        out.append("")
        out.append(f"wait for the host (a step running them is not captured in a graph): {', '.join(syncing)}")
    if missing:
        out.append("")
        out.append(
            f"{len(missing)} op(s) missing: building an engine on {args.backend!r} raises MissingOpError "
            "unless allow_reference_fallback=True (slow cpu_ref versions fill the gaps)"
        )
    print("\n".join(out))
    return 0

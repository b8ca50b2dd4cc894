"""The sweep once per set of DeepSeek's kernel libraries, in one invocation (``--libraries none,flash_mla,...``).

A library, once imported, cannot be un-imported, so every set runs the whole sweep in a subprocess of
its own in which the known libraries outside the set are unimportable: a ``sitecustomize`` put first on
``PYTHONPATH`` installs a meta-path finder that raises ``ModuleNotFoundError`` for them (and their
submodules) before any other finder is asked. The nvidia backend finds its libraries with
``importlib.util.find_spec`` and ``importlib.import_module`` (``capability.module_importable``), both of
which go through that finder, so a hidden library is declined exactly as a missing one; the finder is
inherited by every process the sweep starts. Each subprocess records which libraries it found and which
implementation served each op; the parent merges the per-set ``sweep.json`` files into one table and one
JSON, with ratios against the ``none`` set (the first set when ``none`` is not among them) of the same run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: the libraries a set may name, in the order their names are written
KNOWN_LIBRARIES = ("flash_mla", "deep_gemm", "deep_ep")
#: module name -> distribution names that may carry its version (as the nvidia backend's probe has them)
DISTRIBUTIONS = {"flash_mla": ("flash_mla", "flash-mla"), "deep_gemm": ("deep_gemm", "deep-gemm"),
                 "deep_ep": ("deep_ep", "deep-ep")}
#: comma-separated top-level module names the injected finder makes unimportable
HIDE_ENV = "DEEPINFER_HIDE_LIBRARIES"
NONE = "none"
ROOT = Path(__file__).resolve().parents[2]
SWEEP_SCRIPT = ROOT / "benchmarks" / "sweep_gpu.py"
MERGED_JSON, MERGED_MD = "libraries.json", "libraries.md"
#: ops shown in the merged table even when every set served them alike (those the libraries can take)
LIBRARY_OPS = ("sparse_attention", "sparse_attention_fp8", "moe_experts", "moe_experts_fp8", "linear_fp8",
               "indexer_topk")

HOOK = '''"""Written by deepinfer's benchmarks/gpu_sweep/libraries.py: the top-level modules named in ${env}
(comma-separated) and their submodules cannot be imported in this process or its children."""

import os as _os
import sys as _sys


class _HiddenLibraries:
    """First on sys.meta_path: raises for a hidden module before any other finder is asked."""

    def __init__(self, names):
        self.names = frozenset(names)

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by ${env})", name=name)
        return None

    def invalidate_caches(self):
        pass


def _install():
    names = [n.strip() for n in _os.environ.get("${env}", "").split(",") if n.strip()]
    if not names:
        return
    for name in list(_sys.modules):
        if name.partition(".")[0] in names:
            del _sys.modules[name]
    _sys.meta_path.insert(0, _HiddenLibraries(names))


def _chain():
    """Run the sitecustomize this one shadows, if there is one further down the path."""
    import importlib

    here = _os.path.dirname(_os.path.abspath(__file__))
    ours = _sys.modules.get(__name__)
    saved = list(_sys.path)
    _sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != here]
    try:
        _sys.modules.pop(__name__, None)
        importlib.import_module("sitecustomize")
    except ModuleNotFoundError as exc:
        if exc.name != "sitecustomize":
            raise
    finally:
        _sys.path[:] = saved
        if ours is not None:
            _sys.modules[__name__] = ours


_install()
_chain()
'''


@dataclass(frozen=True)
class LibrarySet:
    """``none`` or library names joined by ``+``; every known library outside the set is hidden."""

    name: str
    libraries: tuple[str, ...]
    known: tuple[str, ...] = KNOWN_LIBRARIES

    @property
    def hidden(self) -> tuple[str, ...]:
        return tuple(n for n in self.known if n not in self.libraries)


def parse_library_set(text: str, known: Sequence[str] = KNOWN_LIBRARIES) -> LibrarySet:
    name = text.strip()
    if name == NONE:
        return LibrarySet(name, (), tuple(known))
    parts = tuple(p.strip() for p in name.split("+"))
    unknown = [p for p in parts if p not in known]
    if not name or unknown or len(set(parts)) != len(parts):
        raise ValueError(f"library set {text!r}: want {NONE!r} or names from {', '.join(known)} joined by '+'")
    return LibrarySet(name, parts, tuple(known))


def parse_library_sets(text: str, known: Sequence[str] = KNOWN_LIBRARIES) -> tuple[LibrarySet, ...]:
    sets = tuple(parse_library_set(part, known) for part in text.split(",") if part.strip())
    if not sets:
        raise ValueError(f"want comma-separated library sets, got {text!r}")
    seen: dict[frozenset[str], str] = {}
    for s in sets:
        key = frozenset(s.libraries)
        if key in seen:
            raise ValueError(f"library sets {seen[key]!r} and {s.name!r} are the same set")
        seen[key] = s.name
    return sets


def library_sets_arg(text: str) -> tuple[LibrarySet, ...]:
    """``argparse`` type of ``--libraries``."""
    try:
        return parse_library_sets(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# --- hiding ----------------------------------------------------------------------------------------


def write_hook(directory: Path) -> Path:
    """``directory/sitecustomize.py``, the finder; ``directory`` goes first on the children's path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(HOOK.replace("${env}", HIDE_ENV))
    return directory


def hiding_env(hook_dir: Path, hidden: Iterable[str], base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a child process in which ``hidden`` cannot be imported (``base``: os.environ)."""
    env = dict(os.environ if base is None else base)
    path = [str(hook_dir)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(path)
    env[HIDE_ENV] = ",".join(hidden)
    return env


def hidden_here() -> tuple[str, ...]:
    """The modules this process was asked to hide (``$DEEPINFER_HIDE_LIBRARIES``)."""
    return tuple(n.strip() for n in os.environ.get(HIDE_ENV, "").split(",") if n.strip())


def check_hidden(names: Iterable[str]) -> list[str]:
    """Those of ``names`` that are NOT hidden in this process (empty: the finder is in force)."""
    leaked = []
    for name in names:
        try:
            spec = importlib.util.find_spec(name)
        except ModuleNotFoundError:
            continue
        if spec is not None or name in sys.modules:
            leaked.append(name)
    return leaked


def library_status(known: Sequence[str] = KNOWN_LIBRARIES) -> dict[str, str]:
    """Per known library: its version when it imports, ``missing: why`` when not, ``hidden (...)`` when
    this process hides it (with whether it is installed at all)."""
    from importlib.machinery import PathFinder

    from deepinfer_core.plugins import probe_library

    hidden, out = set(hidden_here()), {}
    for name in known:
        if name not in hidden:
            out[name] = probe_library(name, DISTRIBUTIONS.get(name, (name,)))
            continue
        try:  # the path finder alone, past the hiding finder: is it there to hide?
            spec = PathFinder.find_spec(name)
        except Exception:
            spec = None
        out[name] = "hidden (installed)" if spec is not None else "hidden (not installed)"
    return out


# --- which implementation served each op ----------------------------------------------------------


def implementation_label(impl: Any) -> str:
    """What served an op: the backend's own name for it where the backend has one (the nvidia backend:
    ``triton``, ``torch``, ``flash_mla``, ...), else ``provider: module.function``."""
    group, _, name = impl.provider.partition(":")
    if group == "deepinfer.backends" and name:
        try:
            registration = importlib.import_module(f"deepinfer_{name}.registration")
            return str(registration.implementation_name(impl))
        except (ImportError, AttributeError):
            pass
    fn = getattr(impl.fn, "func", impl.fn)  # functools.partial
    module = getattr(fn, "__module__", "") or ""
    return f"{name or impl.provider}: {module.rpartition('.')[2]}.{getattr(fn, '__qualname__', repr(fn))}"


def op_labels(ops: Any) -> dict[str, str]:
    """op -> what serves it, for an :class:`~deepinfer_core.ops.registry.OpTable`."""
    return {op: implementation_label(impl) for op, impl in sorted(ops.chosen.items())}


# --- running the sets ------------------------------------------------------------------------------


def child_argv(args: argparse.Namespace, model_argv: Sequence[str], out: Path, set_name: str) -> list[str]:
    """The sweep's command line for one set: the parent's options, its own ``--out``, no ``--libraries``."""
    argv = ["--out", str(out), "--library-set", set_name, "--mode", args.mode, "--configs", ",".join(args.configs),
            "--batch-sizes", ",".join(map(str, args.batch_sizes)), "--prompt-len", str(args.prompt_len),
            "--gen-len", str(args.gen_len), "--chunk-sizes", ",".join(map(str, args.chunk_sizes)),
            "--decode-batched-tokens", str(args.decode_batched_tokens), "--warmup-steps", str(args.warmup_steps)]
    if args.prefill_len is not None:
        argv += ["--prefill-len", str(args.prefill_len)]
    if getattr(args, "threads", None):
        argv += ["--threads", str(args.threads)]
    argv += [flag for flag, on in (("--fp8", args.fp8), ("--no-hf", args.no_hf)) if on]
    return argv + list(model_argv)


def set_dir(out: Path, s: LibrarySet) -> Path:
    return Path(out) / s.name


def run_sets(sets: Sequence[LibrarySet], args: argparse.Namespace, model_argv: Sequence[str], out: Path,
             log: Callable[[str], None] = print) -> dict[str, dict[str, Any]]:
    """Each set's sweep in a subprocess of its own; set name -> {hidden, dir (under ``out``), returncode[,
    error]}."""
    runs: dict[str, dict[str, Any]] = {}
    out = Path(out).resolve()
    with tempfile.TemporaryDirectory(prefix="deepinfer-hide-") as tmp:
        hook = write_hook(Path(tmp))
        for s in sets:
            d = set_dir(out, s)
            cmd = [sys.executable, str(SWEEP_SCRIPT), *child_argv(args, model_argv, d, s.name)]
            log(f"library set {s.name}: hiding {', '.join(s.hidden) or 'nothing'}; results in {d}")
            proc = subprocess.run(cmd, env=hiding_env(hook, s.hidden))
            run: dict[str, Any] = {"libraries": list(s.libraries), "hidden": list(s.hidden),
                                   "dir": str(d.relative_to(out)),
                                   "returncode": proc.returncode}
            if proc.returncode != 0:
                run["error"] = f"the sweep exited with status {proc.returncode}"
                log(f"library set {s.name}: {run['error']}")
            elif not (d / "sweep.json").is_file():
                run["error"] = "the sweep wrote no sweep.json"
            runs[s.name] = run
    return runs


def run_library_sets(sets: Sequence[LibrarySet], args: argparse.Namespace, model_argv: Sequence[str], out: Path,
                     log: Callable[[str], None] = print) -> int:
    """All sets, then ``libraries.json`` and ``libraries.md`` under ``out`` (the table is also printed);
    1 when a set's sweep failed to produce its report."""
    runs = run_sets(sets, args, model_argv, out, log)
    reports = {}
    for name, run in runs.items():
        path = Path(out) / run["dir"] / "sweep.json"
        if path.is_file():
            reports[name] = json.loads(path.read_text())
    merged = merge(runs, reports)
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / MERGED_JSON).write_text(json.dumps(merged, indent=1) + "\n")
    table = markdown(merged)
    (Path(out) / MERGED_MD).write_text(table + "\n")
    print(table)
    log(f"wrote {Path(out) / MERGED_JSON} and {Path(out) / MERGED_MD}")
    return 1 if any("error" in r for r in runs.values()) else 0


# --- merging ---------------------------------------------------------------------------------------


def _ratio(value: float | None, base: float | None) -> float | None:
    return value / base if value is not None and base else None


def merge(runs: Mapping[str, Mapping[str, Any]], reports: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """One JSON for every set: per set what it hid, found and which op each implementation served, and
    one row per set x config x batch (decode) and set x config x chunk (prefill), with ratios against
    the baseline set (``none``, else the first)."""
    names = list(runs)
    baseline = NONE if NONE in names else (names[0] if names else None)
    sets = {}
    for name, run in runs.items():
        rep = reports.get(name, {})
        sets[name] = dict(run) | {"found": rep.get("libraries", {}), "ops": rep.get("ops", {})}
    decode, prefill = [], []
    for name in names:
        for config, res in reports.get(name, {}).get("configs", {}).items():
            for r in res.get("decode", []):
                s = r.get("summary", {})
                decode.append({"set": name, "config": config, "batch": r["batch"], "step_ms": s.get("step_ms"),
                               "tok_s": s.get("tok_s"), "forward_ms": s.get("forward_ms"),
                               "floor_ms": s.get("floor_ms"), "step_over_floor": s.get("step_over_floor"),
                               "error": r.get("error") or res.get("error")})
            for r in res.get("prefill", []):
                s = r.get("summary", {})
                prefill.append({"set": name, "config": config, "chunk": r["chunk"], "tok_s": s.get("tok_s"),
                                "chunk_ms": s.get("chunk_ms"), "error": r.get("error") or res.get("error")})
    base_step = {(r["config"], r["batch"]): r["step_ms"] for r in decode if r["set"] == baseline}
    base_tok = {(r["config"], r["chunk"]): r["tok_s"] for r in prefill if r["set"] == baseline}
    for r in decode:
        r["step_vs_baseline"] = _ratio(r["step_ms"], base_step.get((r["config"], r["batch"])))
    for r in prefill:
        r["tok_s_vs_baseline"] = _ratio(r["tok_s"], base_tok.get((r["config"], r["chunk"])))
    order = {n: i for i, n in enumerate(names)}
    decode.sort(key=lambda r: (r["config"], r["batch"], order[r["set"]]))
    prefill.sort(key=lambda r: (r["config"], r["chunk"], order[r["set"]]))
    first = next(iter(reports.values()), {})
    return {"baseline": baseline, "sets": sets, "environment": first.get("environment", {}),
            "model": first.get("model", {}), "options": first.get("options", {}), "decode": decode,
            "prefill": prefill}


def _f(value: Any, fmt: str) -> str:
    return format(value, fmt) if isinstance(value, (int, float)) else "-"


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" for _ in headers) + "|"]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def served_ops(merged: Mapping[str, Any]) -> dict[str, dict[str, str]]:
    """op -> set -> what served it (the op table of the model without FP8 weights), for the ops that
    differ between the sets, that a library served, or that the libraries can take (:data:`LIBRARY_OPS`)."""
    per_set = {}
    for name, s in merged["sets"].items():
        tables = s.get("ops") or {}
        per_set[name] = tables.get("default") or next(iter(tables.values()), {})
    ops = sorted({op for table in per_set.values() for op in table})
    out = {}
    for op in ops:
        labels = {name: table.get(op, "-") for name, table in per_set.items()}
        by_library = any(lib in label for label in labels.values() for lib in KNOWN_LIBRARIES)
        if len(set(labels.values())) > 1 or by_library or op in LIBRARY_OPS:
            out[op] = labels
    return out


def markdown(merged: Mapping[str, Any]) -> str:
    env, model, base = merged.get("environment", {}), merged.get("model", {}), merged["baseline"]
    names = list(merged["sets"])
    lines = [f"# deepinfer sweep by kernel-library set: {env.get('device', '?')}", ""]
    if model:
        lines += [f"model: {model.get('layers')} layers, hidden {model.get('hidden')}, {model.get('experts')} "
                  f"experts, {model.get('dtype')}, backend {model.get('backend')}; torch {env.get('torch')}, "
                  f"triton {env.get('triton')}; each set in its own process, the known libraries outside it "
                  f"made unimportable ({HIDE_ENV}); ratios against the {base!r} set of this run", ""]
    known = sorted({lib for s in merged["sets"].values() for lib in s.get("found", {})},
                   key=lambda n: (KNOWN_LIBRARIES + (n,)).index(n))
    if known:
        lines += ["## Libraries each set found", ""]
        lines += _table(["set", *known], [[n, *(merged["sets"][n]["found"].get(lib, "-") for lib in known)]
                                         for n in names])
        lines.append("")
    ops = served_ops(merged)
    if ops:
        lines += ["## Which implementation served each op (the ops that differ between sets or that the "
                  "libraries can serve)", ""]
        lines += _table(["op", *names], [[op, *(labels[n] for n in names)] for op, labels in ops.items()])
        lines.append("")
    if merged["decode"]:
        lines += ["## Decode step (medians)", ""]
        lines += _table(["set", "config", "batch", "step ms", f"step / {base}", "tok/s", "forward ms", "floor ms",
                         "step/floor"],
                        [[r["set"], r["config"], str(r["batch"]), _f(r["step_ms"], ".3f"),
                          _f(r["step_vs_baseline"], ".3f"), _f(r["tok_s"], ",.1f"), _f(r["forward_ms"], ".3f"),
                          _f(r["floor_ms"], ".3f"), _f(r["step_over_floor"], ".2f")] for r in merged["decode"]])
        lines.append("")
    if merged["prefill"]:
        lines += ["## Prefill", ""]
        lines += _table(["set", "config", "chunk", "tok/s", f"tok/s / {base}", "chunk ms"],
                        [[r["set"], r["config"], str(r["chunk"]), _f(r["tok_s"], ",.0f"),
                          _f(r["tok_s_vs_baseline"], ".3f"), _f(r["chunk_ms"], ".2f")] for r in merged["prefill"]])
        lines.append("")
    errs = [f"- {n}: {s['error']}" for n, s in merged["sets"].items() if s.get("error")]
    errs += [f"- {r['set']} {r['config']} {part} {r.get('batch', r.get('chunk'))}: {r['error'].splitlines()[-1]}"
             for part, rows in (("decode batch", merged["decode"]), ("prefill chunk", merged["prefill"]))
             for r in rows if r.get("error")]
    if errs:
        lines += ["## Errors", "", *errs, ""]
    return "\n".join(lines)

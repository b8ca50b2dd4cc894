"""Training corpus for the tiny DeepSeek-V4: the Python standard library's own ``.py`` sources.

Files are split *by file* into ``train`` / ``val`` / ``heldout`` from a hash of the path relative to the
stdlib directory, so the same file lands in the same split on every machine and Python version. Test
suites, IDLE, demos, generated tables (``encodings``, ``pydoc_data``), bundled wheels and
machine-specific modules (``_sysconfigdata*``) are left out, as is anything installed (site-packages).

The manifest lists relative paths only (never a machine path), with sizes, sha256 and split.

    python tools/build_corpus.py --manifest corpus_manifest.json             # describe this machine's corpus
    python tools/build_corpus.py --write-slice data/heldout_slice.txt        # refresh the stored held-out slice
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

SPLIT_SEED = "deepinfer-stdlib-v1"
# Percent of files per split, by hash bucket: [0, HELDOUT) heldout, [HELDOUT, HELDOUT + VAL) val, rest train.
HELDOUT_PERCENT = 8
VAL_PERCENT = 4

EXCLUDED_DIRS = frozenset({
    "test", "tests", "idle_test", "idlelib", "turtledemo", "site-packages", "dist-packages", "__pycache__",
    "lib-dynload", "encodings", "pydoc_data", "ensurepip", "__phello__",
})
EXCLUDED_FILE_PREFIXES = ("_sysconfigdata", "__hello__", "test_")
MAX_FILE_BYTES = 400_000

DOC_SEPARATOR = "eos"  # documents are joined with the tokenizer's end-of-sentence token


@dataclass(frozen=True)
class CorpusFile:
    relpath: str  # posix path relative to the stdlib directory
    split: str
    size: int
    sha256: str

    def read(self, root: Path) -> str:
        return (root / self.relpath).read_text(encoding="utf-8")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(relpath: str) -> str:
    """Deterministic split of one file from its relative path (identical on every machine)."""
    digest = hashlib.sha256(f"{SPLIT_SEED}:{relpath}".encode()).hexdigest()
    bucket = int(digest[:8], 16) % 100
    if bucket < HELDOUT_PERCENT:
        return "heldout"
    if bucket < HELDOUT_PERCENT + VAL_PERCENT:
        return "val"
    return "train"


def _excluded(rel: Path) -> bool:
    if any(part in EXCLUDED_DIRS or part.startswith("config-") for part in rel.parts[:-1]):
        return True
    return rel.name.startswith(EXCLUDED_FILE_PREFIXES)


def collect(root: Path | None = None) -> list[CorpusFile]:
    """Every corpus file under ``root`` (default: this interpreter's stdlib), sorted by relative path."""
    root = Path(root) if root is not None else stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _excluded(rel) or not path.is_file():
            continue
        data = path.read_bytes()
        if len(data) > MAX_FILE_BYTES or not data.strip():
            continue
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        relpath = rel.as_posix()
        files.append(CorpusFile(relpath, split_of(relpath), len(data), hashlib.sha256(data).hexdigest()))
    return files


def manifest(files: list[CorpusFile]) -> dict:
    totals: dict[str, dict[str, int]] = {}
    for f in files:
        t = totals.setdefault(f.split, {"files": 0, "bytes": 0})
        t["files"] += 1
        t["bytes"] += f.size
    return {
        "source": "Python standard library (.py sources), PSF License",
        "python_version": platform.python_version(),
        "implementation": platform.python_implementation(),
        "split_rule": f"sha256('{SPLIT_SEED}:' + relpath) first 8 hex digits as int % 100: "
                      f"< {HELDOUT_PERCENT} heldout, < {HELDOUT_PERCENT + VAL_PERCENT} val, else train",
        "excluded_dirs": sorted(EXCLUDED_DIRS) + ["config-*"],
        "excluded_file_prefixes": list(EXCLUDED_FILE_PREFIXES),
        "max_file_bytes": MAX_FILE_BYTES,
        "doc_separator": DOC_SEPARATOR,
        "totals": totals,
        "files": [{"path": f.relpath, "split": f.split, "bytes": f.size, "sha256": f.sha256} for f in files],
    }


def texts(files: list[CorpusFile], split: str, root: Path | None = None) -> list[str]:
    root = Path(root) if root is not None else stdlib_root()
    return [f.read(root) for f in files if f.split == split]


def heldout_slice(files: list[CorpusFile], root: Path | None = None, target_bytes: int = 4000,
                  source: str | None = None) -> tuple[str, dict]:
    """A few KB of one held-out file, cut at line boundaries, skipping the module docstring/header.

    Picks ``source`` if given, else the held-out file whose size is closest to 20 KB (deterministic).
    """
    root = Path(root) if root is not None else stdlib_root()
    held = [f for f in files if f.split == "heldout"]
    if not held:
        raise ValueError("no held-out files")
    if source is None:
        pick = min(held, key=lambda f: (abs(f.size - 20_000), f.relpath))
    else:
        matches = [f for f in held if f.relpath == source]
        if not matches:
            raise ValueError(f"{source} is not a held-out corpus file here")
        pick = matches[0]
    lines = pick.read(root).splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.startswith(("def ", "class "))), 0)
    out, size, end = [], 0, start
    for end in range(start, len(lines)):
        out.append(lines[end])
        size += len(lines[end].encode())
        if size >= target_bytes and lines[end].strip() == "":
            break
    text = "".join(out)
    info = {"path": pick.relpath, "python_version": platform.python_version(), "first_line": start + 1,
            "last_line": end + 1, "bytes": len(text.encode()),
            "sha256": hashlib.sha256(text.encode()).hexdigest()}
    return text, info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--manifest", type=Path, help="write the corpus manifest (JSON) here")
    ap.add_argument("--write-slice", type=Path, help="write a held-out slice (text) here, and <name>.json beside it")
    ap.add_argument("--slice-bytes", type=int, default=4000)
    ap.add_argument("--slice-source", help="relative path of the held-out file to slice (default: automatic)")
    args = ap.parse_args(argv)
    files = collect()
    m = manifest(files)
    print(f"python {m['python_version']}: " + ", ".join(
        f"{k} {v['files']} files / {v['bytes'] / 1e6:.2f} MB" for k, v in sorted(m["totals"].items())))
    if args.manifest:
        args.manifest.parent.mkdir(parents=True, exist_ok=True)
        args.manifest.write_text(json.dumps(m, indent=1) + "\n")
        print(f"manifest -> {args.manifest}")
    if args.write_slice:
        text, info = heldout_slice(files, target_bytes=args.slice_bytes, source=args.slice_source)
        args.write_slice.parent.mkdir(parents=True, exist_ok=True)
        args.write_slice.write_text(text, encoding="utf-8")
        args.write_slice.with_suffix(".json").write_text(json.dumps(info, indent=1) + "\n")
        print(f"held-out slice {info['path']} lines {info['first_line']}-{info['last_line']} "
              f"({info['bytes']} bytes) -> {args.write_slice}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

# Sourced by the GPU scripts: `source "$(dirname "$0")/gpu_setup.sh" "$@"` checks for one OUT_DIR
# argument, makes it (OUT_DIR, absolute), moves to the repository root, sets PY (PYTHON, default python3)
# and installs deepinfer, cpu_ref and nvidia_sm100 editable, offline, where their entry points are missing
# (OUT_DIR/install.log).

if [ $# -ne 1 ]; then
    echo "usage: $0 OUT_DIR" >&2
    exit 2
fi
OUT_DIR="$1"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1

if ! "$PY" -c "from importlib.metadata import entry_points as e; \
raise SystemExit(0 if 'nvidia_sm100' in {x.name for x in e(group='deepinfer.backends')} else 1)"; then
    "$PY" -m pip install --no-deps --no-build-isolation --no-index \
        -e . -e backends/cpu_ref -e backends/nvidia_sm100 > "$OUT_DIR/install.log" 2>&1 || {
        echo "installing deepinfer failed, see $OUT_DIR/install.log" >&2
        exit 1
    }
fi

#!/usr/bin/env bash
# Run the nvidia_sm100 GPU suite on a CUDA host and keep every log.
#
#   bash scripts/run_gpu_suite.sh [LOG_DIR]        (default LOG_DIR: ./gpu_logs)
#
# Steps (each writes LOG_DIR/<step>.log; JUnit XML beside the pytest logs):
#   install      pip install --no-deps --no-build-isolation --no-index -e . -e backends/cpu_ref
#                -e backends/nvidia_sm100, only when the backends' entry points are not installed yet
#                (works offline: nothing is downloaded)
#   env          nvidia-smi, versions, `deepinfer backends` (which implementation serves each op)
#   gpu_suite    pytest -m gpu backends/nvidia_sm100/tests/gpu: op conformance at tiny + v4_flash, engine vs cpu_ref float64,
#                bad input, device/topology/NCCL hooks; each test's time in gpu_suite_times.tsv as it ends
#   conformance  pytest tests/ops/test_conformance.py --backend nvidia_sm100, tiny (all dtypes) and the
#                slow v4_flash preset (bfloat16, float32)
# The exit status is non-zero when a step failed; LOG_DIR/summary.txt lists each step's status.
# Environment: PYTHON (default python3), PYTEST_ARGS (extra pytest arguments, e.g. "-x"),
# GPU_SUITE_STEPS (the test steps to run, default "gpu_suite conformance"; e.g. one each in two processes),
# GPU_SUITE_WORKERS (pytest-xdist processes sharing the GPU; default 8 when xdist is installed, 0 runs
# serially; on one H200 the GPU suite alone takes over 10 minutes serially, and 8 workers ran 160 of
# its 187 tests in 205 s), OMP_NUM_THREADS (default: the host's cores shared among the workers).

set -u -o pipefail

LOG_DIR="${1:-./gpu_logs}"
mkdir -p "$LOG_DIR"
LOG_DIR="$(cd "$LOG_DIR" && pwd)"
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
read -r -a EXTRA <<< "${PYTEST_ARGS:-}"
if "$PY" -c "import xdist" 2>/dev/null; then WORKERS="${GPU_SUITE_WORKERS:-8}"; else WORKERS=0; fi
[ "$WORKERS" -gt 0 ] && EXTRA=(-n "$WORKERS" "${EXTRA[@]}")
# the engine tests' float64 cpu_ref references run on the host: give each worker its share of the cores,
# not a thread per core each (OMP_NUM_THREADS overrides)
SHARE=$(( $(nproc 2>/dev/null || echo 8) / (WORKERS > 1 ? WORKERS : 1) ))
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( SHARE > 0 ? SHARE : 1 ))}"
"$PY" -c "import pytest_timeout" 2>/dev/null && EXTRA=(--timeout=600 "${EXTRA[@]}")
export PYTHONUNBUFFERED=1
SUMMARY="$LOG_DIR/summary.txt"
: > "$SUMMARY"
STATUS=0

record() {  # record NAME EXIT_CODE
    local verdict="ok"
    [ "$2" -eq 0 ] || { verdict="FAILED (exit $2)"; STATUS=1; }
    echo "$1: $verdict" | tee -a "$SUMMARY"
}

backends_installed() {
    "$PY" - <<'EOF'
from importlib.metadata import entry_points
names = {ep.name for ep in entry_points(group="deepinfer.backends")}
raise SystemExit(0 if {"cpu_ref", "nvidia_sm100"} <= names else 1)
EOF
}

# --- install ---------------------------------------------------------------------------------------
if backends_installed; then
    echo "deepinfer, cpu_ref and nvidia_sm100 already installed" > "$LOG_DIR/install.log"
    record install 0
else
    "$PY" -m pip install --no-deps --no-build-isolation --no-index \
        -e . -e backends/cpu_ref -e backends/nvidia_sm100 > "$LOG_DIR/install.log" 2>&1
    rc=$?
    record install $rc
    if ! backends_installed; then
        echo "the deepinfer backends are not installed (see $LOG_DIR/install.log); stopping" | tee -a "$SUMMARY"
        exit 1
    fi
fi

# --- environment -----------------------------------------------------------------------------------
{
    echo "== date"; date -u
    echo "== git"; git rev-parse HEAD 2>/dev/null; git status --short 2>/dev/null | head -50
    echo "== nvidia-smi"; nvidia-smi 2>&1 || true
    echo "== nvidia-smi topo -m"; nvidia-smi topo -m 2>&1 || true
    echo "== versions"
    "$PY" - <<'EOF'
import sys
import torch
print("python", sys.version.split()[0])
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
for name in ("triton", "transformers", "pluggy", "numpy", "safetensors"):
    try:
        mod = __import__(name)
        print(name, getattr(mod, "__version__", "?"))
    except Exception as exc:
        print(name, "missing:", exc)
EOF
    echo "== deepinfer backends"
    "$PY" -m deepinfer_core.entrypoints.cli backends
    echo "== deepinfer ops --backend nvidia_sm100 --dtype bfloat16"
    "$PY" -m deepinfer_core.entrypoints.cli ops --backend nvidia_sm100 --dtype bfloat16
} > "$LOG_DIR/env.log" 2>&1
record env $?

STEPS=" ${GPU_SUITE_STEPS:-gpu_suite conformance} "

# --- the GPU suite ---------------------------------------------------------------------------------
if [[ "$STEPS" == *" gpu_suite "* ]]; then
    : > "$LOG_DIR/gpu_suite_times.tsv"
    DEEPINFER_TEST_TIMES="$LOG_DIR/gpu_suite_times.tsv" "$PY" -m pytest backends/nvidia_sm100/tests/gpu -m gpu -rfEs -v --durations=15 \
        --junitxml="$LOG_DIR/gpu_suite.xml" "${EXTRA[@]}" 2>&1 | tee "$LOG_DIR/gpu_suite.log"
    record gpu_suite "${PIPESTATUS[0]}"
fi

# --- the conformance suite for nvidia_sm100 (tiny in every dtype, then v4_flash) -------------------
if [[ "$STEPS" == *" conformance "* ]]; then
    "$PY" -m pytest tests/ops/test_conformance.py --backend nvidia_sm100 -m "slow or not slow" -rfEs -q \
        --durations=15 --junitxml="$LOG_DIR/conformance.xml" "${EXTRA[@]}" 2>&1 | tee "$LOG_DIR/conformance.log"
    record conformance "${PIPESTATUS[0]}"
fi

echo "logs in $LOG_DIR" | tee -a "$SUMMARY"
exit $STATUS

#!/usr/bin/env bash
# The GPU suite with and without the kernel libraries (FlashMLA, DeepGEMM, DeepEP), as every GPU change needs.
#
#   bash scripts/run_gpu_suite_both.sh LOG_DIR SITE
#
# SITE: a folder holding the libraries (e.g. `pip install --no-deps --target SITE *.whl`), put on PYTHONPATH
# for the LOG_DIR/with run; LOG_DIR/without runs without it. The two run at the same time on a card of at
# least 120 GiB; on a smaller one (an 80 GB H100) sixteen workers run out of memory, so one after the other.
# Prints each run's summary and its failed tests; the exit status is non-zero when either failed.

set -u -o pipefail

if [ $# -ne 2 ]; then
    echo "usage: $0 LOG_DIR SITE" >&2
    exit 2
fi
LOG_DIR="$1"
SITE="$(cd "$2" && pwd)" || exit 2
HERE="$(dirname "$0")"
mkdir -p "$LOG_DIR"
MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
STATUS=0

if [ "${MIB:-0}" -ge $((120 * 1024)) ]; then
    PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" bash "$HERE/run_gpu_suite.sh" "$LOG_DIR/with" > /dev/null 2>&1 &
    with=$!
    sleep 15  # the first run installs the packages where they are missing
    bash "$HERE/run_gpu_suite.sh" "$LOG_DIR/without" > /dev/null 2>&1 || STATUS=1
    wait "$with" || STATUS=1
else
    PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" bash "$HERE/run_gpu_suite.sh" "$LOG_DIR/with" > /dev/null 2>&1 || STATUS=1
    bash "$HERE/run_gpu_suite.sh" "$LOG_DIR/without" > /dev/null 2>&1 || STATUS=1
fi

for run in with without; do
    echo "== $run the libraries"
    grep -v '^logs in' "$LOG_DIR/$run/summary.txt"
    grep -hE '^=+ .* in [0-9.]+s' "$LOG_DIR/$run/gpu_suite.log" 2>/dev/null | tail -1
    grep -hE '^[0-9]+ (passed|failed).* in [0-9.]+s' "$LOG_DIR/$run/conformance.log" 2>/dev/null | tail -1
    grep -ohE '(FAILED|ERROR) tests/[^ ]+' "$LOG_DIR/$run/gpu_suite.log" "$LOG_DIR/$run/conformance.log" 2>/dev/null | sort -u
done
exit $STATUS

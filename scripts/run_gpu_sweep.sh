#!/usr/bin/env bash
# The decode/prefill performance sweep on one CUDA GPU (an H200 for the NVIDIA performance issue).
#
#   bash scripts/run_gpu_sweep.sh OUT_DIR
#
# One process builds random V4-Flash-width weights (4 layers) on the GPU and runs, for the engine configs
# graphs+async, graphs, eager+async, eager and their +fp8 variants: decode at batch 1..256 (prompt 256,
# 64 all-decode steps), prefill of an 8192-token prompt in chunks of 512, 2048 and 8192, and the same
# workloads through transformers on the same weights. Writes under OUT_DIR:
#   sweep.json    every step's figures, the floors, the environment (GPU, versions, copy bandwidth, matmul rate)
#   summary.md    the tables (also at the end of sweep.log)
#   pareto.png    output tokens/s against per-user tokens/s, one line per config and transformers
#   breakdown.png decode step time split into device forward, sampling and other host time
#   sweep.log     stdout and stderr of the sweep;  env.log  nvidia-smi, git revision, versions
# Plots can be redrawn elsewhere: python benchmarks/sweep_gpu.py --plot-only OUT_DIR/sweep.json --out DIR
# Environment: PYTHON (default python3), SWEEP_ARGS (more sweep options, e.g. "--layers 8" or "--no-hf").

set -u -o pipefail

# shellcheck source=scripts/gpu_setup.sh
source "$(dirname "$0")/gpu_setup.sh" "$@"
read -r -a EXTRA <<< "${SWEEP_ARGS:-}"

{
    echo "== date"; date -u
    echo "== git"; git rev-parse HEAD 2>/dev/null; git status --short 2>/dev/null | head -50
    echo "== nvidia-smi"; nvidia-smi 2>&1 || true
    echo "== versions"
    "$PY" -c "import sys, torch, transformers; print('python', sys.version.split()[0]); \
print('torch', torch.__version__, 'cuda', torch.version.cuda); print('transformers', transformers.__version__)"
    "$PY" -c "import triton; print('triton', triton.__version__)" 2>&1
    "$PY" -c "import matplotlib; print('matplotlib', matplotlib.__version__)" 2>&1
} > "$OUT_DIR/env.log" 2>&1

"$PY" benchmarks/sweep_gpu.py --backend nvidia_sm100 --device cuda --dtype bfloat16 --fp8 \
    --configs graphs+async,graphs,eager+async,eager \
    --batch-sizes 1,2,4,8,16,32,64,128,256 --prompt-len 256 --gen-len 64 \
    --chunk-sizes 512,2048,8192 --prefill-len 8192 \
    --out "$OUT_DIR" "${EXTRA[@]}" 2>&1 | tee "$OUT_DIR/sweep.log"
status=${PIPESTATUS[0]}
echo "outputs in $OUT_DIR (exit $status)"
exit "$status"

#!/usr/bin/env bash
# The NVIDIA issues' benchmarks on one CUDA GPU, each step under its own time limit, logs kept.
#
#   bash scripts/run_gpu_benchmarks.sh OUT_DIR
#
# Steps (each writes OUT_DIR/<step>.log and its JSON; OUT_DIR/summary.txt lists each step's exit status,
# 124 where its limit cut it short):
#   fp8_sweep     deepinfer bench --mode sweep, the library set found here (flash_mla+deep_gemm when both
#                 import, else none), bf16 and block FP8, decode at batch 1 and 64, a 4096-token prefill chunk
#   bench_fp8     FP8 GEMM and grouped-MoE kernel times at V4-Flash shapes against bf16 (M = 1, 64, 4096)
#   bench_hc      hc_pre's mixing GEMM, float32 against DeepGEMM's TF32 one
#   spec_sync     speculation off / k=3 / confidence k=3 on the trained model, batch 1 and 64, 256 tokens
#   spec_async    the same with async scheduling
#   spec_gate     off / k=3 / confidence k=3 with async scheduling at batch 1, 8, 32 and 64 in one engine,
#                 the gate's decisions traced and every step logged (issue 15's "never slower at batch 64")
#   spec_waves    spec_gate with four waves of requests, at most a batch at once, their lengths spread by 50%
#                 (every mode's requests end and join at different steps): full batches as in serving, not one
#                 closed batch whose rate ends with its slowest request
#   spec_penalised  off / k=3 with async scheduling, batch 1 and 64, every request with a presence penalty
#                 (its tokens counted on the device, so steps still overlap and chain): against spec_async
#   profile_spec  where a k=3 speculative step's host time goes at batch 1, and the GPU's busy time
#   profile_spec_async  the same with async scheduling
#   profile_spec_confidence  k=3 against confidence k=3 at batch 64, async: the host time confidence scheduling adds
#   profile_fp8   the kernel breakdown of an FP8 decode step at batch 64
#   profile_prefill  the kernel breakdown of a 4096-token prefill chunk, bf16 and FP8
# Environment: PYTHON (default python3), GPU_BENCH_STEPS (the steps to run, in order; default all of the
# above), GPU_BENCH_LIMIT (seconds per step, default 200; a cold DeepGEMM JIT cache makes the first
# library step slow).

set -u -o pipefail

# shellcheck source=scripts/gpu_setup.sh
source "$(dirname "$0")/gpu_setup.sh" "$@"
OUT="$OUT_DIR"
LIMIT="${GPU_BENCH_LIMIT:-200}"
STEPS="${GPU_BENCH_STEPS:-fp8_sweep bench_fp8 bench_hc spec_sync spec_async spec_gate spec_waves spec_penalised profile_spec profile_spec_async profile_spec_confidence profile_fp8 profile_prefill}"
: > "$OUT/summary.txt"
if "$PY" -c "import flash_mla, deep_gemm" 2>/dev/null; then LIBS=flash_mla+deep_gemm; else LIBS=none; fi
SPEC=(benchmarks/bench_spec_decode.py --mode speed --backend nvidia_sm100 --device cuda --ks 3
      --batch-sizes 1,64 --max-tokens 256 --repeats 3)

run() {  # run STEP COMMAND...
    local step="$1"
    shift
    timeout "$LIMIT" "$@" > "$OUT/$step.log" 2>&1
    echo "$step: exit $?" | tee -a "$OUT/summary.txt"
}

for step in $STEPS; do
    case "$step" in
        fp8_sweep) run "$step" "$PY" -m deepinfer_core.entrypoints.cli bench --mode sweep --backend nvidia_sm100 \
                       --libraries "$LIBS" --configs graphs+async --batch-sizes 1,64 --gen-len 16 --warmup-steps 4 \
                       --chunk-sizes 4096 --no-hf --fp8 --out "$OUT/fp8_sweep" ;;
        bench_fp8) run "$step" "$PY" backends/nvidia_sm100/benchmarks/bench_fp8_kernels.py --batches 1,64,4096 \
                       --out "$OUT/bench_fp8.json" ;;
        bench_hc) run "$step" "$PY" backends/nvidia_sm100/benchmarks/bench_hc.py --out "$OUT/bench_hc.json" ;;
        spec_sync) run "$step" "$PY" "${SPEC[@]}" --json-out "$OUT/spec_sync.json" ;;
        spec_async) run "$step" "$PY" "${SPEC[@]}" --async-scheduling --json-out "$OUT/spec_async.json" ;;
        spec_gate) run "$step" "$PY" "${SPEC[@]}" --batch-sizes 1,8,32,64 --modes k=3,confidence --async-scheduling \
                       --gate-trace --step-log --json-out "$OUT/spec_gate.json" ;;
        spec_waves) run "$step" "$PY" "${SPEC[@]}" --batch-sizes 1,8,32,64 --modes k=3,confidence --async-scheduling \
                        --gate-trace --step-log --waves 4 --max-tokens-spread 0.5 --repeats 1 --json-out "$OUT/spec_waves.json" ;;
        spec_penalised) run "$step" "$PY" "${SPEC[@]}" --modes k=3 --async-scheduling --presence-penalty 0.5 \
                            --json-out "$OUT/spec_penalised.json" ;;
        profile_spec) run "$step" "$PY" benchmarks/profile_spec_step.py --backend nvidia_sm100 --device cuda \
                          --ks 3 --batch-sizes 1 --json-out "$OUT/profile_spec.json" ;;
        profile_spec_async) run "$step" "$PY" benchmarks/profile_spec_step.py --backend nvidia_sm100 --device cuda \
                          --ks 3 --batch-sizes 1,64 --async-scheduling --json-out "$OUT/profile_spec_async.json" ;;
        profile_spec_confidence) run "$step" "$PY" benchmarks/profile_spec_step.py --backend nvidia_sm100 \
                          --device cuda --ks 3 --batch-sizes 64 --max-tokens 96 --async-scheduling --confidence \
                          --modes fixed,confidence --json-out "$OUT/profile_spec_confidence.json" ;;
        profile_fp8) run "$step" "$PY" benchmarks/profile_decode.py --fp8 --batch 64 --out "$OUT/profile_fp8" ;;
        profile_prefill) run "$step" bash -c "$PY benchmarks/profile_decode.py --prefill --batch 2 --prompt-len 4096 \
                             --out $OUT/profile_prefill && $PY benchmarks/profile_decode.py --prefill --batch 2 \
                             --prompt-len 4096 --fp8 --out $OUT/profile_prefill" ;;
        *) echo "unknown step $step" | tee -a "$OUT/summary.txt" ;;
    esac
done
echo "logs in $OUT"

"""Decode/prefill sweep of deepinfer engine configs against transformers and the bandwidth/compute floors.

H200 (full sweep):  python benchmarks/sweep_gpu.py --backend nvidia_sm100 --device cuda --out OUT_DIR
CPU smoke test:     python benchmarks/sweep_gpu.py --small --backend cpu_ref --device cpu --batch-sizes 1,2 \
                        --gen-len 6 --prompt-len 16 --chunk-sizes 32,64 --configs eager,eager+async --out OUT_DIR
Redraw the plots:   python benchmarks/sweep_gpu.py --plot-only OUT_DIR/sweep.json
Per library set:    python benchmarks/sweep_gpu.py --libraries none,flash_mla,flash_mla+deep_gemm ... --out OUT_DIR
                    (each set in its own process, the other kernel libraries unimportable there; OUT_DIR/SET/
                    per set, merged into OUT_DIR/libraries.json and OUT_DIR/libraries.md)
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_sweep.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

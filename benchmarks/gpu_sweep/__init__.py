"""GPU performance sweep of the engine: see :mod:`benchmarks.gpu_sweep.cli` (run through
``benchmarks/sweep_gpu.py`` or ``deepinfer bench --mode sweep``)."""

"""Timing of the nvidia backend's kernel benchmarks: device time of one call on a CUDA device."""

from __future__ import annotations

import statistics

import torch


def cuda_time_ms(fn, warmup: int, iters: int, reps: int = 10) -> float:
    """Median device milliseconds of one call. ``reps`` calls are captured in one CUDA graph and each of
    ``iters`` replays is timed with CUDA events, so the host's launch cost, which the engine's graphs remove,
    is not counted. A call that cannot be captured is timed eagerly, ``reps`` calls back to back."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
        run = graph.replay
    except RuntimeError as e:
        print(f"timing {getattr(fn, 'func', fn)} eagerly: it does not capture in a CUDA graph ({e})".splitlines()[0])
        torch.cuda.synchronize()

        def run():
            for _ in range(reps):
                fn()
    run()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return statistics.median(times)

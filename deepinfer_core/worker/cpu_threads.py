"""How many intra-op threads torch runs an engine's CPU ops with (``EngineArgs.cpu_threads``).

torch runs the parallel part of an op on an OpenMP team whose idle members spin-wait for the next
region (libgomp's default policy). A small model's ops take microseconds, less than the team's fork and
join; and on a host whose cores are busy with other processes, a spinning member holds a core another
member (or process) needs, so a step can take 3-27x longer than with one thread. One thread has no
team, hence no spinning. The wait policy cannot help once torch is imported: the OpenMP runtime reads
``OMP_WAIT_POLICY`` only when it starts (export ``OMP_WAIT_POLICY=PASSIVE`` before Python starts to
have sleeping rather than spinning threads with a larger count).
"""

from __future__ import annotations

import logging

import torch

from deepinfer_core.config import ModelConfig

logger = logging.getLogger(__name__)

#: models up to this hidden size run with one thread by default: their ops (a few hundred thousand
#: multiply-adds per token and matrix) are faster on one thread, markedly so on a busy host
SMALL_MODEL_HIDDEN_SIZE = 1024


def cpu_thread_count(requested: int | None, model_config: ModelConfig) -> int | None:
    """The thread count to set: ``requested``; with ``None``, 1 for a small model, else ``None`` (torch's
    own count stays, the physical cores or ``OMP_NUM_THREADS``)."""
    if requested is not None:
        if not isinstance(requested, int) or isinstance(requested, bool) or requested < 1:
            raise ValueError(f"cpu_threads must be an integer >= 1 or None, got {requested!r}")
        return requested
    return 1 if int(model_config.hidden_size) <= SMALL_MODEL_HIDDEN_SIZE else None


def apply_cpu_threads(requested: int | None, model_config: ModelConfig, device: torch.device) -> None:
    """Set torch's intra-op thread count (process-wide, as torch's setting is) where the engine's ops run
    on the CPU; ``requested`` is checked on any device."""
    threads = cpu_thread_count(requested, model_config)
    if device.type != "cpu" or threads is None or threads == torch.get_num_threads():
        return
    logger.info("running CPU ops on %d torch thread(s) instead of %d (cpu_threads=%s)", threads,
                torch.get_num_threads(), "auto" if requested is None else requested)
    torch.set_num_threads(threads)

"""What cpu_ref serves for each catalogued op: the core's native bodies, the catalogue's semantics
written out literally (:mod:`deepinfer_core.ops.native`), float64 kept float64.

cpu_ref adds no bodies of its own here; its reference-only paths are the batch-invariant variants
(:mod:`deepinfer_cpu_ref.batch_invariant`). The names are re-exported so that ``ops.rms_norm`` and
``ALL_OPS[op]`` read as "the reference".
"""

from __future__ import annotations

from deepinfer_core.ops.native import NATIVE_OPS

ALL_OPS = dict(NATIVE_OPS)
globals().update(ALL_OPS)

__all__ = ["ALL_OPS", *ALL_OPS]

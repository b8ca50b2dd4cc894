"""The op catalogue: every op the DeepSeek-V4 model and the sampler call, by name.

Each op is declared once, on its plain-torch body in :mod:`deepinfer_core.ops.native` (``@op``): its
:class:`OpSpec` carries the signature, the reference semantics, the batch-invariance promise, the native
body and whether that body waits for the host. ``deepinfer_cpu_ref`` serves those bodies as the ground
truth that ``deepinfer_core.testing.conformance`` checks other backends against; registration
(:mod:`deepinfer_core.ops.registry`) accepts only catalogued names.
"""

from __future__ import annotations

from deepinfer_core.ops.native import CATALOGUE, OpSpec

__all__ = ["CATALOGUE", "OpSpec"]

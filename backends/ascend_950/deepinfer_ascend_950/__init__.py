"""deepinfer backend for Huawei Ascend 950 NPUs.

Ops: the core's native bodies, ``torch_npu`` fused operators and TileLang-Ascend kernels (TileLang's
``ascend`` target, :mod:`.kernels`), each behind a predicate decided when the engine is built; the NPU
platform (ACL graphs), HCCL and the topology. ``torch_npu``, ``tilelang`` and ``triton`` (Triton-Ascend)
are imported lazily, never when this package is imported, so a host without CANN can still list the
backend. ``torch-npu`` is not a dependency of this distribution; see README.md for how an NPU host
installs it.
"""

NAME = "ascend_950"  # the backend's name: its entry point in ``deepinfer.backends``

"""deepinfer backend for Huawei Ascend 950 NPUs.

This release only registers the backend and probes the machine. ``torch_npu``, ``tilelang`` and
``triton`` (Triton-Ascend) are imported lazily inside the probe, never when this package is imported,
so a host without CANN can still list the backend. ``torch-npu`` is not a dependency of this
distribution; see README.md for how an NPU host installs it.
"""

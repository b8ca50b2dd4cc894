"""deepinfer backend for NVIDIA GPUs of compute capability 9.0 and above (Hopper, Blackwell).

This release only registers the backend and probes the machine: ``deepinfer backends`` reports whether
a suitable GPU is visible and which of the kernel libraries it will use can be imported. The op
implementations (FlashMLA sparse attention, DeepGEMM FP8/FP4 GEMMs, DeepEP dispatch) come later.

FlashMLA, DeepGEMM and DeepEP are not declared as dependencies because their PyPI releases are broken
snapshots; a GPU host builds them from their GitHub sources instead, for example::

    git clone --recursive https://github.com/deepseek-ai/FlashMLA && cd FlashMLA
    pip install --no-build-isolation .

(the same for ``deepseek-ai/DeepGEMM`` and ``deepseek-ai/DeepEP``; see the package README.md).
"""

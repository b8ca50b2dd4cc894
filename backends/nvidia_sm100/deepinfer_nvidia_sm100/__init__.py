"""deepinfer backend for NVIDIA GPUs of compute capability 9.0 and above (Hopper, Blackwell).

Every catalogued op is implemented: Triton kernels for sparse attention, the indexer scores, the
compressor windows, the grouped MoE GEMMs, RMSNorm and RoPE; plain torch (cuBLAS) for the rest; adapters
to FlashMLA (sparse attention) and DeepGEMM (grouped MoE GEMMs) where those libraries are importable and
pass a self-check. ``deepinfer backends`` names the implementation that serves each op on the machine.

FlashMLA, DeepGEMM and DeepEP are not declared as dependencies because their PyPI releases are broken
snapshots; a GPU host builds them from their GitHub sources instead, for example::

    git clone --recursive https://github.com/deepseek-ai/FlashMLA && cd FlashMLA
    pip install --no-build-isolation .

(the same for ``deepseek-ai/DeepGEMM`` and ``deepseek-ai/DeepEP``; see the package README.md).
"""

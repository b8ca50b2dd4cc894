"""Adapters from catalogued ops to ``torch_npu`` fused operators (CANN's AscendC kernels).

Each adapter keeps the catalogue's signature and semantics and calls the fused operator with the layout
its documentation states; a call the operator's documented constraints exclude goes to the native body.
Registered only where the engine's device is an NPU and ``torch_npu`` has the operator
(:mod:`.registration`). The semantics of the operators are taken from torch_npu's documentation and
checked here against fakes that implement that documentation; they were never run on an Ascend 950.
"""

from __future__ import annotations

import torch

from deepinfer_core.ops import native


def _torch_npu():
    import torch_npu

    return torch_npu


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``torch_npu.npu_rms_norm(x, gamma, epsilon) -> (y, rstd)``: float32 inside, y in x.dtype."""
    gamma = weight.to(x.dtype) if weight is not None else torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    return _torch_npu().npu_rms_norm(x, gamma, epsilon=eps)[0]


#: npu_rotary_mul: 4-D input, B * N < 1000, D < 896 and even (torch_npu's documented constraints)
ROTARY_MAX_BN, ROTARY_MAX_D = 1000, 896


def rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Interleaved RoPE on the trailing ``R = 2 cos.shape[-1]`` channels through
    ``npu_rotary_mul(x [1, T, H, R], cos, sin [1, T, 1, R], rotary_mode="interleave")``, which computes
    ``x * r1 + rotate_interleaved(x) * r2`` with ``rotate_interleaved(x) = (-x1, x0, -x3, x2, ...)``."""
    t, h, d = x.shape
    rope = 2 * cos.shape[-1]
    if h >= ROTARY_MAX_BN or rope >= ROTARY_MAX_D or t == 0:
        return native.rotary_emb(x, cos, sin, inverse)
    r1 = cos.to(x.dtype).repeat_interleave(2, dim=-1).view(1, t, 1, rope)
    r2 = sin.to(x.dtype).repeat_interleave(2, dim=-1).view(1, t, 1, rope)
    if inverse:
        r2 = -r2
    rotated = _torch_npu().npu_rotary_mul(x[..., d - rope :].unsqueeze(0).contiguous(), r1, r2,
                                          rotary_mode="interleave")
    return torch.cat([x[..., : d - rope], rotated.squeeze(0)], dim=-1)


def swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """DeepSeek's clamp, then ``npu_swiglu(x, dim=-1) = silu(first half) * second half``."""
    gate, up = gate_up.chunk(2, dim=-1)
    clamped = torch.cat([gate.clamp(max=limit), up.clamp(min=-limit, max=limit)], dim=-1)
    return _torch_npu().npu_swiglu(clamped, dim=-1)


#: catalogued op -> (adapter, the torch_npu operator it needs)
ALL_OPS = {
    "rms_norm": (rms_norm, "npu_rms_norm"),
    "rotary_emb": (rotary_emb, "npu_rotary_mul"),
    "swiglu": (swiglu, "npu_swiglu"),
}

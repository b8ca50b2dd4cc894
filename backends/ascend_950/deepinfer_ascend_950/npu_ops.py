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


#: npu_moe_gating_top_k: at most 2048 experts; norm_type 1 = sigmoid (then y / (sum y + eps)), 0 = softmax
GATING_MAX_EXPERTS = 2048
_NORM_TYPE = {"sigmoid": 1, "softmax": 0}


def moe_route(logits: torch.Tensor, scoring_func: str, top_k: int, correction_bias: torch.Tensor | None,
              fixed_ids: torch.Tensor | None, routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``npu_moe_gating_top_k(x, k, bias=, group_count=1, norm_type=, routed_scaling_factor=, eps=1e-20)``
    in float32: the score function, the stable top-k of scores + bias and the weights of the picks. Its
    softmax mode does not renormalise the picks, so that is done here; ``sqrtsoftplus`` (V4's own) and
    hash routing (``fixed_ids``) have no fused operator and stay native."""
    t, experts = logits.shape
    if fixed_ids is not None or scoring_func not in _NORM_TYPE or experts > GATING_MAX_EXPERTS or t == 0:
        return native.moe_route(logits, scoring_func, top_k, correction_bias, fixed_ids, routed_scaling_factor)
    softmax = scoring_func == "softmax"
    bias = correction_bias.to(torch.float32) if correction_bias is not None else None
    y, ids, _ = _torch_npu().npu_moe_gating_top_k(
        logits.to(torch.float32), top_k, bias=bias, k_group=1, group_count=1, group_select_mode=0, renorm=0,
        norm_type=_NORM_TYPE[scoring_func], out_flag=False,
        routed_scaling_factor=1.0 if softmax else routed_scaling_factor, eps=1e-20)
    if softmax:
        y = y / (y.sum(dim=-1, keepdim=True) + 1e-20) * routed_scaling_factor
    return y.to(logits.dtype), ids.long()


def _sorted_pairs(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(flat pair ids sorted by expert, invalid ones last; their validity; tokens per expert), all on the
    device: nothing is read back, so the step stays capturable in a graph."""
    flat = topk_ids.reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, torch.full_like(flat, num_experts))
    order = torch.sort(key, stable=True).indices
    ones = torch.ones_like(key)  # not bincount: its output size depends on the data, so it syncs
    counts = torch.zeros(num_experts + 1, dtype=key.dtype, device=key.device).scatter_add_(0, key, ones)[:num_experts]
    return order, valid[order], counts


def _grouped(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``y[rows of group e] = x[rows] @ weight[e]^T`` through ``npu_grouped_matmul`` (one x, one
    ``[E, K, N]`` weight, one y; ``group_list`` holds the row count of each group, ``group_list_type=1``);
    rows past the last group are not computed."""
    return _torch_npu().npu_grouped_matmul([x], [weight.transpose(1, 2)], group_list=counts, split_item=3,
                                           group_type=0, group_list_type=1)[0]


def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor, swiglu_limit: float) -> torch.Tensor:
    """The (token, expert) pairs sorted by expert on the device, both projections as one grouped matmul
    each, DeepSeek's clamped SwiGLU between them, the weighted rows added back to their tokens."""
    k = topk_ids.shape[-1]
    out = torch.zeros_like(x)
    if topk_ids.numel() == 0:
        return out
    order, valid, counts = _sorted_pairs(topk_ids, w13.shape[0])
    tokens = order // k
    h = native.swiglu(_grouped(x[tokens], w13, counts), swiglu_limit)
    y = _grouped(h, w2, counts) * topk_weights.reshape(-1)[order, None].to(x.dtype)
    y = torch.where(valid.unsqueeze(-1), y, torch.zeros((), dtype=y.dtype, device=y.device))
    return out.index_add_(0, tokens, y)


#: catalogued op -> (adapter, the torch_npu operator it needs)
ALL_OPS = {
    "rms_norm": (rms_norm, "npu_rms_norm"),
    "rotary_emb": (rotary_emb, "npu_rotary_mul"),
    "swiglu": (swiglu, "npu_swiglu"),
    "moe_route": (moe_route, "npu_moe_gating_top_k"),
    "moe_experts": (moe_experts, "npu_grouped_matmul"),
}

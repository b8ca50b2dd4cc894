"""Expert-parallel dispatch and combine through DeepEP's ``deep_ep.Buffer`` (intranode, NVLink).

The same protocol as :class:`deepinfer_core.parallel.ep.AllToAllDispatcher` (one row per (token, expert)
pair comes back from ``dispatch``; the model multiplies each row by its weight; ``combine`` sums a token's
rows home), so the model's MoE runs unchanged:

* normal mode (prefill, any batch): ``get_dispatch_layout`` + ``Buffer.dispatch`` send each token once
  to every rank holding one of its experts; the rank expands its received tokens into pairs (local expert
  ids, -1 for experts elsewhere, are DeepEP's); ``combine`` sums a received token's pairs, then
  ``Buffer.combine`` (unweighted) sums the ranks' partial outputs home. DeepEP's intranode kernels exist
  for 2, 4 and 8 ranks: with one rank the pairs stay local (no kernel runs).
* low-latency mode (decode; no host sync, the layout CUDA graphs need): ``low_latency_dispatch`` gives
  ``[local experts, max tokens * ranks, hidden]`` with per-expert counts; rows past the counts go out with
  expert id -1, which the expert ops skip (their work follows the tokens received, not the layout), and
  ``low_latency_combine`` reduces with the top-k weights, so the rows go out with weight one. DeepEP
  supports a few hidden sizes here (2048, 4096, 7168, ...).

Activations must be bfloat16 (DeepEP's format); EPLB's slot map is applied as in the all-to-all
dispatcher. ``deep_ep`` is imported only when a dispatcher is built.

Three modes, fixed for the engine's lifetime (every rank must run the same kernels in a layer):
``"normal"`` (every step eagerly: an engine with it runs without decode graphs), ``"low_latency"`` (every
step, graphs included; a step may carry at most ``max_dispatch_tokens_per_rank`` tokens a rank) and
``"auto"`` (SGLang's: normal eagerly, low latency inside :meth:`graph_shapes`, the decode graphs' forward,
which every rank enters for the same step; one buffer sized for both). Decode graphs are captured at most
``max_graph_tokens`` tokens a rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer_core.parallel.expert_map import ExpertMap
from deepinfer_core.parallel.fixed_shapes import FixedShapeCollective

MODES = ("normal", "low_latency", "auto")


def deep_ep_available() -> bool:
    try:
        import deep_ep  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class _NormalHandle:
    deep_ep_handle: Any
    token_of_pair: torch.Tensor  # received token of each dispatched pair
    num_recv_tokens: int


@dataclass
class _LowLatencyHandle:
    deep_ep_handle: Any
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    shape: tuple[int, int, int]  # local experts, rows per expert, hidden


class DeepEPDispatcher(FixedShapeCollective):
    """``deep_ep.Buffer`` over the communicator's (NCCL) group, in one of :data:`MODES` (see the module)."""

    expert_map: ExpertMap | None = None
    layer: int | None = None

    def __init__(self, communicator: Any, num_experts: int, hidden_size: int, mode: str = "normal",
                 max_dispatch_tokens_per_rank: int = 128):
        import deep_ep

        if mode not in MODES:
            raise ValueError(f"unknown DeepEP mode {mode!r}; expected one of {MODES}")
        group = communicator.group
        if group is None:
            raise ValueError("DeepEP needs a torch.distributed process group")
        world = communicator.world_size
        if num_experts % world:
            raise ValueError(f"{num_experts} routed experts cannot be split evenly over {world} ranks")
        self.comm, self.num_experts, self.hidden_size = communicator, num_experts, hidden_size
        self.world, self.rank = world, communicator.rank
        self.experts_per_rank = num_experts // world
        self.mode, self.max_tokens = mode, max_dispatch_tokens_per_rank
        self.topk_idx_t = deep_ep.topk_idx_t
        nvl = rdma = 0
        # a normal-mode Buffer of one rank aborts the process (measured on an H200): one rank's pairs stay local
        if mode != "low_latency" and world > 1:
            self.dispatch_config = deep_ep.Buffer.get_dispatch_config(world)
            self.combine_config = deep_ep.Buffer.get_combine_config(world)
            hidden_bytes = hidden_size * 2  # bfloat16
            for config in (self.dispatch_config, self.combine_config):
                nvl = max(config.get_nvl_buffer_size_hint(hidden_bytes, world), nvl)
                rdma = max(config.get_rdma_buffer_size_hint(hidden_bytes, world), rdma)
        if mode == "normal":
            self.buffer = deep_ep.Buffer(group, nvl, rdma) if world > 1 else None
            return
        rdma = max(rdma, deep_ep.Buffer.get_low_latency_rdma_size_hint(max_dispatch_tokens_per_rank, hidden_size,
                                                                        world, num_experts))
        self.buffer = deep_ep.Buffer(group, nvl, rdma, low_latency_mode=True, num_qps_per_rank=self.experts_per_rank)

    @property
    def local_experts(self) -> range:
        return range(self.rank * self.experts_per_rank, (self.rank + 1) * self.experts_per_rank)

    @property
    def low_latency(self) -> bool:
        """Whether a dispatch now runs the low-latency kernels."""
        return self.mode == "low_latency" or (self.mode == "auto" and self.fixed_shapes)

    @property
    def graph_safe(self) -> bool:
        """Whether dispatch and combine can be captured in a decode graph (not in normal mode)."""
        return self.mode != "normal"

    @property
    def max_graph_tokens(self) -> int | None:
        """The most tokens a rank's decode graph may carry (the low-latency buffers' capacity)."""
        return None if self.mode == "normal" else self.max_tokens

    @contextmanager
    def graph_shapes(self) -> Iterator[None]:
        """A decode graph's forward: the low-latency kernels (their shapes are fixed)."""
        if self.mode == "normal":
            raise RuntimeError("DeepEP's normal mode cannot run inside a graph (DEEPINFER_DEEPEP_MODE=auto or "
                               "low_latency)")
        with super().graph_shapes():
            yield

    def _slots(self, topk_ids: torch.Tensor) -> torch.Tensor:
        if self.expert_map is None:
            return topk_ids.to(self.topk_idx_t)
        return self.expert_map.physical(self.layer, topk_ids).view(topk_ids.shape).to(self.topk_idx_t)

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
        """``(rows, local slot of each row, weight of each row, handle)`` (``topk_ids``: logical experts)."""
        if x.dtype != torch.bfloat16:
            raise ValueError(f"DeepEP dispatches bfloat16 activations, got {x.dtype}")
        idx, weights = self._slots(topk_ids), topk_weights.float()
        if self.low_latency:
            return self._dispatch_low_latency(x, idx, weights)
        if self.world == 1:  # no intranode kernel for one rank: the pairs are this rank's already
            recv_x, recv_idx, recv_w, handle = x, idx, weights, None
        else:
            per_rank, per_rdma, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(idx, self.num_experts)
            recv_x, recv_idx, recv_w, _, handle, _ = self.buffer.dispatch(
                x, topk_idx=idx, topk_weights=weights, num_tokens_per_rank=per_rank,
                num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                config=self.dispatch_config)
        token, k = torch.nonzero(recv_idx >= 0, as_tuple=True)
        rows = recv_x[token]
        return rows, recv_idx[token, k].long(), recv_w[token, k], _NormalHandle(handle, token, recv_x.shape[0])

    def _dispatch_low_latency(self, x, idx, weights):
        if x.shape[0] > self.max_tokens:  # a static shape: also checked when a graph is captured
            raise ValueError(f"DeepEP low-latency dispatch takes at most {self.max_tokens} tokens per rank, got "
                             f"{x.shape[0]} (DEEPINFER_DEEPEP_MODE=auto runs eager steps in normal mode, or a "
                             "smaller max_num_batched_tokens)")
        recv_x, counts, handle, _, _ = self.buffer.low_latency_dispatch(
            x, idx, self.max_tokens, self.num_experts, use_fp8=False, async_finish=False, return_recv_hook=False)
        local, per_expert, hidden = recv_x.shape
        # rows past an expert's received count carry id -1: the expert ops skip them (combine never reads them)
        row = torch.arange(per_expert, device=x.device)
        expert = torch.arange(local, device=x.device).unsqueeze(1)
        ids = torch.where(row < counts.unsqueeze(1), expert, -1).reshape(-1)
        ones = torch.ones(local * per_expert, dtype=torch.float32, device=x.device)  # combine weighs
        return (recv_x.view(local * per_expert, hidden), ids, ones,
                _LowLatencyHandle(handle, idx, weights, (local, per_expert, hidden)))

    def combine(self, y: torch.Tensor, handle: Any) -> torch.Tensor:
        """Weighted rows ``y`` (as dispatched) summed back per home token: [T, hidden]."""
        if isinstance(handle, _LowLatencyHandle):
            out, _, _ = self.buffer.low_latency_combine(y.view(handle.shape).contiguous(), handle.topk_idx,
                                                        handle.topk_weights, handle.deep_ep_handle,
                                                        async_finish=False, return_recv_hook=False)
            return out
        per_token = y.new_zeros((handle.num_recv_tokens, y.shape[-1]))
        per_token.index_add_(0, handle.token_of_pair, y)
        if handle.deep_ep_handle is None:
            return per_token
        out, _, _ = self.buffer.combine(per_token, handle.deep_ep_handle, config=self.combine_config)
        return out

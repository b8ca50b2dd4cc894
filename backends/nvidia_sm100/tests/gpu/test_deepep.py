"""DeepEP's Buffer behind the expert-parallel dispatcher protocol, on one GPU (world size 1: its
multi-GPU run is a separate issue). Normal mode: dispatch/combine (local with one rank: DeepEP's
intranode kernels need 2+) give the MoE of one process; low-latency mode: DeepEP's kernels run for real
on one rank and give it too, captured in a CUDA graph as eagerly; auto mode (the default): normal eagerly,
low latency inside ``graph_shapes``. Skipped where deep_ep is not importable."""

from __future__ import annotations

import importlib.util
import os
import socket

import pytest
import torch
import torch.distributed as dist
from gpu_support import gpu_marks

pytestmark = [*gpu_marks(), pytest.mark.skipif(importlib.util.find_spec("deep_ep") is None,
                                                reason="deep_ep is not installed")]

E, K, H, T = 8, 2, 4096, 24  # low-latency kernels exist for a few hidden sizes (4096 among them)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def communicator():
    from deepinfer_core.comm import TorchDistributedCommunicator

    torch.cuda.set_device(0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield TorchDistributedCommunicator(dist.group.WORLD)
    dist.destroy_process_group()


def _expert(e: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x.float() * (e.unsqueeze(1).float() + 1) / 8) + e.unsqueeze(1).float()


def _routing():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=gen).to("cuda", torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).cuda()
    w = torch.rand(T, K, generator=gen).cuda()
    return x, ids, w


def _reference(x, ids, w) -> torch.Tensor:
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for k in range(K):
        out += w[:, k:k + 1] * _expert(ids[:, k], x)
    return out


def _round_trip(disp, x, ids, w) -> torch.Tensor:
    rows, local, weights, handle = disp.dispatch(x, ids, w)
    y = (weights.unsqueeze(1) * _expert(local + disp.local_experts.start, rows)).to(torch.bfloat16)
    return disp.combine(y, handle).float()


def test_hook_builds_deepep_in_auto_mode_normal_eagerly_low_latency_in_graphs(communicator):
    """The default mode (SGLang's ``auto``): eager steps take the normal path (any token count), a decode
    graph's forward the low-latency kernels; both give the MoE of one process."""
    from deepinfer_nvidia_sm100.deepep import DeepEPDispatcher

    from deepinfer_core.plugins import load_backend

    disp = load_backend("nvidia_sm100").hook.deepinfer_make_ep_dispatcher(
        communicator=communicator, num_experts=E, hidden_size=H)
    assert isinstance(disp, DeepEPDispatcher) and disp.mode == "auto" and disp.local_experts == range(E)
    assert not disp.low_latency and disp.graph_safe and disp.max_graph_tokens == 128
    x, ids, w = _routing()
    torch.testing.assert_close(_round_trip(disp, x, ids, w), _reference(x, ids, w), rtol=2e-2, atol=5e-2)
    big = torch.randn(300, H, device="cuda").to(torch.bfloat16)  # past the low-latency capacity: normal mode
    big_ids, big_w = torch.randint(0, E, (300, K), device="cuda"), torch.rand(300, K, device="cuda")
    torch.testing.assert_close(_round_trip(disp, big, big_ids, big_w), _reference(big, big_ids, big_w),
                               rtol=2e-2, atol=5e-2)
    with disp.graph_shapes():
        assert disp.low_latency
        rows, local, weights, handle = disp.dispatch(x, ids, w)
        assert rows.shape == (E * 128, H)  # the low-latency layout
        got = disp.combine((weights.unsqueeze(1) * _expert(local, rows)).to(torch.bfloat16), handle).float()
    torch.cuda.synchronize()
    assert not disp.low_latency
    torch.testing.assert_close(got, _reference(x, ids, w), rtol=2e-2, atol=5e-2)
    with pytest.raises(ValueError, match="bfloat16"):
        disp.dispatch(x.float(), ids, w)


def test_normal_mode_runs_eagerly_only(communicator):
    from deepinfer_nvidia_sm100.deepep import DeepEPDispatcher

    disp = DeepEPDispatcher(communicator, E, H, mode="normal")
    assert not disp.graph_safe and disp.max_graph_tokens is None
    x, ids, w = _routing()
    torch.testing.assert_close(_round_trip(disp, x, ids, w), _reference(x, ids, w), rtol=2e-2, atol=5e-2)
    with pytest.raises(RuntimeError, match="cannot run inside a graph"), disp.graph_shapes():
        pass
    with pytest.raises(ValueError, match="unknown DeepEP mode"):
        DeepEPDispatcher(communicator, E, H, mode="fast")


def test_low_latency_mode_runs_deepep_kernels_on_one_rank(communicator):
    from deepinfer_nvidia_sm100.deepep import DeepEPDispatcher

    disp = DeepEPDispatcher(communicator, E, H, mode="low_latency", max_dispatch_tokens_per_rank=128)
    x, ids, w = _routing()
    rows, local, weights, handle = disp.dispatch(x, ids, w)  # DeepEP holds at most two results at a time
    assert rows.shape == (E * 128, H) and bool((weights == 1).all())
    # rows past each expert's received count are marked -1 (the expert ops skip them): one row a pair
    assert int((local >= 0).sum()) == T * K
    assert torch.equal(torch.bincount(local[local >= 0], minlength=E), torch.bincount(ids.reshape(-1), minlength=E))
    y = (weights.unsqueeze(1) * _expert(local, rows)).to(torch.bfloat16)
    got = disp.combine(y, handle).float()
    torch.cuda.synchronize()
    torch.testing.assert_close(got, _reference(x, ids, w), rtol=2e-2, atol=5e-2)


def test_low_latency_round_trip_captured_in_a_cuda_graph_equals_eager(communicator):
    """Decode graphs capture dispatch, the experts and combine once and replay them on new tokens and
    routes in the same buffers: each replay equals the eager round trip on the same inputs."""
    from deepinfer_nvidia_sm100.deepep import DeepEPDispatcher

    disp = DeepEPDispatcher(communicator, E, H, mode="low_latency", max_dispatch_tokens_per_rank=128)
    assert disp.graph_safe
    x, ids, w = _routing()
    static = (x.clone(), ids.clone(), w.clone())
    for _ in range(2):  # warm up on a side stream, as CUDA graph capture asks
        _round_trip(disp, *static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with disp.graph_shapes(), torch.cuda.graph(graph):
        out = _round_trip(disp, *static)
    for seed in range(3):
        gen = torch.Generator().manual_seed(10 + seed)
        new_x = torch.randn(T, H, generator=gen).to("cuda", torch.bfloat16)
        new_ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).cuda()
        new_w = torch.rand(T, K, generator=gen).cuda()
        for buf, new in zip(static, (new_x, new_ids, new_w)):
            buf.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        replayed = out.clone()
        eager = _round_trip(disp, new_x, new_ids, new_w)
        torch.cuda.synchronize()
        assert torch.equal(replayed, eager)
        torch.testing.assert_close(replayed, _reference(new_x, new_ids, new_w), rtol=2e-2, atol=5e-2)

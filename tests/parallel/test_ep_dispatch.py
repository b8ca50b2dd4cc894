"""Expert-parallel dispatch/combine over torch.distributed (gloo, two processes) equals the MoE computed
on one process, for uneven routing (some ranks receive nothing from some peers)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist

from deepinfer_core.comm import TorchDistributedCommunicator
from deepinfer_core.parallel.dp_engine_core import rank_start_context
from deepinfer_core.parallel.ep import AllToAllDispatcher

E, H, K = 8, 16, 3


def _expert(e: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x * (e.unsqueeze(1).to(x.dtype) + 1)) + e.unsqueeze(1).to(x.dtype)


def _routing(rank: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, H, generator=gen, dtype=torch.float64)
    if rank == 1:  # rank 1 routes only to rank 0's experts
        ids = torch.stack([torch.randperm(E // 2, generator=gen)[:K] for _ in range(tokens)])
    else:
        ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(tokens)])
    w = torch.rand(tokens, K, generator=gen, dtype=torch.float64)
    return x, ids, w


def reference(x, ids, w) -> torch.Tensor:
    out = torch.zeros_like(x)
    for k in range(ids.shape[1]):
        out += w[:, k : k + 1] * _expert(ids[:, k], x)
    return out


def _worker(rank: int, world: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from deepinfer_core.plugins import load_backend

        hook = load_backend("cpu_ref").hook
        comm = hook.deepinfer_make_communicator(group=None, device=torch.device("cpu"))
        disp = hook.deepinfer_make_ep_dispatcher(communicator=comm, num_experts=E, hidden_size=H)
        assert isinstance(disp, AllToAllDispatcher) and comm.world_size == world
        x, ids, w = _routing(rank, 5 + 3 * rank)
        recv_x, local_ids, recv_w, handle = disp.dispatch(x, ids, w)
        assert bool(((local_ids >= 0) & (local_ids < E // world)).all())
        y = recv_w.unsqueeze(1) * _expert(local_ids + disp.local_experts.start, recv_x)
        out = disp.combine(y, handle)
        queue.put((rank, torch.allclose(out, reference(x, ids, w), rtol=0, atol=1e-12), len(recv_x)))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_hook_make_ep_dispatcher_all_to_all_matches_one_process():
    ctx = rank_start_context()
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert [ok for _, ok, _ in results] == [True, True]
    assert results[0][2] > results[1][2]  # rank 0 computed more rows: rank 1 sent it everything


def test_one_rank_dispatch_is_the_local_moe():
    comm = TorchDistributedCommunicator(None)
    disp = AllToAllDispatcher(comm, E, H)
    x, ids, w = _routing(0, 7)
    recv_x, local_ids, recv_w, handle = disp.dispatch(x, ids, w)
    out = disp.combine(recv_w.unsqueeze(1) * _expert(local_ids, recv_x), handle)
    torch.testing.assert_close(out, reference(x, ids, w), rtol=0, atol=1e-12)


def test_uneven_expert_split_is_refused():
    comm = TorchDistributedCommunicator(None)
    comm.world_size = 3
    with pytest.raises(ValueError, match="cannot be split evenly over 3 ranks"):
        AllToAllDispatcher(comm, E, H)

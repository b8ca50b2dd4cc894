"""The backend's non-op hooks on a real GPU: device, topology, NCCL communicator, environment report."""

from __future__ import annotations

import pytest
import torch
from gpu_support import BACKEND, gpu_marks

from deepinfer_core.comm import Communicator
from deepinfer_core.plugins import load_backend

pytestmark = gpu_marks()


def _hook():
    return load_backend(BACKEND).hook


def test_init_device_is_the_local_rank_gpu():
    device = _hook().deepinfer_init_device(local_rank=0)
    assert device == torch.device("cuda", 0)
    assert torch.cuda.current_device() == 0


def test_topology_lists_every_visible_gpu():
    topo = _hook().deepinfer_discover_topology()
    count = torch.cuda.device_count()
    assert [d.index for d in topo.devices] == list(range(count))
    for dev in topo.devices:
        assert dev.kind.startswith("cuda (") and torch.cuda.get_device_name(dev.index) in dev.kind
        assert isinstance(dev.numa_node, int) and dev.numa_node >= -1
        assert dev.index not in dev.peers and all(0 <= p < count for p in dev.peers)
    plan = _hook().deepinfer_plan_parallel(topology=topo, parallel_config=None)
    assert plan.device_of_rank == {0: 0}


def test_nccl_communicator_single_rank(tmp_path):
    import torch.distributed as dist

    assert dist.is_nccl_available()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        comm = _hook().deepinfer_make_communicator(group=dist.group.WORLD, device=torch.device("cuda", 0))
        assert isinstance(comm, Communicator) and (comm.rank, comm.world_size) == (0, 1)
        t = torch.arange(4.0, device="cuda")
        assert torch.equal(comm.all_reduce(t), torch.arange(4.0, device="cuda"))
        assert comm.all_gather(t).shape == (1, 4)
        comm.barrier()
    finally:
        dist.destroy_process_group()


def test_details_and_env_name_the_device_and_each_op():
    from deepinfer_core.ops.catalogue import CATALOGUE

    info = load_backend(BACKEND).info
    assert info.is_available() == (True, "")
    details = info.details()
    assert details["compute_capability"] == ".".join(map(str, torch.cuda.get_device_capability()))
    for op in CATALOGUE:
        assert details[f"op.{op}"] in ("torch", "triton") or "self-check" in details[f"op.{op}"], op
    assert details["op.sparse_attention"].split()[0] in ("triton", "flash_mla")
    env = {}
    for part in _hook().deepinfer_collect_env():
        env.update(part)
    assert "nccl" in env and "cuda_devices" in env


def _two_rank_worker(rank: int, store_path: str, results: dict) -> None:
    import torch.distributed as dist

    hook = load_backend(BACKEND).hook
    device = hook.deepinfer_init_device(local_rank=rank)
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=2, device_id=device)
    try:
        comm = hook.deepinfer_make_communicator(group=dist.group.WORLD, device=device)
        total = comm.all_reduce(torch.full((3,), float(rank + 1), device=device))
        gathered = comm.all_gather(torch.tensor([rank], device=device))
        src = comm.broadcast(torch.tensor([rank * 10], device=device), src=1)
        comm.barrier()
        results[rank] = (comm.rank, comm.world_size, total.tolist(), gathered.flatten().tolist(), src.item())
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_nccl_communicator_two_ranks(tmp_path):
    """One process per GPU: init_device picks the rank's GPU, collectives give the right values."""
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_two_rank_worker, args=(str(tmp_path / "store"), results), nprocs=2, join=True)
        got = dict(results)
    for rank in (0, 1):
        assert got[rank] == (rank, 2, [3.0, 3.0, 3.0], [0, 1], 10)
    topo = _hook().deepinfer_discover_topology()
    assert len(topo.devices) == torch.cuda.device_count()

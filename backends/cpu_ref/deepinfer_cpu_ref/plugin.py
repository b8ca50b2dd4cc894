"""Hook implementations of the cpu_ref backend."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import torch

from deepinfer_core.comm import TorchDistributedCommunicator
from deepinfer_core.hookspecs import BackendInfo, hookimpl
from deepinfer_core.ops import native
from deepinfer_core.topology import plan_single_host, single_host_cpu_topology
from deepinfer_cpu_ref import batch_invariant

NAME = "cpu_ref"
#: the reference: the core's native bodies
REFERENCE_PRIORITY = 0
#: the batch-invariant variants: above the reference, and only in batch-invariant mode
BATCH_INVARIANT_PRIORITY = 1


def _batch_invariant_mode(ctx) -> bool:
    return bool(getattr(ctx, "batch_invariant", False))


def _version() -> str:
    try:
        return version("deepinfer-cpu-ref")
    except PackageNotFoundError:
        return "0+unknown"


@hookimpl
def deepinfer_backend_info():
    return BackendInfo(
        name=NAME,
        device_type="cpu",
        version=_version(),
        is_available=lambda: (True, ""),
        details=lambda: {"torch": torch.__version__, "threads": str(torch.get_num_threads())},
    )


@hookimpl
def deepinfer_register_ops(registry, backend):
    if backend.name != NAME:
        return
    native.register(registry, priority=REFERENCE_PRIORITY)
    for name, fn in batch_invariant.ALL_OPS.items():
        registry.register(name, fn, priority=BATCH_INVARIANT_PRIORITY, predicate=_batch_invariant_mode,
                          batch_invariant=True, syncs_host=name in native.SYNCS_HOST)  # the MoE loops


@hookimpl
def deepinfer_init_device(local_rank):
    return torch.device("cpu")


@hookimpl
def deepinfer_make_communicator(group, device):
    return TorchDistributedCommunicator(group)


@hookimpl
def deepinfer_make_ep_dispatcher(communicator, num_experts, hidden_size):
    """all_to_all over the communicator's group (DeepEP comes with the expert-parallel work)."""
    from deepinfer_core.parallel.ep import AllToAllDispatcher

    return AllToAllDispatcher(communicator, num_experts, hidden_size)


@hookimpl
def deepinfer_discover_topology():
    return single_host_cpu_topology()


@hookimpl
def deepinfer_plan_parallel(topology, parallel_config):
    return plan_single_host(
        topology,
        getattr(parallel_config, "data_parallel_size", 1),
        getattr(parallel_config, "expert_parallel_size", 1),
    )


@hookimpl
def deepinfer_collect_env():
    return {"torch": torch.__version__, "cpu_threads": str(torch.get_num_threads())}

"""Hook implementations of the ascend_950 backend: its info (the availability probe is
:func:`.npu.is_available`), ops, NPU device and platform, HCCL, topology.

Ops (:mod:`.registration`): the core's native body for every op, ``torch_npu`` fused operators where one
exists, TileLang-Ascend kernels for the DeepSeek-V4-specific ones, each behind a predicate decided once
when the engine is built. Nothing NPU-specific is imported at module import: ``torch_npu``, ``tilelang``
and Triton-Ascend are imported only inside ``is_available()``/``details()`` or when an engine is built,
after the probe has checked that the CANN toolkit is there (importing ``torch_npu`` without CANN fails,
and importing it at all initialises the NPU runtime).
"""

from __future__ import annotations

import glob
import os
from importlib.metadata import PackageNotFoundError, version

from deepinfer_ascend_950 import NAME
from deepinfer_ascend_950.npu import cann_version, find_bisheng, find_cann, import_torch_npu, is_available
from deepinfer_core.hookspecs import BackendInfo, hookimpl
from deepinfer_core.plugins import probe_library

DISTRIBUTION = "deepinfer-ascend-950"
DEVICE_NODES = "/dev/davinci[0-9]*"  # one per NPU, created by the Ascend driver
# module name -> distribution names that may carry its version when the module has no __version__
KERNEL_LIBRARIES: dict[str, tuple[str, ...]] = {
    "tilelang": ("tilelang",),
    "triton": ("triton-ascend", "triton"),
}


def _version() -> str:
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return "0+unknown"


def details() -> dict[str, str]:
    """CANN, torch_npu, TileLang and Triton-Ascend versions (or why missing) and the NPU, if any."""
    out: dict[str, str] = {}
    home = find_cann()
    out["cann"] = f"{cann_version(home)} at {home}" if home else "missing: toolkit not found"
    torch, reason = import_torch_npu()
    if torch is None:
        out["torch_npu"] = f"missing: {reason}"
    else:
        out["torch_npu"] = probe_library("torch_npu", ("torch-npu", "torch_npu"))
        try:
            if torch.npu.is_available():
                device = torch.npu.current_device()
                out["npu_device"] = f"{device}: {torch.npu.get_device_name(device)}"
                out["npu_device_count"] = str(torch.npu.device_count())
            else:
                out["npu_device"] = "missing: torch.npu.is_available() is False"
        except Exception as exc:
            out["npu_device"] = f"probe failed: {type(exc).__name__}: {exc}"
    if "npu_device" not in out:  # no torch_npu to ask: the driver's device nodes say whether there is an NPU
        nodes = sorted(glob.glob(DEVICE_NODES))
        out["npu_device"] = (f"{len(nodes)} Ascend device node(s) ({', '.join(nodes)}); the chip is unknown "
                             "without torch_npu" if nodes else "missing: no Ascend NPU (no /dev/davinci* device node)")
    for module, dists in KERNEL_LIBRARIES.items():
        out[module] = probe_library(module, dists)
    out["bisheng"] = find_bisheng() or "missing: not in BISHENG_HOME/bin or PATH (CANN's compiler)"
    out["ops"] = ("deepinfer ops --backend ascend_950 --dry-run (python -m deepinfer_ascend_950.dry_run): which "
                  "implementation serves each op here and on an NPU")
    return out


def dry_run_plans(dtype=None) -> dict[str, dict[str, str]]:
    """``deepinfer ops --dry-run``: ``{"here": op -> implementation, "npu": ...}``, nothing run."""
    import torch

    from deepinfer_ascend_950 import dry_run

    return dry_run.plans(dtype or torch.bfloat16)


@hookimpl
def deepinfer_backend_info():
    return BackendInfo(
        name=NAME,
        device_type="npu",
        version=_version(),
        is_available=is_available,
        details=details,
    )


@hookimpl
def deepinfer_register_ops(registry, backend):
    if backend.name != NAME:
        return
    from deepinfer_ascend_950.registration import register_all

    register_all(registry)


def npu_device(index: int):
    import torch

    return torch.device("npu", index)


@hookimpl
def deepinfer_init_device(local_rank):
    """The NPU of ``local_rank``, made current; a clear error when there is none."""
    torch, reason = import_torch_npu()
    if torch is None:
        raise RuntimeError(f"backend {NAME!r} cannot select an NPU for local rank {local_rank}: {reason}")
    npu = getattr(torch, "npu", None)
    count = npu.device_count() if npu is not None and npu.is_available() else 0
    if count == 0:
        raise RuntimeError(
            f"backend {NAME!r} cannot select an NPU for local rank {local_rank}: no NPU device visible "
            f"(torch.npu.is_available() is False; check npu-smi and ASCEND_RT_VISIBLE_DEVICES="
            f"{os.environ.get('ASCEND_RT_VISIBLE_DEVICES', '<unset>')})"
        )
    if not 0 <= local_rank < count:
        raise RuntimeError(
            f"local rank {local_rank} has no NPU: {count} visible (ASCEND_RT_VISIBLE_DEVICES="
            f"{os.environ.get('ASCEND_RT_VISIBLE_DEVICES', '<unset>')}); start one process per NPU"
        )
    npu.set_device(local_rank)
    return npu_device(local_rank)


@hookimpl
def deepinfer_platform(device):
    if getattr(device, "type", None) != "npu":
        return None
    from deepinfer_ascend_950.platform import NpuPlatform

    return NpuPlatform(device)


@hookimpl
def deepinfer_graph_runner(model, cache, capture_sizes, max_model_len, block_size, platform, query_lens,
                           keep_streams, prologue):
    """ACL graphs of the decode step through the core's GraphRunner over :class:`NpuPlatform`."""
    if not platform.supports_graphs or not capture_sizes:
        return None
    from deepinfer_core.worker.graph_runner import GraphRunner

    return GraphRunner(model, cache, capture_sizes, max_model_len, block_size, platform=platform,
                       query_lens=query_lens, keep_streams=keep_streams, prologue=prologue)


@hookimpl
def deepinfer_make_communicator(group, device):
    """Collectives over ``group``: HCCL on NPUs (a group of another library is refused)."""
    if getattr(device, "type", None) == "npu":
        from deepinfer_ascend_950.comm import HcclCommunicator

        return HcclCommunicator(group)
    from deepinfer_core.comm import TorchDistributedCommunicator

    return TorchDistributedCommunicator(group)


@hookimpl
def deepinfer_make_ep_dispatcher(communicator, num_experts, hidden_size):
    """all_to_all over the communicator's group (HCCL's all_to_all on NPUs)."""
    from deepinfer_core.parallel.ep import AllToAllDispatcher

    return AllToAllDispatcher(communicator, num_experts, hidden_size)


@hookimpl
def deepinfer_discover_topology():
    from deepinfer_ascend_950 import topology

    torch, _ = import_torch_npu()
    return topology.discover(getattr(torch, "npu", None) if torch is not None else None)


@hookimpl
def deepinfer_plan_parallel(topology, parallel_config):
    from deepinfer_core.topology import plan_single_host

    return plan_single_host(
        topology,
        getattr(parallel_config, "data_parallel_size", 1),
        getattr(parallel_config, "expert_parallel_size", 1),
    )


@hookimpl
def deepinfer_collect_env():
    env = details()
    for var in ("ASCEND_RT_VISIBLE_DEVICES", "BISHENG_HOME", "ASCEND_HOME_PATH"):
        if var in os.environ:
            env[f"env.{var}"] = os.environ[var]
    return env

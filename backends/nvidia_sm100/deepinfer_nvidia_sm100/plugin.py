"""Hook implementations of the nvidia_sm100 backend: availability probe, ops, device, NCCL, topology.

Ops are registered per implementation with a predicate (see :mod:`.registration`): plain torch for
every op, Triton kernels where Triton runs on the engine's device, FlashMLA/DeepGEMM adapters where
those libraries are importable and pass a self-check. The kernel libraries (FlashMLA, DeepGEMM, DeepEP,
Triton) are probed lazily, inside ``is_available``/``details`` or when an engine is built, never when
this module is imported: importing them can initialise CUDA or JIT-compile, and a broken build must not
stop ``deepinfer backends`` from listing the other backends.
"""

from __future__ import annotations

import logging
import os
from importlib.metadata import PackageNotFoundError, version

from deepinfer_core.hookspecs import BackendInfo, hookimpl
from deepinfer_core.plugins import probe_library
from deepinfer_nvidia_sm100 import capability as caps

logger = logging.getLogger(__name__)

NAME = "nvidia_sm100"
DISTRIBUTION = "deepinfer-nvidia-sm100"
MIN_CAPABILITY = (9, 0)

# module name -> distribution names that may carry its version when the module has no __version__
KERNEL_LIBRARIES: dict[str, tuple[str, ...]] = {
    "flash_mla": ("flash_mla", "flash-mla"),
    "deep_gemm": ("deep_gemm", "deep-gemm"),
    "deep_ep": ("deep_ep", "deep-ep"),
    "triton": ("triton",),
}


def _version() -> str:
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return "0+unknown"


def _torch():
    try:
        import torch
    except Exception as exc:
        return None, f"cannot import torch: {type(exc).__name__}: {exc}"
    return torch, ""


def is_available() -> tuple[bool, str]:
    """``(True, "")`` on a CUDA device of compute capability >= 9.0, else ``(False, exact reason)``.

    Under the test-only switch ``DEEPINFER_NVIDIA_ALLOW_CPU=1`` the backend is available on the CPU.
    """
    try:
        torch, error = _torch()
        if torch is None:
            return False, error
        if caps.cpu_allowed():
            return True, ""
        if getattr(torch.version, "cuda", None) is None:
            build = f"ROCm {torch.version.hip}" if getattr(torch.version, "hip", None) else "CPU-only"
            return False, f"torch {torch.__version__} is built without CUDA ({build} build)"
        if not torch.cuda.is_available():
            return False, (
                f"no CUDA device visible (torch {torch.__version__}, CUDA {torch.version.cuda}; "
                "check the driver, nvidia-smi and CUDA_VISIBLE_DEVICES)"
            )
        device = torch.cuda.current_device()
        capability = torch.cuda.get_device_capability(device)
        if tuple(capability) < MIN_CAPABILITY:
            name = torch.cuda.get_device_name(device)
            need = ".".join(map(str, MIN_CAPABILITY))
            return False, (
                f"CUDA device {device} ({name}) has compute capability {capability[0]}.{capability[1]}, "
                f"below the {need} this backend needs (Hopper sm90 or Blackwell sm100)"
            )
        return True, ""
    except Exception as exc:  # the probe must never raise
        return False, f"CUDA probe failed: {type(exc).__name__}: {exc}"


def details() -> dict[str, str]:
    """Versions of the kernel libraries (or why they are missing) and the CUDA device, if any."""
    out: dict[str, str] = {}
    torch, error = _torch()
    if torch is None:
        out["torch"] = f"missing: {error}"
    else:
        out["torch"] = torch.__version__
        out["torch_cuda"] = str(getattr(torch.version, "cuda", None) or "none (built without CUDA)")
        try:
            if torch.version.cuda is not None and torch.cuda.is_available():
                device = torch.cuda.current_device()
                major, minor = torch.cuda.get_device_capability(device)
                out["cuda_device"] = f"{device}: {torch.cuda.get_device_name(device)}"
                out["compute_capability"] = f"{major}.{minor}"
                out["cuda_device_count"] = str(torch.cuda.device_count())
        except Exception as exc:
            out["cuda_device"] = f"probe failed: {type(exc).__name__}: {exc}"
    for module, dists in KERNEL_LIBRARIES.items():
        out[module] = probe_library(module, dists)
    out.update(_op_plan())
    return out


def _op_plan() -> dict[str, str]:
    """``op.<name>``: the implementation the core's resolution picks for each op on this machine, with
    the installed kernel packs, judged on probes alone (no kernel runs)."""
    try:
        ok, reason = is_available()
        if not ok:
            return {"ops": "not resolved: the backend is not available here"}
        from deepinfer_core.ops.registry import BuildContext
        from deepinfer_core.plugins import collect_registry, load_backend
        from deepinfer_nvidia_sm100.registration import op_labels

        registry = collect_registry(load_backend(NAME, require_available=False))
        ctx = BuildContext(backend=NAME, device=caps.default_device(), probe_only=True)
        return {f"op.{op}": impl for op, impl in op_labels(registry, ctx).items()}
    except Exception as exc:  # details() must never raise
        return {"ops": f"not resolved: {type(exc).__name__}: {exc}"}


@hookimpl
def deepinfer_backend_info():
    return BackendInfo(
        name=NAME,
        device_type="cuda",
        version=_version(),
        is_available=is_available,
        details=details,
    )


@hookimpl
def deepinfer_register_ops(registry, backend):
    if backend.name != NAME:
        return
    from deepinfer_nvidia_sm100.registration import register_all

    register_all(registry)


@hookimpl
def deepinfer_init_device(local_rank):
    import torch

    if caps.cpu_allowed():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if not 0 <= local_rank < count:
        raise RuntimeError(
            f"local rank {local_rank} has no CUDA device: {count} visible (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); start one process per GPU"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


@hookimpl
def deepinfer_platform(device):
    if device.type != "cuda":
        return None
    from deepinfer_nvidia_sm100.platform import CudaPlatform

    return CudaPlatform(device)


@hookimpl
def deepinfer_graph_runner(model, cache, capture_sizes, max_model_len, block_size, platform, query_lens,
                           keep_streams, prologue):
    if not platform.supports_graphs or not capture_sizes:
        return None
    from deepinfer_core.worker.graph_runner import GraphRunner

    return GraphRunner(model, cache, capture_sizes, max_model_len, block_size, platform=platform,
                       query_lens=query_lens, keep_streams=keep_streams, prologue=prologue)


@hookimpl
def deepinfer_make_communicator(group, device):
    """Collectives over ``group`` (an NCCL group on CUDA devices; gloo under the CPU test switch)."""
    from deepinfer_core.comm import TorchDistributedCommunicator

    return TorchDistributedCommunicator(group)


@hookimpl
def deepinfer_make_ep_dispatcher(communicator, num_experts, hidden_size):
    """DeepEP's Buffer over an NCCL group when ``deep_ep`` is importable (``DEEPINFER_DEEPEP_MODE``: ``auto``,
    the default, normal kernels eagerly and low-latency ones in decode graphs; ``normal``; ``low_latency``;
    ``off`` keeps all_to_all), else all_to_all."""
    import os

    from deepinfer_core.parallel.ep import AllToAllDispatcher
    from deepinfer_nvidia_sm100.deepep import DeepEPDispatcher, deep_ep_available

    mode = os.environ.get("DEEPINFER_DEEPEP_MODE", "auto")
    group = getattr(communicator, "group", None)
    torch, _ = _torch()
    on_cuda = torch is not None and torch.cuda.is_available() and group is not None
    if mode != "off" and on_cuda and deep_ep_available():
        return DeepEPDispatcher(communicator, num_experts, hidden_size, mode=mode)
    return AllToAllDispatcher(communicator, num_experts, hidden_size)


@hookimpl
def deepinfer_discover_topology():
    from deepinfer_core.topology import single_host_cpu_topology
    from deepinfer_nvidia_sm100 import topology

    torch, _ = _torch()
    if torch is None or not torch.cuda.is_available():
        return single_host_cpu_topology() if caps.cpu_allowed() else topology.discover()
    return topology.discover()


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
    torch, _ = _torch()
    if torch is not None:
        try:
            env["cudnn"] = str(torch.backends.cudnn.version())
            if torch.cuda.is_available():
                env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
                names = []
                for i in range(torch.cuda.device_count()):
                    major, minor = torch.cuda.get_device_capability(i)
                    names.append(f"{i}: {torch.cuda.get_device_name(i)} (sm{major}{minor})")
                env["cuda_devices"] = "; ".join(names)
        except Exception as exc:
            env["cuda_env_error"] = f"{type(exc).__name__}: {exc}"
    for var in ("CUDA_VISIBLE_DEVICES", "TRITON_INTERPRET", caps.ALLOW_CPU_ENV, "NCCL_NVLS_ENABLE"):
        if var in os.environ:
            env[f"env.{var}"] = os.environ[var]
    return env

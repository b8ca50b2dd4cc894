"""Every hook a deepinfer plugin can implement.

Backends (entry-point group ``deepinfer.backends``) and kernel packs (``deepinfer.kernels``) implement
these with ``@deepinfer_core.hookimpl``. Hooks run when an engine is built, never per token: ops are
resolved once into an :class:`~deepinfer_core.ops.OpTable` of plain callables.

``firstresult`` hooks answer "who handles this" (the first non-``None`` answer wins, kernel packs are
asked before the backend); the other hooks collect a contribution from every plugin.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import torch

    from deepinfer_core.comm import Communicator, EPDispatcher
    from deepinfer_core.config import CacheConfig, ModelConfig, ParallelConfig
    from deepinfer_core.model.kv_cache_spec import KVCacheSpec
    from deepinfer_core.models.deepseek_v4.weights import ModelWeights
    from deepinfer_core.ops.registry import OpRegistry
    from deepinfer_core.platform import Platform
    from deepinfer_core.topology import ClusterTopology, ParallelPlan

PROJECT = "deepinfer"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@dataclass
class BackendInfo:
    """What a backend says about itself through ``deepinfer_backend_info``."""

    name: str
    device_type: str
    version: str = "0"
    is_available: Callable[[], tuple[bool, str]] = lambda: (True, "")
    details: Callable[[], dict[str, str]] = dict


# --- backend ---------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def deepinfer_backend_info() -> BackendInfo:
    """Identify the backend: name, device type, version and an ``is_available()`` probe.

    Implemented by backend modules only. ``is_available`` must not raise: it returns
    ``(False, reason)`` when the hardware or a required library is missing.
    """


@hookspec
def deepinfer_configure(model_config: ModelConfig, cache_config: CacheConfig) -> None:
    """Adjust engine configuration before memory is planned (block size, KV dtype, ...).

    Called on every plugin in registration order; implementations mutate the config objects.
    """


@hookspec(firstresult=True)
def deepinfer_init_device(local_rank: int) -> torch.device:
    """Select and initialise the device this process computes on (``torch.device``).

    Called by each :class:`~deepinfer_core.worker.worker.Worker` with the local rank the parallel plan
    placed it on, unless the engine was given ``device=``.
    """


@hookspec(firstresult=True)
def deepinfer_platform(device: torch.device) -> Platform:
    """The device seam for ``device``: graph capture, memory statistics, events, host copies.

    Called by the Worker after ``deepinfer_init_device``. Return a
    :class:`deepinfer_core.platform.Platform` subclass, or ``None`` for the base class (a host device:
    no graphs, synchronous copies, the KV budget from ``kv_cache_bytes``).
    """


# --- operators -------------------------------------------------------------------------------------


@hookspec
def deepinfer_register_ops(registry: OpRegistry, backend: BackendInfo) -> None:
    """Contribute op implementations for the active ``backend``.

    Call ``registry.register(op_name, fn, priority=..., predicate=...)`` for each op. The highest
    priority implementation whose predicate accepts the build context (model config, dtype,
    device) serves the op. Kernel packs check ``backend.name`` and register only where they apply.
    In batch-invariant mode (``BuildContext.batch_invariant``) an op the catalogue does not mark
    ``batch_invariant`` is served only by an implementation registered with ``batch_invariant=True``.
    """


@hookspec(firstresult=True)
def deepinfer_kv_cache_spec(model_config: ModelConfig, cache_config: CacheConfig, dtype: torch.dtype) -> KVCacheSpec:
    """Describe the paged-cache layout the backend's attention kernels read: a
    :class:`~deepinfer_core.model.kv_cache_spec.KVCacheSpec` (entry dtype and layout, head-dim split,
    block size), or ``None`` for the default (``dtype`` entries; under ``numerics="deepseek"`` DeepSeek's
    FP8 entry, layout ``"fp8_ds"``, read through ``sparse_attention_fp8``).

    Asked once, after ``deepinfer_configure``, by
    :func:`~deepinfer_core.model.kv_cache_spec.resolve_kv_cache_spec`, which refuses a spec the model
    config, ``cache_config.block_size`` or ``ModelCache`` cannot serve; the memory plan and the cache
    then follow the spec.
    """


@hookspec
def deepinfer_process_weights(weights: ModelWeights, model_config: ModelConfig) -> None:
    """Re-lay loaded weights in place (transpose, pad, pack, quantise...), before the model is built.

    Called once by the loader on every plugin, after the checkpoint is read (in FP8 mode: after the rest
    is quantised). ``weights`` are the typed records the forward reads
    (:class:`~deepinfer_core.models.deepseek_v4.weights.ModelWeights`): what a plugin assigns to a field (a new
    ``Linear``, a re-laid tensor) is what the engine runs with.
    """


@hookspec(firstresult=True)
def deepinfer_graph_runner(
    model: Any, cache: Any, capture_sizes: list[int], max_model_len: int, block_size: int, platform: Platform,
    query_lens: tuple[int, ...], keep_streams: bool, prologue: Any,
) -> Any:
    """Capture the decode forward of ``model`` over ``cache`` at each of ``capture_sizes`` sequences (each
    size once per context bucket up to ``max_model_len`` and per new tokens per sequence in
    ``query_lens``: graphs are keyed by (size, bucket, query length)) and return the runner that replays
    it (usually :class:`deepinfer_core.worker.graph_runner.GraphRunner` over ``platform``'s graphs), or
    ``None`` to always run eagerly. ``query_lens`` is ``(1,)`` without speculative decoding and
    ``(1, 1 + k)`` with k drafts; ``keep_streams``: the runner's ``replay_with_streams`` must return the
    last layer's streams too (the MTP drafter reads them); ``prologue``: None, or
    ``prologue(static_batch, query_len, shared=...)`` to run inside each graph before the forward (the
    speculative runner's undo log; ``GraphRunner(prologue=...)`` does it, a runner that ignores it leaves
    the undo log to the host).

    Called by the ModelRunner when graphs are allowed (not ``enforce_eager``), ``platform.supports_graphs``
    and no op the model runs is registered ``syncs_host``."""


# --- communicators ---------------------------------------------------------------------------------


@hookspec(firstresult=True)
def deepinfer_make_communicator(group: Any, device: torch.device) -> Communicator:
    """Wrap a ``torch.distributed`` process group in a :class:`~deepinfer_core.comm.Communicator`."""


@hookspec(firstresult=True)
def deepinfer_make_ep_dispatcher(
    communicator: Communicator, num_experts: int, hidden_size: int
) -> EPDispatcher:
    """Build the expert-parallel token dispatcher/combiner for MoE layers."""


# --- cluster topology ------------------------------------------------------------------------------


@hookspec(firstresult=True)
def deepinfer_discover_topology() -> ClusterTopology:
    """Describe the hosts, devices, interconnect peers and NUMA nodes this process can use."""


@hookspec(firstresult=True)
def deepinfer_plan_parallel(topology: ClusterTopology, parallel_config: ParallelConfig) -> ParallelPlan:
    """Map data/expert-parallel ranks onto the devices of ``topology``."""


# --- diagnostics -----------------------------------------------------------------------------------


@hookspec
def deepinfer_collect_env() -> dict[str, str]:
    """Report versions and capabilities for bug reports (``deepinfer backends`` prints them)."""

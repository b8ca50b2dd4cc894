"""Worker: one device. Initialises it through the backend, loads the model, plans and allocates the
cache, and runs steps through its ModelRunner."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from deepinfer_core.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, resolve_dtype
from deepinfer_core.engine.memory import PoolSizes, plan_pools, profile_activation_bytes
from deepinfer_core.engine.scheduler_output import SchedulerOutput
from deepinfer_core.model.cache import ModelCache
from deepinfer_core.model.kv_cache_spec import resolve_kv_cache_spec
from deepinfer_core.model.replay import resolve_bounded_replay
from deepinfer_core.models import load_model
from deepinfer_core.models.interface import Model
from deepinfer_core.parallel.batch_sync import coordinator_for
from deepinfer_core.parallel.ep import (
    attach_expert_map,
    drafter_experts,
    drafter_stacks,
    dummy_moe_step,
    graph_collectives,
    own_drafter_experts,
    place_experts,
    place_stacks,
)
from deepinfer_core.parallel.eplb import EplbRecorder, ExpertLoad
from deepinfer_core.parallel.eplb_state import EplbState
from deepinfer_core.parallel.process_group import init_process_group, world_group
from deepinfer_core.platform import Platform
from deepinfer_core.plugins import LoadedBackend
from deepinfer_core.sampling.sampler import Sampler
from deepinfer_core.spec_decode.config import SpeculativeConfig, spec_query_lens
from deepinfer_core.spec_decode.rollback import GraphUndo
from deepinfer_core.worker.cpu_threads import apply_cpu_threads
from deepinfer_core.worker.graph_runner import capture_sizes
from deepinfer_core.worker.model_runner import ModelRunner
from deepinfer_core.worker.outputs import AsyncModelRunnerOutput
from deepinfer_core.worker.spec_model_runner import SpecDecodeModelRunner

logger = logging.getLogger(__name__)
DEFAULT_MAX_CAPTURE_SIZE = 256  # larger decode batches run eagerly: launch overhead no longer dominates


class Worker:
    def __init__(self, args: Any, backend: LoadedBackend, model_config: ModelConfig, path: Path,
                 scheduler_config: SchedulerConfig, cache_config: CacheConfig, parallel_config: ParallelConfig,
                 rank: int = 0, local_rank: int = 0, batch_invariant: bool = False):
        self.args, self.backend, self.model_config, self.path = args, backend, model_config, path
        self.scheduler_config, self.cache_config = scheduler_config, cache_config
        self.parallel_config, self.rank, self.local_rank = parallel_config, rank, local_rank
        self.batch_invariant = batch_invariant

    def init_device(self) -> None:
        hook = self.backend.hook
        self.device = torch.device(self.args.device) if self.args.device else hook.deepinfer_init_device(
            local_rank=self.local_rank)
        if self.device is None:
            raise RuntimeError(f"backend {self.backend.info.name!r} implements no deepinfer_init_device and no "
                               "device was given; pass device=...")
        apply_cpu_threads(getattr(self.args, "cpu_threads", None), self.model_config, self.device)
        self.platform: Platform = hook.deepinfer_platform(device=self.device) or Platform(self.device)
        pc = self.parallel_config
        init_process_group(self.device, max(pc.data_parallel_size, pc.expert_parallel_size),
                           getattr(self.args, "distributed_timeout_s", 600.0))
        self.communicator = hook.deepinfer_make_communicator(group=world_group(), device=self.device)
        self.ep_dispatcher = None
        self.eplb_state: EplbState | None = None
        if pc.expert_parallel_size > 1:
            cfg = self.model_config
            self.ep_dispatcher = hook.deepinfer_make_ep_dispatcher(
                communicator=self.communicator, num_experts=pc.num_physical_experts(cfg.n_routed_experts),
                hidden_size=cfg.hidden_size)
            if pc.enable_eplb:
                attach_expert_map(self.ep_dispatcher, cfg.num_hidden_layers, cfg.n_routed_experts)
        self.dtype = resolve_dtype(self.args.dtype, self.platform.default_dtype)
        if self.dtype == torch.float64 and self.device.type != "cpu":
            raise ValueError("float64 is for golden runs on the CPU reference backend only")

    def load_model(self) -> None:
        args, disp = self.args, self.ep_dispatcher
        emap = getattr(disp, "expert_map", None)
        slots = None if emap is None else emap.local_logical(self.rank)
        local = range(min(slots), max(slots) + 1) if slots else (disp.local_experts if disp is not None else None)
        self.drafter_span = self._drafter_span()
        self.model = load_model(self.path, args.backend, self.dtype, self.device, args.allow_reference_fallback,
                                batch_invariant=self.batch_invariant, quantization=args.quantization,
                                numerics=getattr(args, "numerics", None), experts=local,
                                engram_placement=getattr(args, "engram_placement", None),
                                engram_shard=getattr(args, "engram_shard", False), drafter_experts=self.drafter_span)
        # bounded replay: the engine's scheduler sets each prefill's floor; the model cuts its late layers there
        self.model.bounded_replay = resolve_bounded_replay(getattr(args, "bounded_replay", None), self.model_config)
        if disp is None:
            return
        self.model.ep = disp  # this rank read only (the span of) its own routed experts
        if emap is None:
            self.model.expert_load = ExpertLoad.for_model(self.model)  # counted on the device
        else:
            place_experts(self.model, [e - local.start for e in slots], len(local))  # one stack row per slot
            self.model.expert_load = EplbRecorder.for_model(self.model, disp)
        self._shard_drafter_experts(local)
        if emap is not None:
            self.eplb_state = EplbState(self.model, disp, self.parallel_config.eplb_config)

    def _drafter_span(self) -> range | None:
        """The drafter's own experts (DSpark's stages, another count than the target's) this rank reads: its
        share under expert parallel with speculative decoding, where its slots are one contiguous span (no
        EPLB); None: all of them (the drafter's own slots are chosen after loading)."""
        disp, num = self.ep_dispatcher, own_drafter_experts(self.model_config, self.args)
        if disp is None or num is None or self.parallel_config.enable_eplb or num % disp.world:
            return None
        per = num // disp.world
        return range(disp.rank * per, (disp.rank + 1) * per)

    def _shard_drafter_experts(self, local: range) -> None:
        """A drafter whose MoE has experts of its own (DSpark's stages): their own dispatcher over their own
        count, this rank's slots of them kept, and with EPLB their own slot map and load recorder. The
        loader read this rank's span of them (:meth:`_drafter_span`), all of them, or the target's span
        ``local`` where the two counts are equal. Without speculative decoding the drafter never runs: its
        experts are left as loaded."""
        num = drafter_experts(self.model)
        if num is None or SpeculativeConfig.from_arg(getattr(self.args, "speculative_config", None)) is None:
            return
        pc, cfg, drafter = self.parallel_config, self.model_config, self.model.drafter
        disp = self.backend.hook.deepinfer_make_ep_dispatcher(
            communicator=self.communicator, num_experts=pc.num_physical_experts(num), hidden_size=cfg.hidden_size)
        if pc.enable_eplb:
            slots = attach_expert_map(disp, len(drafter.moe_layers()), num).local_logical(self.rank)
        else:
            slots = list(disp.local_experts)
        loaded = drafter_stacks(self.model)[0].w13.weight.shape[0]
        if self.drafter_span is not None:
            if list(self.drafter_span) != slots:
                raise RuntimeError(f"rank {self.rank} read the drafter's experts {self.drafter_span} but its "
                                   f"dispatcher gives it {slots}")
            first = self.drafter_span.start
        else:
            first = 0 if loaded == num else local.start
        place_stacks(drafter_stacks(self.model), [e - first for e in slots], loaded)
        drafter.ep = disp
        if pc.enable_eplb:
            drafter.expert_load = EplbRecorder.for_drafter(self.model, disp)

    def eplb_step(self) -> dict | None:
        """After every step of every rank: EPLB's window, and its rearrangement when one is due."""
        return None if self.eplb_state is None else self.eplb_state.step()

    def initialize_cache(self) -> PoolSizes:
        """Size the pools from the platform's budget (after a profiling forward where it measures memory),
        allocate them and build the runner (capturing graphs where the backend has them)."""
        cfg, args, block_size = self.model_config, self.args, self.cache_config.block_size
        spec = resolve_kv_cache_spec(self.backend.hook, cfg, self.cache_config, self.dtype, self.model.numerics)
        activation = 0
        if self.platform.measures_memory:
            spec_config = SpeculativeConfig.from_arg(getattr(args, "speculative_config", None))
            query_len = 1 + spec_config.num_speculative_tokens if spec_config is not None else 1
            activation = profile_activation_bytes(self.model, self.scheduler_config, block_size, self.platform, spec,
                                                  query_len)
        budget = self.platform.memory_budget(self.cache_config, activation)
        sizes = plan_pools(cfg, self.cache_config, self.scheduler_config, self.dtype, budget, spec)
        self.cache = ModelCache(cfg, sizes.num_blocks, sizes.num_window_blocks, sizes.num_state_slots,
                                block_size, self.dtype, self.device, spec=spec)
        sampler = Sampler(self.model.ops, cfg.vocab_size, cfg.eos_token_ids)
        self.model_runner = make_model_runner(self.model, self.cache, sampler, args, self.scheduler_config,
                                              self.backend, self.platform)
        return sizes

    def execute_model(self, scheduler_output: SchedulerOutput) -> AsyncModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    def execute_dummy(self) -> None:
        """A step with nothing scheduled: the MoE layers' expert-parallel collectives, with no tokens, or,
        where the ranks agree on a graph for the step, a replay of that graph's size over padding
        sequences only; then (with speculative decoding) a step's drafting with no tokens, as its peers
        draft (MTP: the block's k forwards; DSpark: one pass over its stages)."""
        if self.ep_dispatcher is None:
            return
        runner = self.model_runner
        graphs = getattr(runner, "graph_runner", None)
        if not (graphs is not None and graphs.coordinator is not None and graphs.placeholder_step()):
            dummy_moe_step(self.model)
        proposer = getattr(runner, "proposer", None)
        if proposer is not None:
            proposer.dummy_step()


def make_model_runner(model: Model, cache: ModelCache, sampler: Sampler, args: Any, scheduler_config: Any,
                      backend: LoadedBackend, platform: Platform) -> ModelRunner:
    """A runner for the engine's arguments (a :class:`SpecDecodeModelRunner` with speculative decoding):
    with graphs from the backend unless ``args.enforce_eager``, the platform cannot capture, or an op the
    model runs waits for the host."""
    spec = SpeculativeConfig.from_arg(getattr(args, "speculative_config", None))
    k = spec.num_speculative_tokens if spec is not None else 0
    graphs = None
    if not args.enforce_eager and platform.supports_graphs:
        syncing = model.ops.syncs_host(model.ops_in_use(kv_fp8=cache.kv_spec.is_packed))
        syncing = syncing + [f"{type(c).__name__}'s collectives" for c in graph_collectives(model)
                             if not getattr(c, "graph_safe", False)]
        syncing = syncing + list(getattr(model, "host_waits", list)())
        if syncing:
            logger.warning("decode runs without graphs: %s wait(s) for the host", ", ".join(syncing))
        else:
            max_size = min(args.max_cudagraph_capture_size or DEFAULT_MAX_CAPTURE_SIZE,
                           scheduler_config.max_num_seqs)
            # a collective with fixed buffers (DeepEP's low-latency mode) bounds a graph's tokens per rank
            caps = [c.max_graph_tokens // max(spec_query_lens(spec)) for c in graph_collectives(model)
                    if getattr(c, "max_graph_tokens", None)]
            max_size = min([max_size, *caps])
            # no sequence outgrows the compressed pool: no graph needs a longer context bucket
            longest = min(scheduler_config.max_model_len, cache.num_blocks * cache.block_size)
            graphs = backend.hook.deepinfer_graph_runner(
                model=model, cache=cache, capture_sizes=capture_sizes(max_size),
                max_model_len=longest, block_size=cache.block_size, platform=platform,
                query_lens=spec_query_lens(spec), keep_streams=bool(k),
                prologue=GraphUndo(cache, model.cfg.num_hidden_layers) if k else None,
            )
            if graphs is not None:  # expert parallel: the ranks agree on every step's graph
                graphs.coordinator = coordinator_for(model)
    if k:
        if graphs is not None and not getattr(graphs, "keep_streams", False):
            logger.warning("speculative steps run without graphs: the backend's graph runner returns no "
                           "streams for the MTP drafter")
            graphs = None
        return SpecDecodeModelRunner(model, cache, cache.block_size, sampler, platform, graphs,
                                     num_speculative_tokens=k, profile_steps=spec.schedule == "confidence",
                                     method=spec.method)
    return ModelRunner(model, cache, cache.block_size, sampler, platform, graphs)

"""An engine's runners given the padded graph layouts a GPU replays, uncaptured: each "replay" runs the
padded static batch eagerly, exactly what a replay computes. The graph paths' host side (layouts, uploads,
the undo log, drafting from the verification's result) can then be tested and timed without a GPU.

Under expert parallel the runner agrees with the other ranks on every step's graph and its forwards
dispatch at fixed shapes, as captured graphs do (:mod:`deepinfer_core.parallel.batch_sync`); in a
data-parallel engine each rank installs them through ``collective_rpc(install_uncaptured_graphs, ...)``,
and :func:`graph_counts` reports what its steps ran."""

from __future__ import annotations

from collections import Counter
from typing import Any

from deepinfer_core.parallel.batch_sync import coordinator_for
from deepinfer_core.spec_decode.mtp_graph import MtpGraphs
from deepinfer_core.spec_decode.rollback import GraphUndo
from deepinfer_core.worker.graph_runner import GraphRunner


def use_uncaptured_graphs(engine: Any, sizes: list[int], query_lens: tuple[int, ...] = (1,),
                          undo_in_graph: bool = True, drafting: bool = False, min_context: int = 16) -> GraphRunner:
    """Give ``engine`` (an LLMEngine) graphs of ``sizes`` sequences and ``query_lens`` new tokens each.
    A speculating engine's keep the streams its drafter reads and, unless ``undo_in_graph`` is False,
    save the undo log inside them as the engine's own do; with ``drafting`` its MTP drafting runs through
    padded graphs too (``engine.runner.proposer.graphs``; never under expert parallel, whose drafting is
    eager). Returns the graph runner."""
    speculates = engine.drafts is not None
    prologue = GraphUndo(engine.cache, engine.model.cfg.num_hidden_layers) if speculates and undo_in_graph else None
    runner = GraphRunner(engine.model, engine.cache, sizes, engine.scheduler_config.max_model_len,
                         engine.args.block_size, capture=False, query_lens=query_lens, keep_streams=speculates,
                         min_context=min_context, prologue=prologue)
    runner.coordinator = coordinator_for(engine.model)
    engine.runner.graph_runner = runner
    if speculates and drafting and engine.model.ep is None:
        k = engine.drafts.config.num_speculative_tokens
        engine.runner.proposer.graphs = MtpGraphs(engine.model, engine.cache, sizes, k, capture=False)
    return runner


def install_uncaptured_graphs(engine: Any, sizes: list[int], query_lens: tuple[int, ...] = (1,)) -> None:
    """:func:`use_uncaptured_graphs` on a rank's engine core, counting each step's kind (:func:`graph_counts`)."""
    runner = use_uncaptured_graphs(engine, sizes, query_lens)
    runner.counts = Counter()
    replay_step, placeholder = runner.replay_step, runner.placeholder_step

    def counted_replay(batch):
        runner.counts["replays"] += 1
        runner.counts[f"size {batch.padded_to}"] += 1
        return replay_step(batch)

    def counted_placeholder():
        replayed = placeholder()
        runner.counts["placeholder replays" if replayed else "placeholder eager"] += 1
        return replayed

    runner.replay_step, runner.placeholder_step = counted_replay, counted_placeholder


def graph_counts(engine: Any) -> dict[str, int]:
    """What a rank's uncaptured graphs ran since :func:`install_uncaptured_graphs`: ``replays`` (real steps
    and placeholders), ``size N`` per batch size, ``placeholder replays`` and ``placeholder eager``."""
    return dict(engine.runner.graph_runner.counts)


def expert_storage(engine: Any) -> list[int]:
    """The storage addresses of a rank's routed-expert stacks and its EPLB map's device tables: a
    rearrangement that keeps captured graphs valid leaves every one of them where it was."""
    from deepinfer_core.parallel.ep import expert_stacks

    model = engine.model
    ptrs = [t.data_ptr() for ex in expert_stacks(model) for lin in (ex.w13, ex.w2)
            for t in (lin.weight, lin.scale) if t is not None]
    emap = getattr(model.ep, "expert_map", None)
    if emap is not None:
        ptrs += [t.data_ptr() for key in sorted(emap._device_tables, key=str) for t in emap._device_tables[key]]
    return ptrs

"""An engine's runners given the padded graph layouts a GPU replays, uncaptured: each "replay" runs the
padded static batch eagerly, exactly what a replay computes. The graph paths' host side (layouts, uploads,
the undo log, drafting from the verification's result) can then be tested and timed without a GPU."""

from __future__ import annotations

from typing import Any

from deepinfer_core.spec_decode.mtp_graph import MtpGraphs
from deepinfer_core.spec_decode.rollback import GraphUndo
from deepinfer_core.worker.graph_runner import GraphRunner


def use_uncaptured_graphs(engine: Any, sizes: list[int], query_lens: tuple[int, ...] = (1,),
                          undo_in_graph: bool = True, drafting: bool = False, min_context: int = 16) -> GraphRunner:
    """Give ``engine`` (an LLMEngine) graphs of ``sizes`` sequences and ``query_lens`` new tokens each.
    A speculating engine's keep the streams its drafter reads and, unless ``undo_in_graph`` is False,
    save the undo log inside them as the engine's own do; with ``drafting`` its MTP drafting runs through
    padded graphs too (``engine.runner.proposer.graphs``). Returns the graph runner."""
    speculates = engine.drafts is not None
    prologue = GraphUndo(engine.cache, engine.model.cfg.num_hidden_layers) if speculates and undo_in_graph else None
    runner = GraphRunner(engine.model, engine.cache, sizes, engine.scheduler_config.max_model_len,
                         engine.args.block_size, capture=False, query_lens=query_lens, keep_streams=speculates,
                         min_context=min_context, prologue=prologue)
    engine.runner.graph_runner = runner
    if speculates and drafting:
        k = engine.drafts.config.num_speculative_tokens
        engine.runner.proposer.graphs = MtpGraphs(engine.model, engine.cache, sizes, k, capture=False)
    return runner

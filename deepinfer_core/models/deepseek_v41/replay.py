"""Which of DeepSeek-V4.1's layers bounded replay cuts to a prompt's tail (:mod:`deepinfer_core.model.replay`).

The layers after the last KV source (the release: 21-39 after source 20) may run on the tail only if
nothing a later step reads comes out of them for earlier positions: they must own no global KV (no
compressed KV, no index keys: only KV sources do in V4.1, so none by definition, which the cache layout
confirms), use window pools no early layer reads, and carry no Engram (whose hashed memory is added to the
streams of every position). The candidate blocks and the top-k they reuse come from index sources at or
below the last KV source, or are computed per query: per-query work, which the tail does for itself.
"""

from __future__ import annotations

from deepinfer_core.model.cache_layout import cache_layout
from deepinfer_core.model.errors import UnsupportedModelError
from deepinfer_core.models.deepseek_v41.config import DeepseekV41Config


def replay_layers(cfg: DeepseekV41Config) -> range:
    """The target layers bounded replay runs on the tail only; an :class:`UnsupportedModelError` saying
    why when this model's late layers cannot be cut."""
    n = cfg.num_hidden_layers
    first = max(cfg.kv_source_layer_ids, default=-1) + 1
    late = range(first, n)
    why = []
    if not late:
        why.append("no layer follows the last KV source")
    layout = cache_layout(cfg)
    owning = [i for i in late if layout.layers[i].owned]
    if owning:
        why.append(f"layers {owning} own global KV")
    engram = [i for i in cfg.engram_layer_ids if i >= first]
    if engram:
        why.append(f"layers {engram} carry Engram")
    shared = [i for i in range(first) if layout.window_owners[layout.layers[i].window] >= first]
    if shared:
        why.append(f"early layers {shared} read a late layer's window pool")
    if why:
        raise UnsupportedModelError(
            f"bounded replay runs the layers after the last KV source ({first - 1}) on a prompt's tail only, "
            f"which needs them to own no global KV and carry no Engram; in this model {'; '.join(why)}. "
            "Pass bounded_replay=False for the full prefill")
    return late

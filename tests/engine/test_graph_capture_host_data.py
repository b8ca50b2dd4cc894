"""What a CUDA graph captures may not build tensors from host data: a capture refuses any copy from
pageable host memory (``torch.tensor(list, device=...)`` is one), and a replay would not see new host
values anyway; nor may it read a device value on the host (``.item()``, ``nonzero``, boolean masks). Here a
platform runs every capture's forward under a dispatch mode that records each array lifted from host data
(``aten.lift_fresh``) and each op of :data:`_SYNCING`, for both generations' embedded models and for the
verification widths of speculative decoding. (Found on an H100: V4.1's n-gram history and the FP4 value
table were built from Python lists on the device, so V4.1 could not capture its decode graphs.)
"""

from __future__ import annotations

import pytest
import torch
from host_reads import HostReads

from deepinfer_core.default_model import default_model_path, v4_model_path
from deepinfer_core.entrypoints.llm import LLM
from deepinfer_core.platform import Platform
from deepinfer_core.worker.graph_runner import GraphRunner


class _CheckingPlatform(Platform):
    """Runs each capture's forward once, eagerly, counting the arrays lifted from host data per key (summed
    over the captures of a key)."""

    supports_graphs = True

    def __init__(self, device: torch.device):
        super().__init__(device)
        self.lifted: dict = {}

    def capture_graphs(self, keys, forward):
        for key in keys:
            with torch.inference_mode(), HostReads() as mode:
                forward(key)
            self.lifted[key] = self.lifted.get(key, 0) + mode.lifted
        return {}


@pytest.mark.parametrize("path", [default_model_path, v4_model_path], ids=["v41", "v4"])
@pytest.mark.parametrize("query_lens", [(1,), (1, 3)], ids=["decode", "verify3"])
def test_captured_forwards_lift_no_host_data(path, query_lens):
    llm = LLM(str(path()), backend="cpu_ref", dtype="float32", max_num_seqs=4, max_model_len=256)
    engine = llm.llm_engine
    platform = _CheckingPlatform(engine.device)
    GraphRunner(engine.model, engine.cache, [1, 4], 256, engine.args.block_size, platform=platform,
                query_lens=query_lens)
    assert platform.lifted and len({key[2] for key in platform.lifted}) == len(query_lens)
    assert not any(platform.lifted.values()), {k: n for k, n in platform.lifted.items() if n}


@pytest.mark.parametrize("k", [1, 3])
def test_captured_dspark_drafting_lifts_no_host_data(k):
    """The DSpark drafting graphs (ring seeding and the pass over the stages, and the layouts derived on the
    device) of the embedded V4.1."""
    from deepinfer_core.spec_decode.dspark_graph import DSparkGraphs

    spec = {"method": "dspark", "num_speculative_tokens": k}
    llm = LLM(str(default_model_path()), backend="cpu_ref", dtype="float32", max_num_seqs=4, max_model_len=256,
              speculative_config=spec)
    engine = llm.llm_engine
    platform = _CheckingPlatform(engine.device)
    DSparkGraphs(engine.model, engine.cache, [1, 4], k, platform=platform)
    assert sorted(platform.lifted) == [1, 4]
    assert not any(platform.lifted.values()), platform.lifted

"""``deepinfer plan CONFIG`` (the footprint from a config) and the engine's memory plan (``deepinfer plan``
per rank, whose pools are sized as the worker sizes them) come from one estimate: for the same model,
dtype, KV format and expert-parallel layout they give the same weight bytes, routed-expert bytes, KV bytes
per token and per state slot, for the embedded default model and for the published DeepSeek-V4-Flash
config."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepinfer_core.config import CacheConfig, ModelConfig, SchedulerConfig
from deepinfer_core.default_model import default_model_path, v4_model_path
from deepinfer_core.engine.args import EngineArgs
from deepinfer_core.model.kv_cache_spec import KVCacheSpec
from deepinfer_core.models import default_numerics
from deepinfer_core.parallel.memory_plan import Footprint, RankMemory, footprint, plan_memory, plan_rank

PUBLISHED = Path(__file__).resolve().parents[3] / "shared/reference/deepseek-v4-flash"
KW = dict(dtype="float32", max_num_batched_tokens=64, max_num_seqs=8, kv_cache_bytes=64 << 20)


def assert_same_kv(rank: RankMemory, fp: Footprint, cfg: ModelConfig, block_size: int) -> None:
    """Per token and per slot, the KV the plan's pools cost is the footprint's."""
    assert rank.compressed_bytes_per_token == pytest.approx(fp.compressed_bytes_per_token, rel=1e-12)
    assert rank.window_bytes_per_token == pytest.approx(sum(k.window_bytes_per_token for k in fp.kv), rel=1e-12)
    window_blocks = -(-cfg.sliding_window // block_size) + 1  # a sequence's window, and the block it writes
    assert fp.window_bytes_per_seq == round(rank.window_bytes_per_token * block_size) * window_blocks
    # the cache allocates one row more of each pool than the plan hands out
    assert rank.kv_bytes == ((rank.num_blocks + 1) * round(fp.compressed_bytes_per_token * block_size)
                             + (rank.num_window_blocks + 1) * round(rank.window_bytes_per_token * block_size)
                             + (rank.num_state_slots + 1) * fp.state_bytes_per_seq)


EP2 = dict(data_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
           eplb_config={"num_redundant_experts": 2})


@pytest.mark.parametrize("model, layout", [(v4_model_path, {}), (v4_model_path, EP2), (default_model_path, {})],
                         ids=["v4-one", "v4-ep2", "v41-one"])
def test_embedded_models_plan_and_footprint_agree(model, layout):
    """The trained tiny V4 and the trained tiny V4.1 (the default, whose Engram tables stay FP8 in a float
    run). Not V4.1 under expert parallel: its DSpark stages hold experts of their own count, which the
    per-slot identity below does not describe."""
    args = EngineArgs(model=str(model()), **KW, **layout)
    ranks = plan_memory(args)
    cfg = ModelConfig.from_pretrained(model())
    redundant = (args.eplb_config or {}).get("num_redundant_experts", 0)
    fp = footprint(cfg, torch.float32, default_numerics(cfg), devices=args.data_parallel_size,
                   block_size=args.block_size, redundant_experts=redundant)
    assert len(ranks) == args.data_parallel_size
    for rank in ranks:
        assert rank.weight_bytes == fp.rank_bytes == fp.loaded_bytes - fp.loaded_expert_bytes + rank.expert_bytes
        assert rank.expert_bytes * cfg.n_routed_experts == fp.loaded_expert_bytes * rank.expert_slots
        assert_same_kv(rank, fp, cfg, args.block_size)


@pytest.mark.skipif(not (PUBLISHED / "config.json").exists(), reason=f"{PUBLISHED} not present")
@pytest.mark.parametrize("devices", [1, 8])
def test_published_config_plan_and_footprint_agree(devices):
    cfg = ModelConfig.from_pretrained(PUBLISHED)
    block_size, dtype = 128, torch.bfloat16
    spec = KVCacheSpec.default(cfg, block_size, dtype, "deepseek")  # the FP8 entry
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048, max_model_len=cfg.max_position_embeddings)
    slots = cfg.n_routed_experts // devices
    rank = plan_rank(cfg, dtype, spec, CacheConfig(block_size=block_size), sched, 16 << 30, slots)
    fp = footprint(cfg, dtype, "deepseek", devices=devices, block_size=block_size)
    assert rank.kv_layout == spec.layout and rank.num_blocks > 0
    assert_same_kv(rank, fp, cfg, block_size)
    # the plan covers float weights: the footprint's dequantised figure (FP8 and FP4 are kept as loaded)
    if devices == 1:
        assert rank.weight_bytes == fp.dequantised_bytes

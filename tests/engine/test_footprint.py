"""``deepinfer plan CONFIG``: a model's memory footprint from its config alone (deepinfer_core.parallel.memory_plan),
against the files and the loaded parameters of a tiny checkpoint in the published layout, the KV pools'
own sizes, and the published DeepSeek-V4-Flash index (159,609,485,896 bytes, within 1%)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from deepinfer_core.config import ModelConfig
from deepinfer_core.engine.memory import weight_bytes
from deepinfer_core.entrypoints import cli
from deepinfer_core.model.cache import bytes_per_block
from deepinfer_core.model.kv_cache_spec import KVCacheSpec
from deepinfer_core.model.loader import load_weights
from deepinfer_core.parallel.memory_plan import footprint
from deepinfer_core.testing.published_checkpoint import build_published_checkpoint

PUBLISHED = Path(__file__).resolve().parents[3] / "shared/reference/deepseek-v4-flash"
PUBLISHED_INDEX_BYTES = 159_609_485_896  # the published model.safetensors.index.json's total_size


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return build_published_checkpoint(tmp_path_factory.mktemp("footprint") / "tiny", "tiny", seed=1)


def test_stored_bytes_are_the_files_tensors(checkpoint):
    cfg = ModelConfig.from_pretrained(checkpoint)
    total = experts = 0
    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            t = f.get_tensor(key)
            total += t.numel() * t.element_size()
            experts += t.numel() * t.element_size() if ".ffn.experts." in key else 0
    w = weight_bytes(cfg, torch.bfloat16, "deepseek")
    assert (w["stored"], w["stored_experts"]) == (total, experts)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_loaded_bytes_are_the_parameters_the_loader_keeps(checkpoint, dtype):
    cfg = ModelConfig.from_pretrained(checkpoint)
    w = weight_bytes(cfg, dtype, "deepseek")
    kept = load_weights(cfg, checkpoint, dtype, keep_fp8=True, numerics="deepseek")
    plain = load_weights(cfg, checkpoint, dtype)

    def size(weights, experts_only=False):
        return sum(t.numel() * t.element_size() for n, t in weights.named_parameters()
                   if not experts_only or ".ffn.experts." in n)

    assert (w["loaded"], w["loaded_experts"]) == (size(kept), size(kept, True))
    assert w["dequantised"] == size(plain) == weight_bytes(cfg, dtype, "deepseek", True,
                                                           cfg.n_routed_experts)["dequantised"]


def test_ranks_hold_the_dense_weights_and_their_share_of_the_experts(checkpoint):
    cfg = ModelConfig.from_pretrained(checkpoint)
    one = footprint(cfg, devices=1)
    per_expert = one.loaded_expert_bytes / cfg.n_routed_experts
    for n in (2, 3, cfg.n_routed_experts):
        rank = footprint(cfg, devices=n).rank_bytes
        assert rank == int(one.loaded_bytes - one.loaded_expert_bytes + -(-cfg.n_routed_experts // n) * per_expert)
    with pytest.raises(ValueError, match="devices"):
        footprint(cfg, devices=0)
    # EPLB's replicas are more slots on each rank: (logical + 2 redundant) / 3 ranks, rounded up
    spread = footprint(cfg, devices=3, redundant_experts=2).rank_bytes
    slots = -(-(cfg.n_routed_experts + 2) // 3)
    assert spread == int(one.loaded_bytes - one.loaded_expert_bytes + slots * per_expert)
    with pytest.raises(ValueError, match="redundant"):
        footprint(cfg, redundant_experts=-1)


@pytest.mark.parametrize("numerics", ["deepseek", "transformers"])
def test_kv_per_token_is_the_pools_cost_per_block(checkpoint, numerics):
    cfg = ModelConfig.from_pretrained(checkpoint)
    fp = footprint(cfg, numerics=numerics, block_size=16)
    comp, window = bytes_per_block(cfg, 16, torch.bfloat16, KVCacheSpec.default(cfg, 16, torch.bfloat16, numerics))
    assert fp.compressed_bytes_per_token == pytest.approx(comp / 16)
    assert sum(k.window_bytes_per_token for k in fp.kv) == pytest.approx(window / 16)
    assert sum(k.layers for k in fp.kv) == cfg.num_hidden_layers + (cfg.num_nextn_predict_layers or 0)


def test_what_fits_follows_the_device_memory(checkpoint):
    cfg = ModelConfig.from_pretrained(checkpoint)
    small, big = (footprint(cfg, device_memory=m, context=1024) for m in (2**27, 2**28))
    assert 0 < small.longest_context < big.longest_context and 0 < small.max_seqs < big.max_seqs
    fixed = small.window_bytes_per_seq + small.state_bytes_per_seq
    free = small.device_memory - small.rank_bytes
    assert small.max_seqs * (fixed + 1024 * small.compressed_bytes_per_token) <= free
    assert (small.max_seqs + 1) * (fixed + 1024 * small.compressed_bytes_per_token) > free
    none = footprint(cfg, device_memory=small.rank_bytes)
    assert (none.longest_context, none.max_seqs) == (0, 0) and "no room" in none.notes[0]


def _plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deepinfer_core.entrypoints.cli", "plan", *args],
                          capture_output=True, text=True, timeout=120)


def _plan_here(capsys, *args: str) -> subprocess.CompletedProcess:
    """``_plan`` through the CLI's ``main`` in this process (no interpreter start and torch import per call; the
    module run as a program is what test_published_config_gives_the_published_weight_total checks)."""
    code = cli.main(["plan", *args])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["deepinfer", "plan", *args], code, out, err)


def test_cli_prints_the_table_and_json(checkpoint, tmp_path, capsys):
    done = _plan_here(capsys, str(checkpoint / "config.json"), "--devices", "2", "--device-memory", "1",
                      "--num-redundant-experts", "2")
    assert done.returncode == 0, done.stderr
    assert "as stored" in done.stdout and "csa" in done.stdout and "on 1 GB devices" in done.stdout
    assert "with 2 redundant experts" in done.stdout
    done = _plan_here(capsys, str(checkpoint), "--json")
    assert json.loads(done.stdout)["stored_bytes"] == weight_bytes(ModelConfig.from_pretrained(checkpoint),
                                                                   torch.bfloat16, "deepseek")["stored"]
    done = _plan_here(capsys, str(tmp_path))
    assert done.returncode == 2 and "no config.json" in done.stderr
    # nothing fits: said in GB, and the exit status says so to a script
    done = _plan_here(capsys, str(checkpoint), "--device-memory", "0.000001")
    assert done.returncode == 1 and "leave no room for KV on 0 GB devices" in done.stdout and "GiB" not in done.stdout


@pytest.mark.skipif(not (PUBLISHED / "config.json").exists(), reason=f"{PUBLISHED} not present")
def test_published_config_gives_the_published_weight_total():
    done = _plan(str(PUBLISHED / "config.json"), "--json", "--devices", "8", "--device-memory", "141")
    assert done.returncode == 0, done.stderr
    fp = json.loads(done.stdout)
    assert abs(fp["stored_bytes"] / PUBLISHED_INDEX_BYTES - 1) < 0.01, fp["stored_bytes"]
    assert fp["compressed_bytes_per_token"] == pytest.approx(7861.25)  # the FP8 entry's, as test_kv_fp8 states

"""V4-Flash-0731's config and checkpoint manifest: the V4-Flash config with three DSpark stages (46
``compress_ratios`` entries, ``n_mtp_layers`` 3 beside ``num_nextn_predict_layers`` 1) declares the published
inventory (72,317 tensors, 166.9 GB: the release's figures as the V4.1 reference README §4 quotes them), and
``deepinfer plan`` counts the stages; the plain V4-Flash config keeps its one MTP layer."""

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
from deepinfer_core.model.loader import manifest_of
from deepinfer_core.testing.tiny_0731 import build_tiny_0731

PUBLISHED = Path(__file__).resolve().parents[3] / "shared/reference/deepseek-v4-flash/config.json"
TENSORS_0731 = 72_317
BYTES_0731 = 166.9e9


def _tensor_count(cfg, with_drafter: bool = True) -> int:
    """Tensors in the files, block scales included."""
    man = manifest_of(cfg)
    names = man.file_names(with_drafter)
    return len(names) + sum(man.stored_format(n) in ("fp8", "fp4") for n in names)


def _plan_json(config: Path) -> dict:
    done = subprocess.run([sys.executable, "-m", "deepinfer_core.entrypoints.cli", "plan", str(config), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def config_0731(tmp_path_factory) -> Path:
    """The published V4-Flash config.json turned into 0731's: three window-only stages."""
    if not PUBLISHED.exists():
        pytest.skip(f"{PUBLISHED} not present")
    raw = json.loads(PUBLISHED.read_text())
    raw.update(compress_ratios=raw["compress_ratios"][:43] + [0, 0, 0], n_mtp_layers=3)
    folder = tmp_path_factory.mktemp("v4_0731")
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def test_0731_config_declares_three_stages_reading_the_last_layers(config_0731):
    cfg = ModelConfig.from_pretrained(config_0731)
    assert cfg.hf_config.num_nextn_predict_layers == 1 and cfg.num_nextn_predict_layers == 3
    assert cfg.dspark_target_layer_ids == [40, 41, 42] and cfg.dspark_block_size == 5
    assert cfg.drafter_moe_config() == (256, 6)


def test_0731_manifest_is_the_published_inventory(config_0731):
    cfg = ModelConfig.from_pretrained(config_0731)
    assert _tensor_count(cfg) == TENSORS_0731
    stored = weight_bytes(cfg, torch.bfloat16, "deepseek")["stored"]
    assert abs(stored / BYTES_0731 - 1) < 1e-3, stored
    man = manifest_of(cfg)
    assert man.rows["mtp.0.main_proj.weight"].shape == (4096, 3 * 4096)
    assert man.rows["mtp.2.markov_head.head.weight"].shape == (129280, 256)
    assert man.rows["mtp.2.confidence_head.proj.weight"].shape == (1, 4096 + 256)
    assert man.stored_format("mtp.0.main_proj.weight") == "fp8"
    assert man.stored_format("mtp.2.markov_head.embed.weight") == "bf16"
    assert "mtp.0.e_proj.weight" not in man.rows and "mtp.1.markov_head.head.weight" not in man.rows


def test_plan_counts_the_stages(config_0731):
    cfg = ModelConfig.from_pretrained(config_0731)
    fp = _plan_json(config_0731)
    with_stages = weight_bytes(cfg, torch.bfloat16, "deepseek")["stored"]
    without = weight_bytes(cfg, torch.bfloat16, "deepseek", with_mtp=False)["stored"]
    assert fp["stored_bytes"] == with_stages and with_stages - without > 9e9  # three stages of 256 experts


def test_plain_v4_flash_keeps_one_mtp_layer():
    if not PUBLISHED.exists():
        pytest.skip(f"{PUBLISHED} not present")
    cfg = ModelConfig.from_pretrained(PUBLISHED.parent)
    assert cfg.dspark is None and cfg.num_nextn_predict_layers == 1
    man = manifest_of(cfg)
    assert "mtp.0.e_proj.weight" in man.rows and "mtp.1.attn.wkv.weight" not in man.rows
    assert not [n for n in man.rows if "main_proj" in n or "markov" in n or "confidence" in n]


def test_tiny_0731_files_are_what_plan_counts(tmp_path):
    path = build_tiny_0731(tmp_path / "m")
    cfg = ModelConfig.from_pretrained(path)
    total, count = 0, 0
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            t = f.get_tensor(key)
            total, count = total + t.numel() * t.element_size(), count + 1
    assert count == _tensor_count(cfg)
    assert weight_bytes(cfg, torch.bfloat16, "deepseek")["stored"] == total == _plan_json(path)["stored_bytes"]

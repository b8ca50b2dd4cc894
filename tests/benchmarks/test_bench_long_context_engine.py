"""benchmarks/bench_long_context_engine.py on the tiny CPU model at tiny lengths: the report's figures, a
chunked prefill, a prefix hit that skips the history, pools as large as the plan computes, the table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
CHUNK, HISTORY, TURN, PROMPTS = 128, 256, 32, (256, 384)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    sys.path.insert(0, str(BENCHMARKS))
    import bench_long_context_engine as ble

    out = tmp_path_factory.mktemp("long_context_engine") / "report.json"
    threads = torch.get_num_threads()
    result = ble.main(["--prompt-lens", ",".join(map(str, PROMPTS)), "--history-len", str(HISTORY),
                       "--turn-len", str(TURN), "--max-model-len", "8192", "--max-num-batched-tokens", str(CHUNK),
                       "--max-num-seqs", "2", "--out", str(out)])
    assert torch.get_num_threads() == threads  # main gives the process its thread count back
    return result, json.loads(out.read_text())


def test_report_keys_and_json(report):
    result, written = report
    for key in ("label", "commit", "date", "device", "torch", "backend", "dtype", "model", "engine", "engine_init_s",
                "warmup", "prefill", "ttft", "kv", "max_rss_mb", "rss_mb_after", "wall_s"):
        assert key in result, key
    assert written == json.loads(json.dumps(result))
    assert result["engine"]["max_model_len"] == 8192 and result["engine"]["max_num_batched_tokens"] == CHUNK
    assert result["max_rss_mb"] > 0 and result["max_rss_mb"] >= max(result["rss_mb_after"].values())


def test_prefill_is_chunked(report):
    rows = report[0]["prefill"]
    assert [r["prompt_tokens"] for r in rows] == list(PROMPTS)
    for r in rows:
        assert r["steps_to_first_token"] == -(-r["prompt_tokens"] // CHUNK)
        assert r["cached_tokens"] == 0 and r["tok_s"] > 0
        assert r["tok_s"] == pytest.approx(r["prompt_tokens"] / r["ttft_s"])


def test_prefix_hit_skips_the_history(report):
    t = report[0]["ttft"]
    hit, cold = t["hit"], t["cold"]
    assert hit["prompt_tokens"] == cold["prompt_tokens"] == HISTORY + TURN
    assert hit["cached_tokens"] == hit["hit_tokens"] == HISTORY  # the history is whole blocks
    assert cold["cached_tokens"] == 0 and cold["hit_tokens"] == 0
    assert hit["steps_to_first_token"] < cold["steps_to_first_token"]
    assert t["speedup"] == pytest.approx(cold["ttft_s"] / hit["ttft_s"])


def test_kv_measured_matches_plan(report):
    kv = report[0]["kv"]
    assert kv["capacity_tokens"] == kv["num_blocks"] * kv["block_size"] >= 8192
    for name, pool in kv["pools"].items():
        assert pool["measured_bytes"] == pool["computed_bytes"] > 0, name
    assert kv["measured_total_bytes"] == kv["computed_total_bytes"] == kv["plan"]["kv_bytes"]
    assert kv["pools"]["compressed"]["measured_per_unit"] == kv["plan"]["compressed_bytes_per_token"]
    assert kv["per_sequence"][-1]["context"] == 8192


def test_markdown_table(report):
    import bench_long_context_engine as ble

    text = ble.markdown(report[0])
    assert "| prompt tokens | steps | prefill s | tok/s | max RSS MB |" in text
    assert f"| hit | {HISTORY + TURN} | {HISTORY} |" in text
    assert "peak host memory (ru_maxrss)" in text


def test_deepseek_numerics_measure_the_fp8_kv_entries(tmp_path):
    sys.path.insert(0, str(BENCHMARKS))
    import bench_long_context_engine as ble

    plain, fp8 = (ble.main(["--prompt-lens", "256", "--history-len", str(HISTORY), "--turn-len", str(TURN),
                            "--max-model-len", "8192", "--max-num-batched-tokens", str(CHUNK), "--max-num-seqs", "2",
                            *extra, "--out", str(tmp_path / f"r{len(extra)}.json")])
                  for extra in ([], ["--numerics", "deepseek"]))
    assert fp8["engine"]["numerics"] == "deepseek" and plain["kv"]["layout"] != fp8["kv"]["layout"]
    kv = fp8["kv"]
    assert kv["measured_total_bytes"] == kv["computed_total_bytes"]
    assert kv["compressed_bytes_per_token"] < plain["kv"]["compressed_bytes_per_token"]  # FP8 entries are smaller

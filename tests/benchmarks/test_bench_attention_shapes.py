"""``backends/nvidia_sm100/benchmarks/bench_attention.py`` on the CPU: the engine's own decode shapes (one
and two query tokens per request, the sliding / CSA / HCA layers), FlashMLA reported as skipped when it
cannot be imported (and no published figure in its place), and the FlashMLA calls it makes checked against
a torch stand-in that follows FlashMLA's documented API and its FP8 layout."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "backends" / "nvidia_sm100" / "benchmarks"))
import bench_attention as ba  # noqa: E402

CONTEXT = 512
BATCHES, QS = (1, 2), (1, 2)
#: the FlashMLA figures the script used to print as if measured (its FP8 sparse decode on an H200, us)
PUBLISHED_US = (14.7, 49.0, 93.0, 177.0)
OLD_NAMES = ("FLASH_MLA_US", "flash_mla_fp8_us", "vs_flash_mla")


def _numbers(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _numbers(v)
    elif isinstance(value, list):
        for v in value:
            yield from _numbers(v)
    elif isinstance(value, float):
        yield value


def test_without_flash_mla_the_cpu_run_measures_the_engine_and_reports_flash_mla_skipped(tmp_path, monkeypatch,
                                                                                           capsys):
    monkeypatch.setitem(sys.modules, "flash_mla", None)  # not importable, even where it is installed
    report = ba.main(["--device", "cpu", "--backend", "cpu_ref", "--batches", ",".join(map(str, BATCHES)),
                      "--q-per-request", ",".join(map(str, QS)), "--context", str(CONTEXT), "--warmup", "0",
                      "--iters", "1", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    for name in ba.FLASH_MLA:
        assert report["skipped"][name].startswith("flash_mla is not importable")
        assert name not in report["measured"]
    assert "skipped: flash_mla_decode, flash_mla_decode_meta, flash_mla_sparse_fwd (flash_mla is not importable" \
        in printed
    assert report["measured"] == ["engine", "engine_fp8"]  # the cpu_ref body stands where the Triton kernel would
    assert "triton" in report["skipped"]
    keys = {"csa": ba.WINDOW + min(ba.TOPK, CONTEXT // ba.CSA_RATE), "hca": ba.WINDOW + CONTEXT // ba.HCA_RATE,
            "sliding": ba.WINDOW}
    rows = report["rows"]
    assert [(r["layer"], r["batch"], r["q_per_request"]) for r in rows] == [
        (layer, b, q) for layer in ba.LAYERS for b in BATCHES for q in QS]
    for r in rows:
        assert r["tokens"] == r["batch"] * r["q_per_request"] and r["keys_per_token"] == keys[r["layer"]]
        assert set(r["us"]) == {"engine", "engine_fp8"} and all(v > 0 for v in r["us"].values()), r
        assert not r["errors"] and max(r["max_err"].values()) < 2e-2, r
        assert r["vs_engine"]["engine"] == 1.0
    text = (tmp_path / "attention.json").read_text()
    assert json.loads(text)["rows"] == rows
    source = Path(ba.__file__).read_text()
    for name in OLD_NAMES:  # no published figure, in the output or in the script
        assert name not in text and name not in source and name not in printed
    for figure in PUBLISHED_US:
        assert str(figure) not in source and figure not in set(_numbers(report))


# --- FlashMLA's API in torch (flash_mla_interface.py, csrc/api/sparse_decode.h, tests/ref.py) ---------------

MODEL1_BYTES, NOPE, ROPE = 584, 448, 64


def _pages_to_values(k_cache: torch.Tensor) -> torch.Tensor:
    """MODEL1 FP8 pages [blocks, page, 1, 584] -> bf16 values [blocks * page, 512]: per page the 576 bytes of
    every token (448 E4M3 codes, 64 bf16 RoPE values), then 8 scale bytes (7 ue8m0) of every token."""
    nb, page = k_cache.shape[:2]
    flat = torch.as_strided(k_cache, (nb, page * MODEL1_BYTES), (k_cache.stride(0), 1))
    nope_rope = flat[:, : page * 576].reshape(nb, page, 576)
    codes = nope_rope[..., :NOPE].contiguous().view(torch.float8_e4m3fn).float()
    rope = nope_rope[..., NOPE:].contiguous().view(torch.bfloat16).float()
    scales = torch.exp2(flat[:, page * 576:].reshape(nb, page, 8)[..., :7].float() - 127)
    return torch.cat([codes * scales.repeat_interleave(64, -1), rope], -1).reshape(nb * page, 512)


def _attend(q, kv, idx, scale):
    """q [T, H, D], kv [N, D], idx [T, K] (-1 or >= N: invalid) -> (out f32, lse; -inf: no key)."""
    valid = (idx >= 0) & (idx < kv.shape[0])
    keys = kv[idx.clamp(0, kv.shape[0] - 1).long()]
    logits = torch.einsum("thd,tkd->thk", q.float(), keys) * scale
    logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(logits, -1)
    probs = torch.exp(logits - lse.unsqueeze(-1)).nan_to_num(0.0)
    return torch.einsum("thk,tkd->thd", probs, keys), lse


def _fake_flash_mla(calls: list[str]) -> SimpleNamespace:
    def get_mla_metadata(*args, **kwargs):
        return SimpleNamespace(have_initialized=False), None

    def check_cache(k_cache, indices, q):
        assert k_cache.dtype in (torch.uint8, torch.int8, torch.float8_e4m3fn) and k_cache.dim() == 4
        assert k_cache.shape[2:] == (1, MODEL1_BYTES) and k_cache.stride(1) == MODEL1_BYTES
        assert k_cache.stride(-1) == 1
        # the kernel's 128-bit loads: every page starts on 16 bytes
        assert k_cache.data_ptr() % 16 == 0 and (k_cache.stride(0) * k_cache.element_size()) % 16 == 0, \
            "misaligned address"
        assert indices.dtype == torch.int32 and indices.shape[:2] == q.shape[:2] and indices.stride(-1) == 1
        assert indices.shape[-1] % 64 == 0, "topk must be a multiple of 64 (sm90)"

    def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, sched, num_splits=None,
                               softmax_scale=None, causal=False, is_fp8_kvcache=False, indices=None,
                               attn_sink=None, extra_k_cache=None, extra_indices_in_kvcache=None,
                               topk_length=None, extra_topk_length=None):
        calls.append("decode")
        assert isinstance(sched, SimpleNamespace) and num_splits is None and not causal and is_fp8_kvcache
        assert q.dtype == torch.bfloat16 and q.dim() == 4 and q.shape[2:] == (64, 512) and head_dim_v == 512
        assert attn_sink.dtype == torch.float32 and attn_sink.shape == (64,)
        b, s = q.shape[:2]
        check_cache(k_cache, indices, q)
        kv, idx = _pages_to_values(k_cache), indices.reshape(b * s, -1)
        if extra_k_cache is not None:
            check_cache(extra_k_cache, extra_indices_in_kvcache, q)
            ekv = _pages_to_values(extra_k_cache)
            eidx = extra_indices_in_kvcache.reshape(b * s, -1)
            eidx = torch.where(eidx >= 0, eidx + kv.shape[0], eidx)
            kv, idx = torch.cat([kv, ekv]), torch.cat([idx, eidx], 1)
        out, lse = _attend(q.reshape(b * s, 64, 512), kv, idx, softmax_scale)
        out = out * torch.sigmoid(lse - attn_sink.view(1, -1)).unsqueeze(-1)  # e^lse / (e^lse + e^sink)
        return out.to(torch.bfloat16).view(b, s, 64, 512), lse.view(b, s, 64).transpose(1, 2)

    def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
        calls.append("sparse_fwd")
        assert q.dtype == kv.dtype == torch.bfloat16 and kv.shape[1] == 1 and indices.dtype == torch.int32
        out, lse = _attend(q, kv[:, 0].float(), indices[:, 0], sm_scale)
        lse_out = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, float("inf")))
        return out.to(torch.bfloat16), lse, lse_out

    return SimpleNamespace(__version__="torch stand-in", get_mla_metadata=get_mla_metadata,
                           flash_mla_with_kvcache=flash_mla_with_kvcache, flash_mla_sparse_fwd=flash_mla_sparse_fwd)


@pytest.fixture(scope="module")
def ops_and_cfg():
    import bench_gpu_decode as bgd

    from deepinfer_core.config import ModelConfig
    from deepinfer_core.plugins import build_op_table

    cfg = ModelConfig.from_hf(bgd.make_config(bgd.parse_args([])))
    return build_op_table("cpu_ref", dtype=torch.bfloat16, device=torch.device("cpu"), model_config=cfg), cfg


@pytest.mark.parametrize("layer", ba.LAYERS)
def test_the_flash_mla_calls_agree_with_the_engine_on_its_own_entries(ops_and_cfg, layer):
    ops, cfg = ops_and_cfg
    calls: list[str] = []
    impls = ba.Implementations("cpu_ref", torch.device("cpu"), ops, flash_mla=_fake_flash_mla(calls))
    assert set(ba.FLASH_MLA) <= set(impls.makers) and not set(ba.FLASH_MLA) & set(impls.skipped)
    case = ba.make_case(layer, 2, 2, CONTEXT, cfg.rope_dim, torch.device("cpu"))
    row = ba.measure(case, impls, ba.timer(torch.device("cpu"), 0, 1))
    assert not row["errors"], row["errors"]
    assert set(row["us"]) == {"engine", "engine_fp8", *ba.FLASH_MLA}
    for name in ba.FLASH_MLA:
        assert row["max_err"][name] < 2e-2, (name, row["max_err"])
    assert "decode" in calls and "sparse_fwd" in calls


def test_flash_mla_pages_are_16_byte_aligned_where_the_engines_584_byte_rows_are_not(ops_and_cfg):
    _, cfg = ops_and_cfg
    case = ba.make_case("sliding", 1, 1, CONTEXT, cfg.rope_dim, torch.device("cpu"))
    assert case.window_fp8.shape[1] == MODEL1_BYTES and case.window_fp8.stride(0) % 16 == 8
    pages = ba.flash_mla_pages(case.window_fp8)
    assert pages.stride()[:2] == (592, MODEL1_BYTES) and pages.data_ptr() % 16 == 0
    assert torch.equal(pages[:, 0, 0], case.window_fp8)
    assert torch.equal(_pages_to_values(pages).bfloat16(), case.window_dec)  # the layout FlashMLA reads
    fake = _fake_flash_mla([])
    q = case.q.view(1, 1, 64, 512)
    idx = case.window_idx.to(torch.int32).view(1, 1, -1)
    with pytest.raises(AssertionError, match="misaligned"):
        fake.flash_mla_with_kvcache(q, case.window_fp8.view(-1, 1, 1, MODEL1_BYTES), None, None, 512,
                                    fake.get_mla_metadata()[0], None, 512**-0.5, False, True, idx, case.sinks)

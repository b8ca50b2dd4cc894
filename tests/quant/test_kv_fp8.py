"""DeepSeek's FP8 KV entry (``fp8_ds``): its bytes, what ModelCache allocates and the plan counts, the
memory it saves on the published config, that the engine under ``numerics="deepseek"`` gives exactly
the logits of the dense cache holding the same (FP8-simulated) values, and that prefix caching,
preemption and speculative rollback stay exact over uint8 rows."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import engine_fixtures
import pytest
import torch
from deepinfer_cpu_ref.ops import ALL_OPS as _ref
from engine_fixtures import greedy, make_prompt, run_tokens
from model_fixtures import engine_logits, no_kernel_packs

from deepinfer_core.config import ModelConfig
from deepinfer_core.model.cache import ModelCache, bytes_per_block, bytes_per_state_slot
from deepinfer_core.model.kv_cache_spec import KVCacheSpec
from deepinfer_core.models import load_model
from deepinfer_core.ops.registry import OpImpl, OpTable
from deepinfer_core.quant.fp4 import fake_quant_act_ue8m0
from deepinfer_core.quant.kv_fp8 import kv_fp8_entry_bytes, pack_kv_fp8, unpack_kv_fp8
from deepinfer_core.testing import conformance as conf
from deepinfer_core.testing.model_runner import SimpleRunner
from deepinfer_core.testing.published_checkpoint import build_published_checkpoint

make_llm = engine_fixtures.make_llm
one_torch_thread = engine_fixtures.one_torch_thread

#: DeepSeek's published config.json (the model's real widths)
PUBLISHED_CONFIG = Path(__file__).resolve().parents[3] / "shared/reference/deepseek-v4-flash"


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> Path:
    return build_published_checkpoint(tmp_path_factory.mktemp("kv_fp8") / "tiny", "tiny", seed=4)


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# --- the entry ---------------------------------------------------------------------------------------


def test_the_v4_flash_entry_is_584_bytes_in_flashmla_order():
    kv = torch.randn(3, 512, dtype=torch.bfloat16) * 3
    entries = pack_kv_fp8(kv, 64)
    assert entries.dtype == torch.uint8
    assert entries.shape == (3, 584) == (3, kv_fp8_entry_bytes(512, 64, torch.bfloat16))
    codes = entries[:, :448].view(torch.float8_e4m3fn)
    assert torch.equal(entries[:, 448:576].contiguous().view(torch.bfloat16), kv[:, 448:])  # RoPE as is
    scales = torch.exp2(entries[:, 576:583].double() - 127)
    assert torch.equal(entries[:, 583], torch.zeros(3, dtype=torch.uint8))  # the pad
    sim = fake_quant_act_ue8m0(kv[:, :448], 64)
    assert torch.equal((codes.double() * scales.repeat_interleave(64, 1)).to(torch.bfloat16), sim)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim, rope_dim", [(512, 64), (32, 8), (128, 64)])
def test_reading_an_entry_gives_deepseeks_quantised_values_exactly(dtype, head_dim, rope_dim):
    """What DeepSeek's model.py keeps after ``act_quant(kv[..., :-rd], 64, "ue8m0", inplace=True)``,
    partial last groups and all-zero rows included."""
    kv = (torch.randn(40, head_dim, dtype=torch.float64) * torch.logspace(-5, 3, 40).unsqueeze(1)).to(dtype)
    kv[0] = 0
    back = unpack_kv_fp8(pack_kv_fp8(kv, rope_dim), head_dim, rope_dim, dtype, dtype)
    nope = head_dim - rope_dim
    assert torch.equal(back, torch.cat([fake_quant_act_ue8m0(kv[:, :nope], 64), kv[:, nope:]], dim=1))
    with pytest.raises(ValueError, match="expected"):
        unpack_kv_fp8(pack_kv_fp8(kv, rope_dim), 2 * head_dim, rope_dim, dtype, dtype)


# --- the cache and the plan ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_model_cache_allocates_uint8_entries_and_the_plan_counts_them(published, dtype):
    cfg = ModelConfig.from_pretrained(published)
    spec = KVCacheSpec.default(cfg, 16, dtype, numerics="deepseek")
    assert spec.layout == "fp8_ds" and spec.entry_bytes == kv_fp8_entry_bytes(cfg.head_dim, cfg.rope_dim, dtype)
    blocks, window_blocks, slots = 5, 3, 2
    cache = ModelCache(cfg, blocks, window_blocks, slots, 16, dtype, fill=float("nan"), spec=spec)
    pools = [*cache.window_kv, *cache.comp_kv.values()]
    assert all(p.dtype == torch.uint8 and p.shape[1] == spec.entry_bytes for p in pools)
    assert all(bool((p == 0xFF).all()) for p in pools)  # NaN fill: every value, scale and RoPE reads as NaN
    assert all(p.dtype == dtype and p.shape[1] == cfg.index_head_dim for p in cache.index_keys.values())
    comp, window = bytes_per_block(cfg, 16, dtype, spec)
    assert nbytes(*cache.window_kv) == (window_blocks + 1) * window
    records = [t for pair in [*cache.comp_boundary.values(), *cache.index_boundary.values()] for t in pair]
    assert nbytes(*cache.comp_kv.values(), *cache.index_keys.values(), *records) == (blocks + 1) * comp
    rings = [t for pair in [*cache.comp_state.values(), *cache.index_state.values()] for t in pair]
    assert nbytes(*rings) == (slots + 1) * bytes_per_state_slot(cfg, dtype, spec)


@pytest.mark.skipif(not (PUBLISHED_CONFIG / "config.json").exists(), reason=f"{PUBLISHED_CONFIG} not present")
def test_fp8_entries_save_kv_memory_on_the_published_config(record_property):
    """Per source token, all layers (43 + the MTP block), bf16, 128-token blocks. Measured:
    window pools 45056 -> 25696 B (entries 1024 -> 584 B), compressed pools 10240 -> 7861.25 B (their
    indexer keys and float32 boundary records are not FP8)."""
    cfg = ModelConfig.from_pretrained(PUBLISHED_CONFIG)
    dense = KVCacheSpec.default(cfg, 128, torch.bfloat16)
    fp8 = KVCacheSpec.default(cfg, 128, torch.bfloat16, numerics="deepseek")
    assert (dense.entry_bytes, fp8.entry_bytes) == (1024, 584)
    (dc, dw), (fc, fw) = (bytes_per_block(cfg, 128, torch.bfloat16, s) for s in (dense, fp8))
    per_token = {"dense": (dc / 128, dw / 128), "fp8_ds": (fc / 128, fw / 128)}
    record_property("kv_bytes_per_token", per_token)
    print(f"KV bytes per token (compressed, window): {per_token}")
    layers = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    assert dw - fw == layers * 128 * (1024 - 584)
    assert per_token == {"dense": (10240.0, 45056.0), "fp8_ds": (7861.25, 25696.0)}


def test_deepseek_plan_prints_the_saving(published, capsys):
    from deepinfer_core.entrypoints.cli import main

    common = ["plan", "--model", str(published), "--dtype", "bfloat16", "--block-size", "16", "--max-num-seqs",
              "2", "--kv-cache-bytes", str(8 << 20)]
    assert main(common) == 0
    out = capsys.readouterr().out
    assert "fp8_ds entries" in out and "KV bytes per token" in out
    assert main([*common, "--json"]) == 0
    (rank,) = json.loads(capsys.readouterr().out)
    assert main([*common, "--numerics", "transformers", "--json"]) == 0
    (dense,) = json.loads(capsys.readouterr().out)
    assert rank["kv_layout"] == "fp8_ds" and dense["kv_layout"] == "dense"
    assert rank["window_bytes_per_token"] < dense["window_bytes_per_token"] == rank["dense_window_bytes_per_token"]
    assert rank["compressed_bytes_per_token"] < dense["compressed_bytes_per_token"]


# --- the engine --------------------------------------------------------------------------------------


def _logits_with(model, spec: KVCacheSpec, ids: list[int], chunk: int | None = None) -> torch.Tensor:
    class Runner(SimpleRunner):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.cache = ModelCache(model.cfg, self.max_blocks, self.max_blocks, 1, 16, model.dtype,
                                    fill=float("nan"), spec=spec)

    return engine_logits(model, ids, chunk=chunk, runner_cls=Runner)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fp8_entries_give_the_logits_of_the_simulated_dense_cache(published, dtype):
    """The FP8 entry stores exactly the values the dense path kept after simulating DeepSeek's
    quantisation, and attention reads them back exactly: bit-identical logits, prefill and decode."""
    with no_kernel_packs():
        model = load_model(published, dtype=dtype, numerics="deepseek")
    ids = make_prompt(40, seed=3)
    fp8 = KVCacheSpec.default(model.cfg, 16, dtype, numerics="deepseek")
    dense = dataclasses.replace(fp8, layout="dense")
    got = _logits_with(model, fp8, ids)
    assert torch.isfinite(got).all()
    assert torch.equal(got, _logits_with(model, dense, ids))
    assert torch.equal(_logits_with(model, fp8, ids, chunk=7), _logits_with(model, dense, ids, chunk=7))


def test_transformers_numerics_over_fp8_entries_quantise_the_kv(published):
    """A backend may answer ``fp8_ds`` for transformers numerics too: the KV is then quantised (on this
    random tiny model, measured: cosine to the unquantised logits median 0.9995, min 0.918)."""
    with no_kernel_packs():
        model = load_model(published, dtype=torch.float32, numerics="transformers")
    ids = make_prompt(40, seed=3)
    fp8 = KVCacheSpec.default(model.cfg, 16, torch.float32, numerics="deepseek")
    got, want = _logits_with(model, fp8, ids), engine_logits(model, ids)
    assert not torch.equal(got, want)
    cosine = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert cosine.median() > 0.999 and cosine.min() > 0.9


PROMPTS = [make_prompt(n, seed=n) for n in (70, 45, 80, 33)]


def test_preemption_over_fp8_entries_is_exact(published, make_llm):
    ref = run_tokens(make_llm(published, dtype="float32", numerics="deepseek"), PROMPTS, greedy(10))
    llm = make_llm(published, dtype="float32", numerics="deepseek", num_blocks=10, num_window_blocks=8)
    assert llm.llm_engine.cache.window_kv[0].dtype == torch.uint8
    assert run_tokens(llm, PROMPTS, greedy(10)) == ref
    assert llm.llm_engine.scheduler.num_preemptions > 0


def test_prefix_caching_over_fp8_entries_is_exact(published, make_llm):
    base = make_prompt(60, seed=1)
    prompts = [base[:n] + make_prompt(3, seed=100 + n) for n in (16, 17, 33, 48, 60)]
    off = make_llm(published, dtype="float32", numerics="deepseek", enable_prefix_caching=False)
    on = make_llm(published, dtype="float32", numerics="deepseek", enable_prefix_caching=True)
    ref = [run_tokens(off, [p], greedy(6))[0] for p in prompts]
    assert [run_tokens(on, [p], greedy(6))[0] for p in prompts] == ref
    assert on.llm_engine.prefix_cache_stats()["hit_tokens"] > 0


# --- conformance catches a broken entry ------------------------------------------------------------


def _scales_before_rope(kv, rope_dim):
    e = _ref["kv_fp8_pack"](kv, rope_dim)
    nope, groups, rope = kv.shape[-1] - rope_dim, -(-(kv.shape[-1] - rope_dim) // 64), rope_dim * kv.element_size()
    return torch.cat([e[:, :nope], e[:, nope + rope : nope + rope + groups], e[:, nope : nope + rope],
                      e[:, nope + rope + groups :]], dim=1)


def _float_scales_read(q, kv, i, s, sc, rd, rdt, ekv=None, ei=None):
    """Reads the codes without their scales."""
    def plain(pool):
        e = pool.clone()
        nope = q.shape[-1] - rd
        e[:, nope + rd * rdt.itemsize : nope + rd * rdt.itemsize + -(-nope // 64)] = 127
        return e

    return _ref["sparse_attention_fp8"](q, plain(kv), i, s, sc, rd, rdt, None if ekv is None else plain(ekv), ei)


MUTANTS = {
    "kv_fp8_pack puts the scales before the RoPE values": ("kv_fp8_pack", _scales_before_rope),
    "kv_fp8_pack with float amax/448 scales": (
        "kv_fp8_pack",
        lambda kv, rd: _ref["kv_fp8_pack"](kv * 1.1, rd),
    ),
    "sparse_attention_fp8 ignores the scales": ("sparse_attention_fp8", _float_scales_read),
    "sparse_attention_fp8 reads -1 slots as row 0": (
        "sparse_attention_fp8",
        lambda q, kv, i, s, sc, rd, rdt, ekv=None, ei=None: _ref["sparse_attention_fp8"](
            q, kv, i.clamp(min=0), s, sc, rd, rdt, ekv, None if ei is None else ei.clamp(min=0)),
    ),
}


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_a_broken_fp8_entry_is_caught(mutant):
    op, fn = MUTANTS[mutant]
    results = conf.check_op(op, OpTable({op: OpImpl(op, fn, 0, "test:mutant")}), conf.reference_op_table(),
                            "tiny", torch.float32)
    assert any(not r.passed for r in results), f"the suite did not notice: {mutant}"

"""KVCacheSpec: the default describes exactly what ModelCache allocates and what the memory plan counts;
a backend's ``deepinfer_kv_cache_spec`` answer is honoured where the cache can serve it, refused by name
where it cannot."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from deepinfer_core import plugins
from deepinfer_core.config import CacheConfig, ModelConfig
from deepinfer_core.model.cache import ModelCache, bytes_per_block, bytes_per_state_slot
from deepinfer_core.model.kv_cache_spec import KVCacheSpec, resolve_kv_cache_spec
from deepinfer_core.models import load_model
from deepinfer_core.testing.model_runner import SimpleRunner
from deepinfer_core.testing.tiny_model import build_tiny_checkpoint

try:
    from plugin_helpers import FakeDists
except ImportError:  # tests/ imported as a package
    from tests.plugin_helpers import FakeDists

SPEC_PACK = """
from deepinfer_core.hookspecs import hookimpl

ANSWER = None  # set by the test: (model_config, cache_config, dtype) -> spec

@hookimpl
def deepinfer_kv_cache_spec(model_config, cache_config, dtype):
    return ANSWER(model_config, cache_config, dtype) if ANSWER else None
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("kv") / "tiny", "tiny")


@pytest.fixture
def cfg(tiny):
    return ModelConfig.from_pretrained(tiny)


@pytest.fixture
def spec_pack(tmp_path, monkeypatch):
    """The cpu_ref backend with a kernel pack answering ``deepinfer_kv_cache_spec``; returns a setter
    for its answer and the backend's hook relay."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    fake = FakeDists(site)
    fake.ensure_repo_dists(monkeypatch)
    fake.add("deepinfer-kv-spec", {plugins.KERNEL_GROUP: {"kv_spec": "kv_spec_pack"}}, {"kv_spec_pack": SPEC_PACK})
    monkeypatch.setenv(plugins.ALLOWLIST_ENV, "kv_spec")
    plugins._LOADED.clear()
    hook = plugins.load_backend("cpu_ref").hook

    def answer(fn):
        sys.modules["kv_spec_pack"].ANSWER = fn
        return hook

    yield answer
    plugins._LOADED.clear()
    fake.cleanup()


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_default_spec_is_what_model_cache_allocates_and_the_plan_counts(cfg, dtype):
    spec = KVCacheSpec.default(cfg, 16, dtype)
    assert (spec.head_dim, spec.rope_dim, spec.nope_dim) == (cfg.head_dim, cfg.rope_dim, cfg.head_dim - cfg.rope_dim)
    assert spec.entry_bytes == cfg.head_dim * dtype.itemsize
    blocks, window_blocks, slots = 5, 3, 2
    cache = ModelCache(cfg, blocks, window_blocks, slots, 16, dtype)
    assert cache.kv_spec == spec
    assert all(p.dtype == dtype and p.shape[1] == spec.head_dim for p in cache.window_kv)
    assert all(p.dtype == dtype for p in [*cache.comp_kv.values(), *cache.index_keys.values()])
    assert {p.shape[1] for p in cache.index_keys.values()} == {spec.index_head_dim}
    comp, window = bytes_per_block(cfg, 16, dtype)
    # every pool holds one trash block (ring: one trash slot) beyond those handed out
    assert nbytes(*cache.window_kv) == (window_blocks + 1) * window
    records = [t for pair in [*cache.comp_boundary.values(), *cache.index_boundary.values()] for t in pair]
    assert nbytes(*cache.comp_kv.values(), *cache.index_keys.values(), *records) == (blocks + 1) * comp
    rings = [t for pair in [*cache.comp_state.values(), *cache.index_state.values()] for t in pair]
    assert nbytes(*rings) == (slots + 1) * bytes_per_state_slot(cfg, dtype)


def test_no_answer_gives_the_default(cfg, spec_pack):
    cache_config = CacheConfig(block_size=16)
    want = KVCacheSpec.default(cfg, 16, torch.float32)
    assert resolve_kv_cache_spec(None, cfg, cache_config, torch.float32) == want
    assert resolve_kv_cache_spec(spec_pack(None), cfg, cache_config, torch.float32) == want


def test_bf16_entries_under_a_float32_model_are_honoured(tiny, cfg, spec_pack):
    seen = []

    def bf16_entries(model_config, cache_config, dtype):
        seen.append((cache_config.block_size, dtype))
        return dataclasses.replace(KVCacheSpec.default(model_config, cache_config.block_size, dtype),
                                   dtype=torch.bfloat16)

    spec = resolve_kv_cache_spec(spec_pack(bf16_entries), cfg, CacheConfig(block_size=16), torch.float32)
    assert seen == [(16, torch.float32)] and spec.dtype == torch.bfloat16 and spec.state_dtype == torch.float32
    comp32, window32 = bytes_per_block(cfg, 16, torch.float32)
    comp16, window16 = bytes_per_block(cfg, 16, torch.float32, spec)
    assert window16 * 2 == window32 and comp16 < comp32  # entries halve, boundary records stay float32

    model = load_model(tiny, dtype=torch.float32)
    ids = torch.randint(2, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    want = SimpleRunner(model, 1, 40, block_size=16).step({0: ids}, all_logits=True)[0]
    runner = SimpleRunner(model, 1, 40, block_size=16)
    runner.cache = ModelCache(cfg, runner.max_blocks, runner.max_blocks, 1, 16, torch.float32,
                              fill=float("nan"), spec=spec)
    assert runner.cache.window_kv[0].dtype == torch.bfloat16 and runner.cache.comp_state[1][0].dtype == torch.float32
    got = runner.step({0: ids}, all_logits=True)[0]
    # bf16 rounding of the cached entries only; measured: min cosine 0.9991 over the 40 positions
    assert torch.isfinite(got).all() and not torch.equal(got, want)
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > 0.99


@pytest.mark.parametrize("change, message", [
    (dict(block_size=64), r"block_size 64: the cache is planned with 16"),
    (dict(layout="fp8_ds_mla"), r"layout 'fp8_ds_mla': ModelCache allocates only \('dense',\)"),
    (dict(head_dim=576), r"head_dim 576: the model has 32"),
    (dict(rope_dim=16), r"rope_dim 16: the model has 8"),
    (dict(dtype=torch.uint8), r"dtype torch.uint8: a dense entry needs a floating-point dtype"),
])
def test_a_layout_the_cache_cannot_serve_is_refused_by_name(cfg, spec_pack, change, message):
    hook = spec_pack(lambda m, c, d: dataclasses.replace(KVCacheSpec.default(m, c.block_size, d), **change))
    with pytest.raises(ValueError, match=message):
        resolve_kv_cache_spec(hook, cfg, CacheConfig(block_size=16), torch.float32)
    spec = dataclasses.replace(KVCacheSpec.default(cfg, 16, torch.float32), **change)
    with pytest.raises(ValueError, match=message):
        ModelCache(cfg, 2, 2, 1, 16, torch.float32, spec=spec)


def test_a_block_size_off_the_compression_rates_and_a_foreign_answer_are_refused(cfg, spec_pack):
    with pytest.raises(ValueError, match="multiple of every compression rate"):
        resolve_kv_cache_spec(spec_pack(lambda m, c, d: KVCacheSpec.default(m, 6, d)), cfg,
                              CacheConfig(block_size=6), torch.float32)
    with pytest.raises(TypeError, match="returned dict, expected a KVCacheSpec"):
        resolve_kv_cache_spec(spec_pack(lambda m, c, d: {"block_size": 16}), cfg, CacheConfig(block_size=16),
                              torch.float32)

"""DeepSeek-V4.1 against DeepSeek's own reference code: ``inference/model.py`` of the release folder
``shared/reference/deepseek-v4.1-flash/inference`` (beside the repository), run on the CPU through the
suite's kernel stand-ins (:mod:`v41_reference`, written from the release README §3.10), with one line
patched: a ratio-2 index source republishes its own keys on a decode step that closes no group (see
``v41_reference.INDEX_K_PATCH``: unpatched, model.py's decode disagrees with its own prefill; the engine
follows the prefill).

The tiny checkpoint (:mod:`deepinfer_core.testing.tiny_v41`) is in the release's layout and crosses every
boundary within the prompts below: windows of 8 roll over, ratio-2 groups close and stay open across
chunk and decode boundaries, the indexer picks 4 of up to 20 compressed positions, the candidate source
keeps 3 blocks of 2 (pruning from 7 entries on), cache blocks of 8 and chunks of 5 and 7 cut through all
of them, two Engram layers hash every position. The reference prefills the first ``PREFILL`` tokens and
decodes the rest one at a time (it has no chunked prefill); the engine runs the same prompt whole, in
chunks, and in decode steps.

Also: both published config forms, the checks of inconsistent layer lists, and the manifest against the
release's inventory as model.py declares it (meta device) and README §2 counts it.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import engine_fixtures
import pytest
import torch
import v41_reference as ref
from safetensors.torch import load_file

from deepinfer_core.config import ModelConfig
from deepinfer_core.model.errors import UnsupportedModelError
from deepinfer_core.models import load_model
from deepinfer_core.models.deepseek_v41.config import DeepseekV41Config
from deepinfer_core.models.deepseek_v41.manifest import manifest
from deepinfer_core.testing.model_runner import SimpleRunner
from deepinfer_core.testing.tiny_v41 import build_tiny_v41

pytestmark = pytest.mark.skipif(not ref.reference_present(), reason=f"{ref.REFERENCE_DIR} not present")

RELEASE = ref.REFERENCE_DIR.parent
PROMPT_LEN = 44
PREFILL = 13
IDS = torch.randint(5, 3900, (PROMPT_LEN,), generator=torch.Generator().manual_seed(7)).tolist()


one_torch_thread = engine_fixtures.one_torch_thread  # one intra-op thread: the tiny model's ops are faster


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_v41(tmp_path_factory.mktemp("v41") / "tiny", seed=1)


@functools.lru_cache(maxsize=8)
def reference_logits(path: Path, quant: bool, dtype: torch.dtype) -> torch.Tensor:
    from transformers import AutoTokenizer, PretrainedConfig

    cfg = ModelConfig.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(str(path), config=PretrainedConfig())
    model = ref.load_reference(cfg.to_flat(), load_file(str(path / "model.safetensors")), tokenizer, quant, dtype,
                               max_seq_len=64)
    return ref.teacher_forced_logits(model, IDS, PREFILL)


def engine_logits(model, schedule: list[int], block_size: int = 8) -> torch.Tensor:
    """Every position's logits, the prompt fed in steps of ``schedule`` tokens (then one at a time)."""
    runner = SimpleRunner(model, 1, 64, block_size=block_size)
    out, pos = [], 0
    for n in schedule + [1] * PROMPT_LEN:
        if pos >= PROMPT_LEN:
            break
        n = min(n, PROMPT_LEN - pos)
        out.append(runner.step({0: IDS[pos:pos + n]}, all_logits=True)[0])
        pos += n
    return torch.cat(out).double()


def rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per position: max |a - b| over the vocab, over the reference's largest logit."""
    return (a - b).abs().max(-1).values / b.abs().max()


SCHEDULES = {"whole": [PROMPT_LEN], "prefill_then_decode": [PREFILL], "chunks_5": [5] * 9, "chunks_7": [7] * 7}


# chunks_5 (slow): chunks_7 already runs prefill chunks that end off every boundary
@pytest.mark.parametrize("schedule", [pytest.param(s, marks=pytest.mark.slow) if s == "chunks_5" else s
                                      for s in sorted(SCHEDULES)])
def test_unquantised_float32_equals_model_py_with_its_quantisation_off(tiny, schedule):
    """float32, quantisation steps off on both sides: every position's logits to 1e-5 of the scale
    (measured: max 1.3e-6, median 7e-7)."""
    theirs = reference_logits(tiny, quant=False, dtype=torch.float32)
    ours = engine_logits(load_model(tiny, dtype=torch.float32, numerics="unquantised"), SCHEDULES[schedule])
    diff = rel(ours, theirs)
    assert diff.max() <= 1e-5, diff
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_unquantised_float64_equals_model_py(tiny):
    """float64: the same arithmetic up to summation order, every position to 1e-10."""
    theirs = reference_logits(tiny, quant=False, dtype=torch.float64)
    ours = engine_logits(load_model(tiny, dtype=torch.float64, numerics="unquantised"), [5] * 9)
    assert rel(ours, theirs).max() <= 1e-10


@pytest.mark.parametrize("schedule", ["whole", "chunks_7"])
def test_deepseek_numerics_follow_model_py_with_its_quantisation(tiny, schedule):
    """float32 with every quantisation step on (activations before FP8 linears and experts per 32, window
    KV E4M3, compressed KV FP4 with E4M3 scales, index keys and queries FP4): the engine and model.py sum
    in different orders, so a value a last bit apart could land on the other side of an FP4/E4M3 boundary
    (with these weights none does: measured max 5.1e-7, every position of all four schedules within 1e-5).
    Required: the first position within 1e-5, 95% of positions within 1e-5, none beyond 5e-2, 95% of the
    greedy tokens equal."""
    theirs = reference_logits(tiny, quant=True, dtype=torch.float32)
    model = load_model(tiny, dtype=torch.float32, numerics="deepseek")
    assert model.weights.layers[0].moe.experts.is_fp4
    ours = engine_logits(model, SCHEDULES[schedule])
    diff = rel(ours, theirs)
    assert diff[0] <= 1e-5, diff
    assert (diff <= 1e-5).float().mean() >= 0.95, diff
    assert diff.max() <= 5e-2, diff
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.95


# slices of one query under the packed keys of deepseek numerics; of several queries in float64
@pytest.mark.parametrize("numerics, dtype, slice_elements", [("unquantised", torch.float64, 100),
                                                             ("deepseek", torch.float32, 1)])
def test_a_long_chunk_is_ranked_a_slice_of_queries_at_a_time(tiny, numerics, dtype, slice_elements):
    """The indexer of a chunk with more [queries x candidates] than ``indexer_slice_elements`` ranks a slice
    of queries at a time (each one's lists built alone, packed keys decoded once): the same logits, bit for
    bit, as one pass, whole and in chunks of 7, down to slices of one query."""
    whole = load_model(tiny, dtype=dtype, numerics=numerics)
    sliced = load_model(tiny, dtype=dtype, numerics=numerics)
    sliced.indexer_slice_elements = slice_elements
    passes = {"whole": 0, "sliced": 0}
    for name, model in ("whole", whole), ("sliced", sliced):
        def rank(*args, _rank=model.rank, _name=name):
            passes[_name] += 1
            return _rank(*args)
        model.rank = rank
    for schedule in SCHEDULES["whole"], SCHEDULES["chunks_7"]:
        assert torch.equal(engine_logits(sliced, schedule), engine_logits(whole, schedule))
    assert passes["sliced"] > 2 * passes["whole"], passes


def test_the_cache_holds_packed_entries_equal_to_the_dense_values(tiny):
    """Under deepseek numerics the pools hold the release's packed rows (528 B window entries, 288 B
    compressed entries, 68 B index keys: 890 B of global KV per token at the release's widths; here 66,
    36 and 17 B at head_dim 64 and index_head_dim 32), which decode to exactly the values a dense cache
    holds: the logits are bit-identical."""
    model = load_model(tiny, dtype=torch.float32, numerics="deepseek")
    packed = SimpleRunner(model, 1, 64, block_size=8)
    dense = SimpleRunner(model, 1, 64, block_size=8, kv_layout="dense")
    assert packed.cache.kv_spec.layout == "fp4_ds"
    widths = {(p.dtype, p.shape[1]) for p in packed.cache.window_pools}
    assert widths == {(torch.uint8, 64 + 2)}
    assert {(p.dtype, p.shape[1]) for p in packed.cache.entry_pools} == {(torch.uint8, 32 + 4), (torch.uint8, 16 + 1)}
    for chunk in (IDS[:13], IDS[13:20], [IDS[20]], [IDS[21]]):
        assert torch.equal(packed.step({0: chunk}, all_logits=True)[0], dense.step({0: chunk}, all_logits=True)[0])


def test_the_candidate_filter_and_the_indexer_bite(tiny):
    """Without the candidate filter (every block kept) or with a larger top-k the logits change: the test
    prompts exercise both levels of the selection."""
    base = engine_logits(load_model(tiny, dtype=torch.float64, numerics="unquantised"), [PROMPT_LEN])
    for key, value in (("candidate_topk_blocks", 64), ("index_topk", 6)):
        config = json.loads((tiny / "config.json").read_text())
        config["text_config"][key] = value
        other = tiny.parent / f"tiny_{key}"
        if not other.exists():
            other.mkdir()
            for f in tiny.iterdir():
                (other / f.name).symlink_to(f)
            (other / "config.json").unlink()
            (other / "config.json").write_text(json.dumps(config))
        changed = engine_logits(load_model(other, dtype=torch.float64, numerics="unquantised"), [PROMPT_LEN])
        assert rel(changed, base).max() > 1e-6, key


def _v4_style_block(self, w, layer, streams, pre, batch, cache, rope, step):
    """V4's mHC, as a mutation: each sublayer collapses the streams with its own ``pre``."""
    ops, eps = self.ops, self.cfg.rms_norm_eps
    own_pre, post, comb = self.mixes(w.attn_hc, streams)
    h = ops.rms_norm(ops.hc_collapse(streams, own_pre), w.attn_norm, eps)
    streams = ops.hc_post(self.attention(w.attn, layer, h, batch, cache, rope, step), streams, post, comb)
    own_pre, post, comb = self.mixes(w.ffn_hc, streams)
    h = ops.rms_norm(ops.hc_collapse(streams, own_pre), w.ffn_norm, eps)
    return ops.hc_post(self.moe(w.moe, h), streams, post, comb), own_pre


def _mutate(model, name: str, monkeypatch) -> None:
    """Undo one of V4.1's differences from V4 in ``model`` (see test_each_delta_is_pinned_by_the_oracle)."""
    from deepinfer_core.models.deepseek_v41 import model as v41

    if name == "mhc_own_pre":
        monkeypatch.setattr(v41.DeepseekV41Model, "block", _v4_style_block)
    elif name == "window_layers_rope_with_yarn":
        model.rope.inv_freq["main"] = model.rope.inv_freq["compress"]
    elif name == "no_engram":
        model.engram_hash = None
        for block in model.weights.layers:
            block.engram = None
    elif name == "no_candidate_filter":
        monkeypatch.setattr(type(model.cfg), "uses_candidates", lambda self, layer: False)
    elif name == "index_keys_without_k_norm":
        for block in model.weights.layers:
            if block.attn.indexer is not None and block.attn.indexer.k_norm is not None:
                block.attn.indexer.k_norm = None
    elif name == "ratio2_mean_pooling":
        monkeypatch.setattr(model.ops, "compress_windows", lambda kv, gate: kv.mean(dim=1))


@pytest.mark.parametrize("delta", ["mhc_own_pre", "window_layers_rope_with_yarn", "no_engram", "no_candidate_filter",
                                   "index_keys_without_k_norm", "ratio2_mean_pooling"])
def test_each_delta_is_pinned_by_the_oracle(tiny, delta, monkeypatch):
    """The engine with one of V4.1's deltas undone (V4's mHC, YaRN on the window-only layers, no Engram, no
    candidate filter, index keys without their norm, plain mean pooling at ratio 2) leaves model.py's logits
    by far more than the oracle tests' 1e-5: each of those tests would catch the regression."""
    theirs = reference_logits(tiny, quant=False, dtype=torch.float32)
    model = load_model(tiny, dtype=torch.float32, numerics="unquantised")
    _mutate(model, delta, monkeypatch)
    assert rel(engine_logits(model, [PROMPT_LEN]), theirs).max() > 1e-3


# --- config forms and checks ----------------------------------------------------------------------


def test_both_published_config_forms_parse_to_one_config():
    hf = DeepseekV41Config.from_dict(json.loads((RELEASE / "config.transcribed.json").read_text()))
    flat = ModelConfig.from_pretrained(RELEASE / "inference")  # no architecture named: recognised by its keys
    assert isinstance(flat, DeepseekV41Config)
    for key in ("hidden_size", "num_hidden_layers", "compress_ratios", "kv_source_layer_ids",
                "index_source_layer_ids", "candidate_source_layer_id", "engram_num_embeddings",
                "num_nextn_predict_layers", "rms_norm_eps", "compress_rope_theta", "routed_scaling_factor"):
        assert getattr(hf, key) == getattr(flat, key), key
    assert hf.rope_scaling["factor"] == flat.rope_scaling["factor"] == 16
    assert manifest(hf).shapes() == manifest(flat).shapes()
    assert DeepseekV41Config.from_dict(flat.to_dict()).to_flat() == flat.to_flat()


def _release_with(**changes) -> dict:
    raw = json.loads((RELEASE / "inference" / "config.json").read_text())
    raw.update(changes)
    return raw


@pytest.mark.parametrize("changes, message", [
    ({"kv_source_layers": [1, 8, 14, 20]}, "compress ratio is 0"),
    ({"index_source_layers": [2, 8, 14, 20, 24, 28, 32, 40]}, "outside the 40 layers"),
    ({"candidate_topk_blocks": 32}, "cannot hold index_topk 512"),
    ({"kv_source_layers": [2, 8, 14]}, "whose ratio is 2"),
    ({"compress_ratios": [0, 0] + [2] * 18}, "20 entries for 40 layers"),
    ({"candidate_source_layer": 21}, "not an index source"),
    ({"engram_num_embeddings": [384006168]}, "one row count per Engram layer"),
])
def test_inconsistent_layer_lists_are_refused(changes, message):
    with pytest.raises(UnsupportedModelError, match=message):
        DeepseekV41Config.from_dict(_release_with(**changes))


# --- the manifest against the release -----------------------------------------------------------------

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def release_tensors(cfg: DeepseekV41Config) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """What the manifest says the release's files hold: every tensor, scales included, as stored."""
    out = {}
    man = manifest(cfg)
    for row in man.rows.values():
        if not row.in_file:
            continue
        for name, shape in row.file_parts():
            scale = name.removesuffix(".weight") + ".scale"
            if row.stored == "fp8":
                out[name] = (shape, torch.float8_e4m3fn)
                out[scale] = ((-(-shape[0] // row.block[0]), -(-shape[1] // row.block[1])), torch.float8_e8m0fnu)
            elif row.stored == "fp4":
                out[name] = ((shape[0], shape[1] // 2), torch.int8)
                out[scale] = ((shape[0], shape[1] // 32), torch.float8_e8m0fnu)
            else:
                out[name] = (shape, _DTYPES[row.stored])
    return out


def test_the_manifest_is_what_model_py_declares_for_the_release():
    """Names, shapes and dtypes equal model.py's ``Transformer`` (meta device) stored as the release stores
    it, and README §2's inventory: 96,085 tensors, 510,286,023,000 B, the counts per dtype."""
    cfg = ModelConfig.from_pretrained(RELEASE / "inference")
    ours = release_tensors(cfg)
    theirs = {k: (tuple(s), d) for k, (s, d) in ref.release_inventory(cfg.to_flat()).items()}
    assert sorted(set(ours) ^ set(theirs)) == []
    assert {k: v for k, v in ours.items() if theirs[k] != v} == {}
    counts: dict[torch.dtype, int] = {}
    for _, dtype in ours.values():
        counts[dtype] = counts.get(dtype, 0) + 1
    assert len(ours) == 96_085
    assert counts == {torch.float8_e4m3fn: 357, torch.int8: 47_232, torch.float8_e8m0fnu: 47_589,
                      torch.bfloat16: 520, torch.float32: 387}
    assert sum(manifest(cfg).stored_bytes().values()) == 510_286_023_000


@pytest.mark.parametrize("form", ["inference/config.json", "config.transcribed.json"])
def test_plan_of_the_release(form, tmp_path):
    """``deepinfer plan`` on either config form: the bytes as stored within 1% of the release's tensor
    payload (exactly it), 890 B of global KV per token, the four KV sources and 36 window/reader layers."""
    from deepinfer_core.parallel.memory_plan import footprint

    folder = tmp_path / "release"
    folder.mkdir()
    (folder / "config.json").write_text((RELEASE / form).read_text())
    fp = footprint(ModelConfig.from_pretrained(folder), torch.bfloat16, "deepseek", devices=8)
    assert abs(fp.stored_bytes - 510_286_023_000) <= 0.01 * 510_286_023_000
    assert fp.stored_bytes == 510_286_023_000
    assert fp.compressed_bytes_per_token == 890
    kinds = {k.kind: k.layers for k in fp.kv}
    assert kinds == {"sliding": 2, "source": 4, "reader": 34, "mtp": 3}
    # the Engram tables apart: kept as stored, 256 E4M3 values and 8 E8M0 scales a row (README §3.7)
    assert fp.table_bytes == 264 * (384_006_168 + 384_016_682)

"""The engine's DeepSeek-V4 forward (cpu_ref) against transformers' ``DeepseekV4ForCausalLM``.

Golden logits at every position of a full forward, greedy argmax, incremental decoding (token by
token and in chunks), several sequences of different lengths in one flat batch, paged blocks in any
physical order, and NaN-filled unused cache rows that must never reach the logits.

Tolerances: the bound the issue sets is max |engine - transformers| <= 1e-4 x max |logit|, in float64
and in float32 alike (measured: at most 3e-7 relative in float64, 1e-6 in float32). The float64
floor is not 1e-12 because transformers itself runs its RMSNorm and hyper-connection mixing in
float32 even in a float64 model. Engine-against-engine comparisons (incremental vs full forward,
batched vs alone) run in float64 and must agree to 1e-10 relative.
"""

from __future__ import annotations

import model_fixtures
import pytest
import torch
from model_fixtures import engine_logits, hf_logits, max_rel_diff, prompt

from deepinfer_core.testing.model_runner import SimpleRunner

# the shared fixtures, bound here so that pytest finds them in this module
tiny_checkpoints = model_fixtures.tiny_checkpoints
torch_single_thread = model_fixtures.torch_single_thread
pytestmark = pytest.mark.usefixtures("torch_single_thread")

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"

# (tiny config, overrides). The three named configs mix sliding/CSA/HCA layers, hash and routed MoE,
# hc_mult 1/2/4, sqrtsoftplus and sigmoid scoring, and an index_topk below the number of compressed
# entries; the overridden ones add what the named ones lack.
GOLDEN_CONFIGS: dict[str, tuple[str, dict]] = {
    "tiny": ("tiny", {}),
    "tiny_hc4": ("tiny_hc4", {}),
    "tiny_hc1": ("tiny_hc1", {}),
    # default (non-yarn) RoPE for both rope kinds, one head per output group, an odd window, three
    # experts per token, and an HCA rate equal to the block size (one entry per block).
    "sigmoid_default_rope_og4": ("tiny", dict(
        scoring_func="sigmoid", sliding_window=5, o_groups=4, num_experts_per_tok=3,
        rope_parameters={"rope_type": "default"}, compress_rates={CSA: 2, HCA: 16},
    )),
    # hc_mult 3, a window as long as a block, half the head rotary, and index_topk larger than every
    # candidate list (the indexer's -1 padding path).
    "hc3_wide_window_topk_all": ("tiny_hc1", dict(
        hc_mult=3, sliding_window=16, partial_rotary_factor=0.5, index_topk=64,
    )),
}
# transformers' ACT2FN has no "softmax", so this one is only checked engine against engine.
ENGINE_ONLY_CONFIGS: dict[str, tuple[str, dict]] = {
    "softmax_scoring": ("tiny", dict(scoring_func="softmax")),
}
ALL_CONFIGS = {**GOLDEN_CONFIGS, **ENGINE_ONLY_CONFIGS}

# sliding_window 8 (5, 6, 16 in the variants), rates 2/4/8/16, block_size 16: these cross every
# window, compression and block boundary.
LENGTHS = (1, 5, 9, 17, 40, 70)
GOLDEN_BOUND = 1e-4
ENGINE_BOUND = 1e-10


def _model(store, config: str, dtype: torch.dtype = torch.float64):
    name, overrides = ALL_CONFIGS[config]
    return store.engine(name, dtype, **overrides)


def _hf(store, config: str, dtype: torch.dtype = torch.float64):
    name, overrides = GOLDEN_CONFIGS[config]
    return store.hf(name, dtype, **overrides)


class ShuffledRunner(SimpleRunner):
    """SimpleRunner whose sequences own scattered, interleaved physical blocks (as a block manager's)."""

    def table(self, seq: int) -> list[int]:
        total = self.cache.num_blocks
        perm = torch.randperm(total, generator=torch.Generator().manual_seed(1234)).tolist()
        return perm[seq * self.max_blocks : (seq + 1) * self.max_blocks]


# --- golden against transformers -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("config", list(GOLDEN_CONFIGS))
def test_full_forward_matches_transformers(tiny_checkpoints, config, dtype):
    model, hf = _model(tiny_checkpoints, config, dtype), _hf(tiny_checkpoints, config, dtype)
    ids = prompt(max(LENGTHS), model.cfg.vocab_size)
    for length in LENGTHS:
        ours = engine_logits(model, ids[:length])
        ref = hf_logits(hf, ids[:length])
        assert ours.shape == ref.shape == (length, model.cfg.vocab_size)
        assert ours.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        assert torch.isfinite(ours).all(), f"non-finite logits at length {length}"
        rel = max_rel_diff(ours, ref)
        assert rel <= GOLDEN_BOUND, f"{config} {dtype} length {length}: max diff {rel:.3g} x max|logit|"


@pytest.mark.parametrize("config", list(GOLDEN_CONFIGS))
def test_greedy_argmax_matches_transformers(tiny_checkpoints, config):
    """The forward's argmax at every position (not generate()'s tokens) equals transformers'."""
    model, hf = _model(tiny_checkpoints, config), _hf(tiny_checkpoints, config)
    ids = prompt(max(LENGTHS), model.cfg.vocab_size, seed=1)
    ours, ref = engine_logits(model, ids), hf_logits(hf, ids)
    top2 = ref.topk(2, dim=-1).values
    margin = float((top2[:, 0] - top2[:, 1]).min())
    mismatch = (ours.argmax(-1) != ref.argmax(-1)).nonzero().flatten().tolist()
    assert not mismatch, f"argmax differs at positions {mismatch} (smallest top-2 margin {margin:.3g})"


def test_matches_transformers_cached_decoding(tiny_checkpoints):
    """Token by token, the engine's paged cache agrees with transformers' own DynamicCache path."""
    from transformers import DynamicCache

    model, hf = _model(tiny_checkpoints, "tiny"), _hf(tiny_checkpoints, "tiny")
    ids = prompt(26, model.cfg.vocab_size, seed=2)  # past the window (8), both rates (4, 8), a block (16)
    cache, ref = DynamicCache(config=hf.config), []
    with torch.no_grad():
        for i in range(len(ids)):
            out = hf(torch.tensor([ids[i : i + 1]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            ref.append(out.logits[0, -1])
    ours = engine_logits(model, ids, chunk=1)
    assert torch.isfinite(ours).all()
    assert max_rel_diff(ours, torch.stack(ref)) <= GOLDEN_BOUND


# --- engine against itself -----------------------------------------------------------------------


# 1: token by token; 7: chunks ending mid-window and mid-compression-window; 3 (slow): more of the same
@pytest.mark.parametrize("chunk", [1, pytest.param(3, marks=pytest.mark.slow), 7])
@pytest.mark.parametrize("config", list(ALL_CONFIGS))
def test_incremental_equals_full_forward(tiny_checkpoints, config, chunk):
    model = _model(tiny_checkpoints, config)
    ids = prompt(40 if chunk == 1 else max(LENGTHS), model.cfg.vocab_size, seed=3)  # 40: crosses 2 blocks
    full = engine_logits(model, ids)
    inc = engine_logits(model, ids, chunk=chunk)
    assert torch.isfinite(inc).all() and torch.isfinite(full).all()
    rel = max_rel_diff(inc, full)
    assert rel <= ENGINE_BOUND, f"{config} chunk {chunk}: max diff {rel:.3g} x max|logit|"


@pytest.mark.parametrize("block_size", [8, 32])
def test_block_size_does_not_change_logits(tiny_checkpoints, block_size):
    model = _model(tiny_checkpoints, "tiny")
    ids = prompt(max(LENGTHS), model.cfg.vocab_size, seed=4)
    ref = engine_logits(model, ids)
    assert max_rel_diff(engine_logits(model, ids, chunk=5, block_size=block_size), ref) <= ENGINE_BOUND


# Chunk sizes per step and sequence: prefill chunks next to decodes, sequences missing from a
# step, and dict orders other than the state-slot order. Lengths: seq 0 -> 38, seq 1 -> 53, seq 2 -> 15.
SCHEDULE = [
    {0: 10, 1: 1},
    {1: 20, 0: 1, 2: 5},
    {2: 7, 0: 1, 1: 1},
    {1: 30, 2: 1, 0: 1},
    {0: 24, 2: 1},
    {2: 1, 1: 1, 0: 1},
]


@pytest.mark.parametrize("runner_cls", [SimpleRunner, ShuffledRunner], ids=["contiguous", "shuffled"])
@pytest.mark.parametrize("config", ["tiny", "tiny_hc1", "sigmoid_default_rope_og4"])
def test_batched_sequences_equal_each_alone(tiny_checkpoints, config, runner_cls):
    model = _model(tiny_checkpoints, config)
    lengths = {seq: sum(step.get(seq, 0) for step in SCHEDULE) for seq in range(3)}
    ids = {seq: prompt(n, model.cfg.vocab_size, seed=10 + seq) for seq, n in lengths.items()}
    runner = runner_cls(model, len(lengths), max(lengths.values()))
    fed = dict.fromkeys(lengths, 0)
    got: dict[int, list[torch.Tensor]] = {seq: [] for seq in lengths}
    for step in SCHEDULE:
        chunks = {seq: ids[seq][fed[seq] : fed[seq] + n] for seq, n in step.items()}
        for seq, logits in runner.step(chunks, all_logits=True).items():
            got[seq].append(logits)
        for seq, n in step.items():
            fed[seq] += n
    for seq in lengths:
        batched = torch.cat(got[seq])
        assert torch.isfinite(batched).all()
        alone = engine_logits(model, ids[seq])
        rel = max_rel_diff(batched, alone)
        assert rel <= ENGINE_BOUND, f"{config} seq {seq}: batched differs from alone by {rel:.3g}"


def test_last_token_logits_only(tiny_checkpoints):
    """Without all_logits each sequence gets exactly its last position's row."""
    model = _model(tiny_checkpoints, "tiny")
    a, b = prompt(23, model.cfg.vocab_size, seed=20), prompt(9, model.cfg.vocab_size, seed=21)
    runner = SimpleRunner(model, 2, 32)
    out = runner.step({0: a, 1: b})
    assert out[0].shape == out[1].shape == (1, model.cfg.vocab_size)
    assert max_rel_diff(out[0][0], engine_logits(model, a)[-1]) <= ENGINE_BOUND
    assert max_rel_diff(out[1][0], engine_logits(model, b)[-1]) <= ENGINE_BOUND


@pytest.mark.parametrize(
    ("config", "dtype"),
    [("tiny", torch.float64), ("tiny_hc1", torch.float32)],
    ids=["tiny-float64", "tiny_hc1-float32"],
)
def test_unused_cache_rows_never_leak(tiny_checkpoints, config, dtype):
    """Cache rows nobody wrote (NaN, inf, huge values) never reach the logits: the result is bit-identical."""
    model = _model(tiny_checkpoints, config, dtype)
    ids = prompt(45, model.cfg.vocab_size, seed=5)
    for chunk in (None, 6):
        clean = engine_logits(model, ids, chunk=chunk, fill=0.0)
        assert torch.isfinite(clean).all()
        for fill in (float("nan"), float("inf"), 1e30):
            dirty = engine_logits(model, ids, chunk=chunk, fill=fill)
            assert torch.equal(dirty, clean), f"fill {fill} changed the logits (chunk {chunk})"


# --- long sequences (real HCA rate) --------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_long_sequence_real_rates(tiny_checkpoints, dtype):
    """Rates 4/128 as published, block_size 128, 300 tokens: golden full forward and chunked decoding."""
    name, overrides = "tiny", dict(compress_rates={CSA: 4, HCA: 128}, sliding_window=128, index_topk=16)
    model = tiny_checkpoints.engine(name, dtype, **overrides)
    hf = tiny_checkpoints.hf(name, dtype, **overrides)
    ids = prompt(300, model.cfg.vocab_size, seed=6)
    full = engine_logits(model, ids, block_size=128)
    assert torch.isfinite(full).all()
    assert max_rel_diff(full, hf_logits(hf, ids)) <= GOLDEN_BOUND
    if dtype == torch.float64:
        assert max_rel_diff(engine_logits(model, ids, chunk=37, block_size=128), full) <= ENGINE_BOUND

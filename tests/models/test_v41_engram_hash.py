"""DeepSeek-V4.1 Engram hashing against DeepSeek's reference ``engram.py``, bit for bit.

The reference is read from ``<repo root>/../shared/reference/deepseek-v4.1-flash/inference/engram.py``
(``REF_DIR`` below, i.e. ``Path(__file__).resolve().parents[3] / "shared" / "reference" /
"deepseek-v4.1-flash" / "inference"``) and loaded with importlib; the comparisons skip when it is absent.
The token map and the small-config hashes use the repository's embedded tiny tokenizer.
"""

from __future__ import annotations

import importlib.util
import json
import random
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch

from deepinfer_core.models.deepseek_v41 import engram_hash
from deepinfer_core.models.deepseek_v41.engram_hash import (
    BEFORE_START,
    DEAD,
    EngramHasher,
    EngramHashLayout,
    compressed_token_map,
    engram_multipliers,
    is_prime,
    ngram_history,
)

REPO = Path(__file__).resolve().parents[2]
REF_DIR = Path(__file__).resolve().parents[3] / "shared" / "reference" / "deepseek-v4.1-flash" / "inference"
TINY = REPO / "deepinfer_core" / "assets" / "deepseek-v4-tiny"

RELEASE = dict(layer_ids=(1, 14), max_ngram_size=4, n_heads=8, vocab_size=16_000_000)
RELEASE_COMPRESSED = 99_092
RELEASE_ROWS = (384_006_168, 384_016_682)


@pytest.fixture(scope="module")
def ref() -> ModuleType:
    path = REF_DIR / "engram.py"
    if not path.is_file():
        pytest.skip(f"DeepSeek's V4.1 reference engram.py is not present at {path}")
    spec = importlib.util.spec_from_file_location("deepseek_v41_ref_engram", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tokenizer():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(TINY), config=transformers.PretrainedConfig())


@pytest.fixture(scope="module")
def tiny_map(tokenizer) -> tuple[list[int], int]:
    return compressed_token_map(tokenizer)


def ref_args(**overrides) -> SimpleNamespace:
    args = dict(
        engram_layer_ids=RELEASE["layer_ids"],
        engram_max_ngram_size=RELEASE["max_ngram_size"],
        engram_n_heads=RELEASE["n_heads"],
        engram_vocab_size=RELEASE["vocab_size"],
        engram_num_embeddings=RELEASE_ROWS,
        engram_head_dim=256,
        engram_compressed_vocab_size=RELEASE_COMPRESSED,
        engram_pad_id=2,
        max_batch_size=2,
        max_seq_len=64,
    )
    args.update(overrides)
    return SimpleNamespace(**args)


# ------------------------------------------------------------------------------------------------
# (a) token map


def test_compressed_token_map_matches_reference(ref, tokenizer, tiny_map):
    expected = ref.build_compressed_token_map(tokenizer)
    assert tiny_map == expected
    token_map, size = tiny_map
    assert len(token_map) == len(tokenizer)
    assert sorted(set(token_map)) == list(range(size))
    assert size < len(tokenizer)  # the normalisation does merge tokens


# ------------------------------------------------------------------------------------------------
# (b) release layout


def test_release_layout_matches_reference(ref):
    engram_hash.engram_primes.cache_clear()
    engram_hash._prime_after.cache_clear()
    t0 = time.perf_counter()
    layout = EngramHashLayout.build(**RELEASE, token_map=range(RELEASE_COMPRESSED), pad_token_id=2)
    assert time.perf_counter() - t0 < 2.0

    expected = ref.EngramLayout.from_args(ref_args())
    assert layout.primes == expected.primes
    assert layout.num_rows == RELEASE_ROWS
    config = json.loads((REF_DIR / "config.json").read_text())
    assert list(layout.num_rows) == config["engram_num_embeddings"]
    ref_mult = ref.compute_hash_multipliers(RELEASE["layer_ids"], RELEASE["max_ngram_size"], RELEASE_COMPRESSED)
    assert layout.multipliers == tuple(tuple(row) for row in ref_mult.tolist())
    assert all(m % 2 == 1 for row in layout.multipliers for m in row)
    flat = [p for layer in layout.primes for group in layer for p in group]
    assert len(set(flat)) == len(flat) == 48 and all(is_prime(p) and p >= 16_000_000 for p in flat)
    assert layout.n_cols == 24 and layout.layer_index(14) == 1


def test_is_prime_small_and_composite():
    primes = [n for n in range(200) if is_prime(n)]
    assert primes == [n for n in range(2, 200) if all(n % d for d in range(2, int(n**0.5) + 1))]
    assert not is_prime(3_215_031_751)  # strong pseudoprime to bases 2, 3, 5, 7
    assert is_prime(2**61 - 1)


# ------------------------------------------------------------------------------------------------
# (c) hashes


SMALL_CONFIGS = [
    dict(layer_ids=(1, 14), max_ngram_size=4, n_heads=3, vocab_size=1000),
    dict(layer_ids=(2,), max_ngram_size=2, n_heads=2, vocab_size=50),
    dict(layer_ids=(0, 5, 7), max_ngram_size=3, n_heads=4, vocab_size=4096),
]


def small_setup(ref, tokenizer, tiny_map, cfg, max_batch_size):
    token_map, size = tiny_map
    layout = EngramHashLayout.build(**cfg, token_map=token_map, compressed_vocab_size=size, pad_token_id=2)
    args = ref_args(
        engram_layer_ids=cfg["layer_ids"],
        engram_max_ngram_size=cfg["max_ngram_size"],
        engram_n_heads=cfg["n_heads"],
        engram_vocab_size=cfg["vocab_size"],
        engram_num_embeddings=layout.num_rows,
        engram_compressed_vocab_size=size,
        max_batch_size=max_batch_size,
    )

    def make_state():
        ref_layout = ref.EngramLayout.from_args(args)
        assert ref_layout.primes == layout.primes
        return ref.NgramHashState(args, ref_layout, tokenizer)

    return layout, EngramHasher(layout), make_state


def random_tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    # small ids repeat often (and include the pad token) so that n-grams recur across sequences
    return [rng.randrange(8) if rng.random() < 0.3 else rng.randrange(vocab) for _ in range(n)]


def dead_span(length: int, spans: list[tuple[int, int]]) -> list[bool]:
    dead = [False] * length
    for a, b in spans:
        for i in range(a, b):
            dead[i] = True
    return dead


@pytest.mark.parametrize("cfg", SMALL_CONFIGS, ids=lambda c: f"n{c['max_ngram_size']}h{c['n_heads']}")
def test_batched_prefill_then_decode_matches_reference(ref, tokenizer, tiny_map, cfg):
    layout, hasher, make_state = small_setup(ref, tokenizer, tiny_map, cfg, max_batch_size=2)
    state = make_state()
    rng = random.Random(7)
    n, prompt, steps = layout.max_ngram_size, 11, [1, 1, 3, 1, 2]
    total = prompt + sum(steps)
    seqs = [random_tokens(rng, total, len(tokenizer)) for _ in range(2)]
    dead = [dead_span(total, [(3, 6), (prompt + 2, prompt + 3)]), dead_span(total, [(0, 1), (8, 9)])]

    pos = 0
    for chunk in [prompt, *steps]:
        ids = torch.tensor([s[pos : pos + chunk] for s in seqs])
        mask = torch.tensor([[not d for d in dd[pos : pos + chunk]] for dd in dead])
        expected = state(ids, pos, mask if not mask.all() else None)
        history = [row for s, d in zip(seqs, dead) for row in ngram_history(s, pos, chunk, n, d)]
        got = hasher(torch.tensor(history))
        assert got.dtype == torch.int64
        assert got.shape == (2 * chunk, layout.n_layers, layout.n_cols)
        assert torch.equal(got, expected.reshape(2 * chunk, layout.n_layers, layout.n_cols)), pos
        pos += chunk


@pytest.mark.parametrize("cfg", SMALL_CONFIGS, ids=lambda c: f"n{c['max_ngram_size']}h{c['n_heads']}")
def test_varlen_flat_batch_matches_reference(ref, tokenizer, tiny_map, cfg):
    """Sequences with different schedules share one flat batch; one shorter than the n-gram."""
    layout, hasher, make_state = small_setup(ref, tokenizer, tiny_map, cfg, max_batch_size=1)
    rng = random.Random(cfg["vocab_size"])
    n = layout.max_ngram_size
    schedules = [[2, 1, 1, 3], [9, 1, 2, 1], [1, 1, 0, 1], [6, 0, 4, 1]]
    spans = [[], [(2, 5)], [(1, 2)], [(5, 7), (10, 11)]]
    seqs, deads, states = [], [], []
    for sched, sp in zip(schedules, spans):
        seqs.append(random_tokens(rng, sum(sched), len(tokenizer)))
        deads.append(dead_span(sum(sched), sp))
        states.append(make_state())
    done = [0] * len(seqs)
    for step in range(len(schedules[0])):
        history, expected = [], []
        for i, (seq, dd, state) in enumerate(zip(seqs, deads, states)):
            count = schedules[i][step]
            if count == 0:
                continue
            history += ngram_history(seq, done[i], count, n, dd)
            mask = torch.tensor([[not d for d in dd[done[i] : done[i] + count]]])
            expected.append(state(torch.tensor([seq[done[i] : done[i] + count]]), done[i], mask)[0])
            done[i] += count
        got = hasher(torch.tensor(history))
        assert torch.equal(got, torch.cat(expected)), step


def test_blocked_mask_equals_dead_marker(tiny_map):
    token_map, size = tiny_map
    layout = EngramHashLayout.build(**SMALL_CONFIGS[0], token_map=token_map, pad_token_id=2)
    hasher = EngramHasher(layout)
    seq = list(range(100, 120))
    dead = dead_span(20, [(4, 7), (12, 13)])
    with_marker = torch.tensor(ngram_history(seq, 0, 20, 4, dead))
    plain = torch.tensor(ngram_history(seq, 0, 20, 4))
    blocked = torch.tensor([[d for d in row] for row in (with_marker == DEAD).tolist()])
    assert torch.equal(hasher(with_marker), hasher(plain, blocked))
    # a dead token and the slots after a blocked one hash as all-pad n-grams
    all_pad = hasher(torch.full((1, 4), BEFORE_START))
    assert torch.equal(hasher(with_marker)[5], all_pad[0])
    rows = hasher(torch.tensor([[101, DEAD, 103, 104]]))
    assert torch.equal(rows, hasher(torch.tensor([[101, BEFORE_START, BEFORE_START, BEFORE_START]])))
    assert hasher(torch.empty(0, 4, dtype=torch.long)).shape == (0, 2, 9)


def test_ngram_history_rows():
    assert ngram_history([5, 6, 7], 0, 3, 3) == [[5, -1, -1], [6, 5, -1], [7, 6, 5]]
    assert ngram_history([5, 6, 7], 2, 1, 2, dead=[False, True, False]) == [[7, DEAD]]
    assert ngram_history([5, 6, 7], 3, 0, 4) == []


# ------------------------------------------------------------------------------------------------
# (d) bad input


def test_bad_inputs_raise(tiny_map):
    token_map, size = tiny_map
    layout = EngramHashLayout.build(**SMALL_CONFIGS[0], token_map=token_map, pad_token_id=2)
    hasher = EngramHasher(layout)
    with pytest.raises(ValueError, match="max_ngram_size=4"):
        hasher(torch.zeros(3, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="max_ngram_size=4"):
        hasher(torch.zeros(3, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="max 4096"):
        hasher(torch.tensor([[len(token_map), 1, 2, 3]]))
    with pytest.raises(ValueError, match="min -3"):
        hasher(torch.tensor([[1, -3, 2, 3]]))
    with pytest.raises(ValueError, match="integer"):
        hasher(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="blocked"):
        hasher(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="does not match the checkpoint"):
        EngramHashLayout.build(**SMALL_CONFIGS[0], token_map=token_map, compressed_vocab_size=size + 1)
    with pytest.raises(ValueError, match="start"):
        ngram_history([1, 2, 3], 2, 2, 4)
    with pytest.raises(ValueError, match="max_ngram_size >= 2"):
        EngramHashLayout.build(layer_ids=(1,), max_ngram_size=1, n_heads=2, vocab_size=10, token_map=[0, 1, 2])
    with pytest.raises(ValueError, match="compressed_vocab_size must be"):
        engram_multipliers((1,), 3, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu(tiny_map):
    token_map, _ = tiny_map
    layout = EngramHashLayout.build(**RELEASE, token_map=token_map, pad_token_id=2)
    hasher = EngramHasher(layout)
    rng = random.Random(3)
    seq = random_tokens(rng, 300, len(token_map))
    history = torch.tensor(ngram_history(seq, 0, 300, 4, dead_span(300, [(40, 90)])))
    assert torch.equal(hasher.to("cuda")(history.cuda()).cpu(), hasher.to("cpu")(history))


def test_the_token_map_is_kept_per_tokenizer_until_its_files_change(tmp_path, monkeypatch):
    """An engine rebuilt on one checkpoint reuses the compressed token map; a changed tokenizer file is read
    again (and a copy comes back: the kept map is never handed out to be modified)."""
    from deepinfer_core.models.deepseek_v41 import engram
    from deepinfer_core.testing.tiny_model import build_tokenizer

    build_tokenizer(tmp_path, 300)
    calls = []
    real = engram.compressed_token_map
    monkeypatch.setattr(engram, "compressed_token_map", lambda tok: calls.append(1) or real(tok))
    engram._token_map.cache_clear()
    first = engram.token_map_of(tmp_path)
    first[0][0] = -5
    assert engram.token_map_of(tmp_path)[0][0] != -5 and len(calls) == 1
    build_tokenizer(tmp_path, 280)  # another vocabulary written over the files
    again = engram.token_map_of(tmp_path)
    assert len(calls) == 2 and len(again[0]) == 280

"""Long contexts: what a step builds on the host does not grow with the context (but for the block tables),
the compressed candidates derived on the device are the sequence's own entries, decode graphs are
chosen by the batch's contexts (so ``max_model_len`` only sets capacity) and give transformers' tokens
across context buckets and across thousands of tokens, the activation profile runs at the longest
context, and the default ``max_model_len`` comes from the checkpoint, capped by the pools."""

from __future__ import annotations

import logging

import engine_fixtures
import pytest
import torch
from engine_fixtures import greedy, hf_argmax, make_prompt, run_tokens

from deepinfer_core.config import ModelConfig, SchedulerConfig
from deepinfer_core.engine.memory import profile_activation_bytes
from deepinfer_core.model.cache import CompressorSpec, ModelCache, bytes_per_block
from deepinfer_core.model.metadata import GraphPadding, SeqSpan, build_forward_batch, compressed_candidates
from deepinfer_core.platform import Platform
from deepinfer_core.testing.tiny_model import build_tiny_checkpoint
from deepinfer_core.worker.graph_runner import GraphRunner, context_buckets

make_llm = engine_fixtures.make_llm
one_torch_thread = engine_fixtures.one_torch_thread
tiny_path = engine_fixtures.tiny_path

BS = 16
SPECS = {CompressorSpec(4, 8, True), CompressorSpec(8, 8, False)}
WINDOW = 8


def _spans(context: int, new: int, count: int = 1) -> list[SeqSpan]:
    table = list(range(-(-(context + new) // BS)))
    return [SeqSpan(context, new, table, table, slot) for slot in range(count)]


def _sizes(batch) -> dict[str, int]:
    return {name: t.numel() * t.element_size() for name, t in batch.tensors().items()}


@pytest.mark.parametrize("new", [1, 64])
def test_host_batch_does_not_grow_with_context_but_for_the_block_tables(new):
    """One decode token (or a 64-token chunk) at contexts 1K and 16K: every host tensor the step builds
    has the same size, except the block tables (one id per block of 16 tokens)."""
    short, long = (build_forward_batch([5] * new, _spans(c, new), SPECS, BS, WINDOW) for c in (1024, 16384))
    a, b = _sizes(short), _sizes(long)
    assert a.keys() == b.keys()
    assert {k for k in a if a[k] != b[k]} == {"block_tables"}
    assert b["block_tables"] - a["block_tables"] == 8 * (16384 - 1024) // BS
    assert sum(a.values()) - a["block_tables"] == sum(b.values()) - b["block_tables"]


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("context", [0, 5, 7, 8, 9, 15, 16, 17, 23, 24, 25, 1000, 16383, 16384])
def test_window_rows_read_only_the_blocks_the_windows_reach(context, padded):
    """The window indices of a step come from the window table's last blocks alone: released ones (-1, as
    the block manager leaves them) and live ones before the window give the same batch, across block and
    window boundaries; two sequences of different contexts, so that each keeps its own first block."""
    new = 1 if padded else 3

    def spans(released: bool) -> list[SeqSpan]:
        out = []
        for slot, ctx in enumerate((context, context // 2 + 3)):
            table = list(range(100 * slot, 100 * slot + -(-(ctx + new) // BS) + 1))
            first = max(0, ctx - WINDOW + 1) // BS
            window = [-1] * first + table[first:] if released else table
            out.append(SeqSpan(ctx, new, table, window, slot))
        return out

    kw = {"pad": GraphPadding(4, {4: 16384 // 4 + 2, 8: 16384 // 8 + 2}, 16392)} if padded else {}
    a, b = (build_forward_batch([5] * (2 * new), spans(r), SPECS, BS, WINDOW, list(range(2 * new)), **kw)
            for r in (False, True))
    assert torch.equal(a.window_slots, b.window_slots) and torch.equal(a.window_rows(), b.window_rows())

    def row(span: SeqSpan, q: int) -> int:
        return -1 if q < 0 else span.block_table[q // BS] * BS + q % BS

    for t, (span, i) in enumerate((sp, i) for sp in spans(False) for i in range(new)):
        p = span.context_len + i
        assert b.window_slots[t] == row(span, p)
        assert b.window_rows()[t].tolist() == [row(span, q) for q in range(p - WINDOW + 1, p + 1)]


def test_graph_layout_follows_its_context_bucket():
    """A graph layout's host batch is as large as its context bucket needs, whatever max_model_len is."""
    pads = {c: GraphPadding(4, {4: c // 4, 8: c // 8}, c) for c in (1024, 16384)}
    a, b = (_sizes(build_forward_batch([5], _spans(1000, 1), SPECS, BS, WINDOW, [0], pad=pads[c])) for c in pads)
    assert {k for k in a if a[k] != b[k]} == {"block_tables"}
    assert a["block_tables"] == 8 * 4 * 1024 // BS
    with pytest.raises(ValueError, match="holds"):
        build_forward_batch([5], _spans(1100, 1), SPECS, BS, WINDOW, [0], pad=pads[1024])


def test_candidates_are_the_sequences_own_entries():
    """Against a direct enumeration: query t of sequence s attends entry e of s for every e < (p+1)//rate
    (p its position), at row table[s][e*rate // BS] * (BS // rate) + e % (BS // rate), then -1; a
    released (-1) block gives -1."""
    spans = [SeqSpan(37, 5, [3, 9, 4], [0, 1, 2], 0), SeqSpan(0, 3, [7], [5], 1),
             SeqSpan(70, 1, [2, -1, 8, 6, 11], [6, 7, 8, 9, 10], 2)]
    ids = [5] * sum(s.num_new for s in spans)
    batch = build_forward_batch(ids, spans, SPECS, BS, WINDOW)
    for rate in (4, 8):
        got = compressed_candidates(batch, rate, BS)
        rows = []
        for s in spans:
            for p in range(s.context_len, s.seq_len):
                row = []
                for e in range((p + 1) // rate):
                    block = s.block_table[e * rate // BS]
                    row.append(-1 if block < 0 else block * (BS // rate) + e % (BS // rate))
                rows.append(row)
        width = max(s.seq_len for s in spans) // rate
        assert got.shape == (len(ids), width)
        assert got.tolist() == [r + [-1] * (width - len(r)) for r in rows]


def test_context_buckets():
    assert context_buckets(4096, 16) == [1024, 2048, 4096]
    assert context_buckets(5000, 128) == [1024, 2048, 4096, 5120]
    assert context_buckets(1 << 20, 128)[-1] == 1 << 20 and len(context_buckets(1 << 20, 128)) == 11
    assert context_buckets(300, 16, smallest=64) == [64, 128, 256, 304]
    assert context_buckets(100, 128) == [128]


def test_graph_buckets_are_chosen_by_context(make_llm, tiny_path):
    """The layout of a decode step depends on its batch size and longest context only: at a fixed context
    max_model_len changes nothing; the static inputs of a bucket are sized by the bucket; the two staging
    buffers are shared by every graph."""
    llm = make_llm(tiny_path("tiny"), dtype="float32", max_num_seqs=4)
    engine = llm.llm_engine
    model, cache = engine.model, engine.cache
    runners = {m: GraphRunner(model, cache, [1, 2, 4], m, BS, capture=False, min_context=64) for m in (512, 4096)}
    rows = [0, 1, 2]
    for context, bucket in ((10, 64), (63, 64), (64, 128), (200, 256), (511, 512)):
        spans = _spans(context, 1, 2) + _spans(5, 1)
        pads = [r.padding_for(spans, rows) for r in runners.values()]
        assert pads[0] == pads[1]
        assert (pads[0].num_seqs, pads[0].context) == (4, bucket)
        assert pads[0].max_entries == {4: bucket // 4, 8: bucket // 8}
    assert runners[512].padding_for(_spans(512, 1), [0]) is None  # longer than the largest bucket: eager
    assert runners[4096].padding_for(_spans(512, 1), [0]).context == 1024
    big = runners[4096]
    assert set(big.inputs) == {(s, c, 1) for s in (1, 2, 4) for c in (64, 128, 256, 512, 1024, 2048, 4096)}
    for (size, context, _), static in big.inputs.items():
        assert static.batch.block_tables.shape == (size, context // BS)
        assert static.batch.entry_widths == {4: context // 4, 8: context // 8}
    largest = max(s.packed.numel() for s in big.inputs.values())
    assert [b.numel() for b in big.staging.buffers] == [largest, largest]


LONG_PROMPTS = [2, 13, 29, 60, 61, 125]  # decode crosses the context buckets 16, 32, 64, 128


class _Rerun:
    """A "captured graph" that reruns the forward on replay into its output buffer."""

    def __init__(self, forward, key):
        self.forward, self.key, self.replays = forward, key, 0
        self.output = tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in forward(key))

    def replay(self):
        """Tensors are copied into the captured ones, as a replay rewrites them; anything else (a
        prologue's record) is the rerun's."""
        self.replays += 1
        self.output = tuple(old.copy_(new) if isinstance(old, torch.Tensor) else new
                            for old, new in zip(self.output, self.forward(self.key)))


class _RerunPlatform(Platform):
    supports_graphs = True

    def capture_graphs(self, keys, forward):
        self.captured = sorted(keys, reverse=True)
        return {key: _Rerun(forward, key) for key in self.captured}


class _KeepOutputPlatform(Platform):
    """A "capture" that keeps what the forward of each key returned (no replay)."""

    supports_graphs = True

    def capture_graphs(self, keys, forward):
        return {key: _Kept(forward(key)) for key in sorted(keys, reverse=True)}


class _Kept:
    def __init__(self, output):
        self.output = output


def test_graphs_of_one_query_length_share_their_output_buffers(make_llm, tiny_path):
    """Every graph's logits (and streams) are views of one buffer per query length, sized for the
    largest batch, not one vocab-wide buffer per (size, context bucket)."""
    llm = make_llm(tiny_path("tiny"), dtype="float64", max_num_seqs=8)
    engine = llm.llm_engine
    runner = GraphRunner(engine.model, engine.cache, [1, 2, 4, 8], 256, BS, platform=_KeepOutputPlatform(engine.device),
                         min_context=16, query_lens=(1, 3), keep_streams=True)
    storages = {}
    for (size, _, q), graph in runner.graphs.items():
        logits, streams, _ = graph.output
        assert logits.shape[0] == streams.shape[0] == size * q
        storages.setdefault(q, set()).add((logits.untyped_storage().data_ptr(), streams.untyped_storage().data_ptr()))
    assert {q: len(ptrs) for q, ptrs in storages.items()} == {1: 1, 3: 1}
    vocab = engine.model_config.vocab_size
    assert [t.shape for t in runner._outputs[3]][0] == (8 * 3, vocab)


def test_padded_decode_across_context_buckets_matches_transformers(make_llm, tiny_path):
    """Graphs captured per (size, context bucket, query length 1); each decode step replays the graph of
    its batch size and longest context, and the tokens are transformers'."""
    path = tiny_path("tiny")
    llm = make_llm(path, dtype="float64", max_num_seqs=8)
    engine = llm.llm_engine
    platform = _RerunPlatform(engine.device)
    runner = engine.runner.graph_runner = GraphRunner(engine.model, engine.cache, [1, 2, 4, 8],
                                                      engine.scheduler_config.max_model_len, BS,
                                                      platform=platform, min_context=16)
    assert set(runner.graphs) == {(n, c, 1) for n in [1, 2, 4, 8] for c in runner.contexts}
    assert set(runner.contexts) == {16 << i for i in range(9)}
    assert platform.captured[0] == (8, 4096, 1)

    def replayed() -> set[tuple[int, int]]:
        return {(n, c) for (n, c, _), g in runner.graphs.items() if g.replays}

    prompts = [make_prompt(n, seed=i) for i, n in enumerate(LONG_PROMPTS)]
    params = [greedy(max_tokens=6 + i) for i in range(len(prompts))]
    alone = [run_tokens(llm, [p], q)[0] for p, q in zip(prompts, params)]  # each its own buckets
    assert replayed() == {(1, c) for c in (16, 32, 64, 128, 256)}
    for graph in runner.graphs.values():
        graph.replays = 0
    together = run_tokens(llm, prompts, params)  # the longest sequence picks the bucket
    assert {c for _, c in replayed()} == {128, 256} and {n for n, _ in replayed()} >= {8, 4}
    assert together == alone
    for prompt, tokens in zip(prompts, alone):
        assert tokens == hf_argmax(path, prompt, tokens)


def test_thousands_of_tokens_match_transformers(make_llm, tiny_path):
    """A prompt crossing hundreds of compression windows and blocks, prefilled in chunks, then decoded
    through graph layouts across the 2048-token bucket boundary."""
    path = tiny_path("tiny")
    llm = make_llm(path, dtype="float64", max_num_seqs=2, max_num_batched_tokens=512)
    engine = llm.llm_engine
    runner = engine.runner.graph_runner = GraphRunner(engine.model, engine.cache, [1, 2],
                                                      engine.scheduler_config.max_model_len, BS, capture=False)
    keys = []
    original = runner.replay
    runner.replay = lambda batch: keys.append(batch.padded_context) or original(batch)
    prompt = make_prompt(2044, seed=3)
    tokens = run_tokens(llm, [prompt], greedy(max_tokens=8))[0]
    assert set(keys) == {2048, 4096}
    assert tokens == hf_argmax(path, prompt, tokens)


def test_padded_equals_unpadded_at_a_long_context(tiny_path):
    """One decode step at context 1500 laid out for a graph bucket of 2048 gives the unpadded logits."""
    from deepinfer_core.models import load_model
    from deepinfer_core.testing.model_runner import SimpleRunner

    model = load_model(tiny_path("tiny"), "cpu_ref", torch.float64)
    run = SimpleRunner(model, 1, 1600, block_size=BS)
    prompt = make_prompt(1500, seed=4)
    for start in range(0, len(prompt), 500):
        run.step({0: prompt[start:start + 500]})
    spans = [SeqSpan(1500, 1, run.table(0), run.table(0), 0)]
    specs, window = model.compressor_specs(), model.cfg.sliding_window
    before = [t.clone() for t in run.cache.comp_kv.values()]
    plain, _ = model.forward(build_forward_batch([7], spans, specs, BS, window), run.cache)
    for t, b in zip(run.cache.comp_kv.values(), before):
        t.copy_(b)
    pad = GraphPadding(2, {4: 512, 8: 256}, 2048)
    padded, _ = model.forward(build_forward_batch([7], spans, specs, BS, window, [0], pad=pad), run.cache)
    torch.testing.assert_close(padded[:1], plain, rtol=0, atol=1e-12)


class _RecordingPlatform(Platform):
    def __init__(self, device):
        super().__init__(device)
        self.calls = 0

    def peak_memory_of(self, fn):
        self.calls += 1
        fn()
        return 1000


def test_activation_profile_runs_at_the_longest_context(tiny_path):
    """The profile runs a full token budget ending at max_model_len and a decode step of max_num_seqs
    sequences at max_model_len (of 1 + k tokens each when speculating), from a cache of one chunk's
    blocks."""
    from deepinfer_core.models import load_model

    model = load_model(tiny_path("tiny"), "cpu_ref", torch.float32)
    seen = []
    forward = model.forward
    model.forward = lambda batch, cache: seen.append((batch.positions.clone(), cache.num_blocks)) or forward(
        batch, cache)
    sched = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64, max_model_len=4000)
    platform = _RecordingPlatform(torch.device("cpu"))
    total = profile_activation_bytes(model, sched, BS, platform)
    vocab_row = model.cfg.vocab_size * 4
    assert platform.calls == 2 and total == 2000 + 8 * 3 * vocab_row + 3 * vocab_row  # + the graphs' logits
    (chunk, blocks), (decode, _) = seen
    assert chunk.tolist() == list(range(4000 - 64, 4000)) and blocks == 64 // BS + 1
    assert decode.tolist() == [3999] * 3
    seen.clear()
    total = profile_activation_bytes(model, sched, BS, platform, query_len=4)  # verifications of 3 drafts
    undo = total - (2000 + 8 * 3 * vocab_row + 3 * (1 + 4) * vocab_row)  # + the verification graphs' undo log
    cache = ModelCache(model.cfg, 2, 2, 1, BS, model.dtype, model.device)
    window_rows = 3 * 4 * model.cfg.num_hidden_layers * cache.window_kv[0][0].nbytes  # every token's window row
    assert window_rows < undo < 20 * window_rows
    _, (decode, _) = seen
    assert decode.tolist() == [3996, 3997, 3998, 3999] * 3


@pytest.fixture(scope="module")
def long_tiny(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("long_tiny"), "tiny", max_position_embeddings=32768)


def test_default_max_model_len_is_the_checkpoints(make_llm, long_tiny):
    llm = make_llm(long_tiny, dtype="float32", max_num_seqs=2, kv_cache_bytes=64 << 20)
    engine = llm.llm_engine
    assert engine.scheduler_config.max_model_len == 32768
    assert engine.pool_sizes.num_blocks * BS >= 32768


def test_default_max_model_len_is_capped_by_the_pools(make_llm, long_tiny, caplog):
    cfg = ModelConfig.from_pretrained(long_tiny)
    comp, window = bytes_per_block(cfg, BS, torch.float32)
    with caplog.at_level(logging.INFO, logger="deepinfer_core.engine.llm_engine"):
        llm = make_llm(long_tiny, dtype="float32", max_num_seqs=2, kv_cache_bytes=300 * comp + 64 * window + (1 << 20))
    engine = llm.llm_engine
    capacity = engine.pool_sizes.num_blocks * BS
    assert capacity < 32768 and engine.scheduler_config.max_model_len == capacity
    assert any("capped" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("x", {"prompt_token_ids": make_prompt(capacity + 1, seed=0)}, greedy(2))
    explicit = make_llm(long_tiny, dtype="float32", max_num_seqs=2, max_model_len=32768,
                        kv_cache_bytes=300 * comp + 64 * window + (1 << 20))
    assert explicit.llm_engine.scheduler_config.max_model_len == 32768


def test_prefix_hit_on_a_long_history_matches_transformers(make_llm, tiny_path):
    """An agent turn re-sending a 2K-token history (plus its answer and a new message) is served from the
    cache up to the last full block, decodes through the graph layouts, and gives transformers' tokens."""
    path = tiny_path("tiny")
    llm = make_llm(path, dtype="float64", max_num_seqs=2, max_num_batched_tokens=512)
    engine = llm.llm_engine
    engine.runner.graph_runner = GraphRunner(engine.model, engine.cache, [1, 2], engine.scheduler_config.max_model_len,
                                             BS, capture=False)
    history = make_prompt(2030, seed=5)
    answer = run_tokens(llm, [history], greedy(max_tokens=6))[0]
    turn = history + answer + make_prompt(9, seed=6)
    out = llm.generate([{"prompt_token_ids": turn}], greedy(max_tokens=6), use_tqdm=False)[0]
    assert out.num_cached_tokens >= (len(history) // BS - 1) * BS
    tokens = out.outputs[0].token_ids
    assert tokens == hf_argmax(path, turn, tokens)

"""The device sampler: counter-based noise against a pure-Python splitmix64, its distribution, the greedy
fast path, batch independence of every row, logprob layout and device-built penalties."""

from __future__ import annotations

import math

import pytest
import torch
from deepinfer_cpu_ref.ops import ALL_OPS
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.sampling.random import exponential_noise, noise_seed, sampling_noise
from deepinfer_core.sampling.sampler import Sampler

VOCAB = 384
MASK = (1 << 64) - 1


def splitmix64_stream(seed: int, count: int) -> list[int]:
    """The first ``count`` outputs of splitmix64 seeded with ``seed`` (unsigned Python integers)."""
    out, state = [], seed & MASK
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) & MASK
        z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        out.append(z ^ (z >> 31))
    return out


def as_int64(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


@pytest.mark.parametrize("seed", [0, 1, 2**63 - 1, 2**63, 2**64 - 1, 0xDEADBEEFCAFEF00D])
def test_noise_is_the_splitmix64_stream(seed):
    expected = []
    for z in splitmix64_stream(seed, 70):
        top = as_int64(z) >> 12  # the top 52 bits as a signed number
        expected.append(-math.log((top + 2**51 + 0.5) * 2.0**-52))
    got = exponential_noise(torch.tensor([as_int64(seed)]), 70)[0].tolist()
    assert got == pytest.approx(expected, rel=1e-15, abs=0)  # the uniforms are exact; log may round apart


def test_a_noise_row_does_not_depend_on_the_batch():
    seeds = torch.randint(-2**62, 2**62, (24,), generator=torch.Generator().manual_seed(0))
    for vocab in (70, 384, 1001):
        full = exponential_noise(seeds, vocab)
        for lo, hi in ((0, 1), (5, 6), (3, 8), (0, 17), (23, 24)):
            assert torch.equal(exponential_noise(seeds[lo:hi], vocab), full[lo:hi])


class TracingOps:
    """The cpu_ref ops, recording which were called."""

    def __init__(self):
        self.called: list[str] = []

    def __getattr__(self, name):
        fn = ALL_OPS[name]

        def traced(*args, **kw):
            self.called.append(name)
            return fn(*args, **kw)

        return traced


def seq(params: SamplingParams, seed: int = 0, outputs=(), prompt=(5,)) -> Sequence:
    s = Sequence("r", 0, list(prompt), params, torch.Generator().manual_seed(seed))
    s.output_token_ids = list(outputs)
    return s


def test_noise_is_exponential_and_independent_across_rows_and_positions():
    noise = exponential_noise(torch.tensor([as_int64(noise_seed(s, p)) for s in range(8) for p in range(8)]), 4096)
    assert noise.min() > 0 and torch.isfinite(noise).all()
    assert abs(noise.mean().item() - 1) < 0.01 and abs(noise.var().item() - 1) < 0.03
    u = torch.exp(-noise)  # uniform on (0, 1) if the noise is Exp(1)
    hist = torch.histc(u, bins=16, min=0, max=1)
    assert (hist / u.numel() - 1 / 16).abs().max() < 0.003
    corr = torch.corrcoef(noise[:, :1024])
    assert (corr - torch.eye(64)).abs().max() < 0.15  # no two rows alike


def test_sampling_noise_follows_the_output_position():
    params = SamplingParams(temperature=1.0)
    a, b = seq(params, seed=9), seq(params, seed=9, prompt=(7, 8, 9))
    assert torch.equal(sampling_noise(a, VOCAB), sampling_noise(b, VOCAB))
    expected = exponential_noise(torch.tensor([as_int64(noise_seed(9, 2))]), VOCAB)[0]
    a.output_token_ids = [3, 4]
    assert torch.equal(sampling_noise(a, VOCAB), expected)


def test_all_greedy_batch_is_one_argmax():
    ops = TracingOps()
    sampler = Sampler(ops, VOCAB, [1])
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(0))
    out = sampler(logits, [seq(SamplingParams(temperature=0)) for _ in range(5)])
    assert ops.called == [] and out.logprobs is None
    assert out.sampled_token_ids.dtype == torch.long and torch.equal(out.sampled_token_ids, logits.argmax(-1))
    # plain temperature sampling needs no filter op either
    out = sampler(logits, [seq(SamplingParams(temperature=0.8), seed=i) for i in range(5)])
    assert ops.called == ["random_sample"]


ROW_PARAMS = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=5),
              SamplingParams(temperature=1.3, top_p=0.8, logprobs=2), SamplingParams(temperature=1.0, min_p=0.1),
              SamplingParams(temperature=0, logprobs=0), SamplingParams(temperature=0.9, presence_penalty=0.7),
              SamplingParams(temperature=0.5, min_tokens=3, stop_token_ids=[4], logprobs=5)]


@settings(max_examples=25, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(0, len(ROW_PARAMS) - 1), st.integers(0, 2**62),
                               st.lists(st.integers(0, VOCAB - 1), max_size=4)), min_size=1, max_size=6),
       logit_seed=st.integers(0, 1000))
def test_each_row_is_sampled_as_if_alone(rows, logit_seed):
    sampler = Sampler(TracingOps(), VOCAB, [1])
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(logit_seed), dtype=torch.float64)
    seqs = [seq(ROW_PARAMS[k], seed=s, outputs=outs) for k, s, outs in rows]
    tokens, logprobs = sampler(logits, seqs).to_host().tolists(seqs)
    for i, s in enumerate(seqs):
        alone_tokens, alone_logprobs = sampler(logits[i : i + 1], [s]).to_host().tolists([s])
        assert [tokens[i]] == alone_tokens and [logprobs[i]] == alone_logprobs
        n = s.params.logprobs
        if n is None:
            assert logprobs[i] is None
        else:
            raw = torch.log_softmax(logits[i], -1)
            assert set(logprobs[i]) == set(raw.topk(n).indices.tolist()) | {tokens[i]}
            assert all(v == raw[t].item() for t, v in logprobs[i].items())


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 40), min_size=1, max_size=8),
                          st.lists(st.integers(0, 40), max_size=8)), min_size=1, max_size=4))
def test_penalties_built_on_the_device_match_the_host_masks(histories):
    params = SamplingParams(temperature=0, repetition_penalty=1.4, presence_penalty=0.3, frequency_penalty=0.2)
    seqs = [seq(params, prompt=p, outputs=o) for p, o in histories]
    logits = torch.randn(len(seqs), 41, generator=torch.Generator().manual_seed(len(seqs)), dtype=torch.float64)
    prompt_mask = torch.zeros(len(seqs), 41, dtype=torch.bool)
    counts = torch.zeros(len(seqs), 41, dtype=torch.long)
    for row, (p, o) in enumerate(histories):
        prompt_mask[row, p] = True
        for t in o:
            counts[row, t] += 1
    col = torch.tensor([1.4] * len(seqs), dtype=torch.float64)
    expected = ALL_OPS["apply_penalties"](logits, prompt_mask, counts, col, col * 0 + 0.3, col * 0 + 0.2)
    got = Sampler(TracingOps(), 41, [1])._penalise(logits, seqs)
    assert torch.equal(got, expected)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 40), min_size=1, max_size=8),
                          st.lists(st.integers(0, 40), max_size=8),
                          st.lists(st.integers(0, 40), min_size=3, max_size=3), st.booleans()), min_size=1, max_size=4))
def test_verification_rows_are_penalised_by_the_outputs_and_the_drafts_before_them(histories):
    """Row j of a verification is the position after its drafts 0..j-1: it is penalised as the plain
    sampler penalises a sequence whose outputs end with those drafts; unpenalised sequences keep their
    logits, and the persistent state counts only real outputs."""
    penalised = SamplingParams(temperature=0, repetition_penalty=1.4, presence_penalty=0.3, frequency_penalty=0.2)
    seqs = [seq(penalised if pen else SamplingParams(temperature=0), prompt=p, outputs=o)
            for p, o, _, pen in histories]
    drafts = torch.tensor([d for _, _, d, _ in histories])
    q = drafts.shape[1] + 1
    logits = torch.randn(len(seqs), q, 41, generator=torch.Generator().manual_seed(len(seqs)), dtype=torch.float64)
    sampler = Sampler(TracingOps(), 41, [1])
    got = sampler.penalise_verification(logits, seqs, drafts)
    for i, (p, o, d, pen) in enumerate(histories):
        for j in range(q):
            alone = seq(seqs[i].params, prompt=p, outputs=o + d[:j])
            want = Sampler(TracingOps(), 41, [1])._penalise(logits[i, j : j + 1], [alone])
            assert torch.equal(got[i, j : j + 1], want), (i, j)
        if pen:  # the next step counts only what was output
            assert sampler.penalties.counts[sampler.penalties.rows[seqs[i].seq_id]].sum().item() == len(o)


def test_penalised_steps_cost_the_same_device_ops_for_any_number_of_sequences():
    """A penalised step gathers its rows and counts its outputs in a fixed number of ops, not one or more
    per sequence (each a launch paced by the host on a GPU), and frees rows for later sequences."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    penalised = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.1, repetition_penalty=1.2)
    counts = {}
    for n in (2, 16):
        sampler = Sampler(TracingOps(), VOCAB, [1])
        seqs = [seq(penalised if i % 4 else SamplingParams(temperature=0), outputs=[i, 7], prompt=(3, i))
                for i in range(n)]
        sampler(torch.randn(n, VOCAB), seqs)  # first sight: each row's prompt mask written
        with Count() as c:
            out = sampler(torch.randn(n, VOCAB), seqs)
            sampler.count_outputs(seqs, out.sampled_token_ids.unsqueeze(1))
        counts[n] = c.ops
        for i, s in enumerate(seqs):
            sampler.mark_counted(s, 1)
            if i % 4:
                row = sampler.penalties.rows[s.seq_id]
                s.output_token_ids.append(int(out.sampled_token_ids[i]))
                expected = torch.bincount(torch.tensor(s.output_token_ids), minlength=VOCAB)
                assert torch.equal(sampler.penalties.counts[row], expected), i
        for s in seqs:
            sampler.free(s.seq_id)
        assert not sampler.penalties.rows and len(sampler.penalties._free) == sampler.penalties.counts.shape[0] - 1
    assert counts[2] == counts[16], counts

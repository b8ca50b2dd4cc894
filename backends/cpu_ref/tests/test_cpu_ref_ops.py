"""Independent checks that the cpu_ref reference implements the catalogue's semantics.

The conformance suite takes cpu_ref as ground truth; these tests check that truth against hand-worked
examples, plain formulas written out again here (loops, not the reference's vectorised code) and
known properties.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from deepinfer_cpu_ref import ops

from deepinfer_core.ops.catalogue import CATALOGUE
from deepinfer_core.testing import conformance as conf

f64 = torch.float64
NAN, INF = float("nan"), float("inf")


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def g(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, seed: int = 0, dtype: torch.dtype = f64) -> torch.Tensor:
    return torch.randn(shape, generator=g(seed), dtype=f64).to(dtype)


def close(a: torch.Tensor, b: torch.Tensor, atol: float = 1e-12, rtol: float = 1e-12) -> None:
    torch.testing.assert_close(a.to(f64), b.to(f64), atol=atol, rtol=rtol, equal_nan=True)


def test_every_catalogued_op_has_a_reference():
    assert set(ops.ALL_OPS) == set(CATALOGUE)


# --- dtypes ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", sorted(CATALOGUE))
def test_float64_inputs_give_float64_outputs(op):
    for case in conf.make_cases(op, "tiny", f64):
        outs = ops.ALL_OPS[op](*case.args)
        for out in outs if isinstance(outs, tuple) else (outs,):
            if out.dtype.is_floating_point:
                assert out.dtype == f64, f"{op}[{case.name}] returned {out.dtype}"
            else:  # ids; DeepSeek's FP8 KV entries are bytes
                want = torch.uint8 if op == "kv_fp8_pack" else torch.long
                assert out.dtype == want, f"{op}[{case.name}] returned {out.dtype}"


@pytest.mark.parametrize("op", sorted(CATALOGUE))
def test_low_precision_inputs_give_the_documented_output_dtypes(op):
    for case in conf.make_cases(op, "tiny", torch.bfloat16):
        outs = ops.ALL_OPS[op](*case.args)
        for want, out in zip(case.out_dtypes, outs if isinstance(outs, tuple) else (outs,)):
            if want is not None:
                assert out.dtype == want, f"{op}[{case.name}] returned {out.dtype}, want {want}"


# --- embedding, norms, projections ---------------------------------------------------------------


def test_embedding_is_a_row_lookup():
    weight = randn(10, 3)
    ids = torch.tensor([4, 0, 9, 4])
    out = ops.embedding(ids, weight)
    assert torch.equal(out, torch.stack([weight[4], weight[0], weight[9], weight[4]]))


def test_rms_norm_matches_the_formula():
    x, w = randn(3, 16, seed=1), randn(16, seed=2)
    for weight in (w, None):
        want = torch.stack([row / math.sqrt(float((row**2).mean()) + 1e-6) for row in x])
        if weight is not None:
            want = want * weight
        close(ops.rms_norm(x, weight, 1e-6), want)


def test_rms_norm_computes_in_float32_for_half_inputs():
    x = (300 + 10 * randn(2, 64, seed=3)).to(torch.float16)  # x^2 overflows float16
    out = ops.rms_norm(x, None, 1e-6)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    close(out, ops.rms_norm(x.to(f64), None, 1e-6), atol=2e-3, rtol=2e-3)


def test_linear_and_grouped_linear_match_loops():
    x, w, b = randn(2, 3, 5, seed=4), randn(4, 5, seed=5), randn(4, seed=6)
    want = torch.tensor(
        [
            [[sum(x[i, t, k] * w[n, k] for k in range(5)) + b[n] for n in range(4)] for t in range(3)]
            for i in range(2)
        ],
        dtype=f64,
    )
    close(ops.linear(x, w, b), want)
    close(ops.linear(x, w, None), want - b)

    groups, n, k = 3, 2, 4
    xg, wg = randn(5, groups, k, seed=7), randn(groups * n, k, seed=8)
    out = ops.grouped_linear(xg, wg)
    for grp in range(groups):
        close(out[:, grp], xg[:, grp] @ wg[grp * n : (grp + 1) * n].T)


def test_swiglu_clamps_gate_above_and_up_both_sides():
    gate_up = torch.tensor([[20.0, -3.0, 0.5, 15.0, -15.0, 2.0]], dtype=f64)
    out = ops.swiglu(gate_up, 10.0)
    silu = lambda v: v / (1 + math.exp(-v))  # noqa: E731
    close(out, torch.tensor([[silu(10.0) * 10.0, silu(-3.0) * -10.0, silu(0.5) * 2.0]], dtype=f64))


# --- rotary ----------------------------------------------------------------------------------------


def _angles(tokens: int, pairs: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    theta = torch.rand(tokens, pairs, generator=g(seed), dtype=f64) * 2 * math.pi
    return theta.cos(), theta.sin()


def test_rotary_rotates_interleaved_pairs_of_the_trailing_channels():
    T, H, D, R = 2, 3, 10, 6
    x = randn(T, H, D, seed=9)
    cos, sin = _angles(T, R // 2, seed=10)
    out = ops.rotary_emb(x, cos, sin, False)
    assert torch.equal(out[..., : D - R], x[..., : D - R])  # leading channels untouched
    for t in range(T):
        for h in range(H):
            for i in range(R // 2):
                a, b = x[t, h, D - R + 2 * i], x[t, h, D - R + 2 * i + 1]
                c, s = cos[t, i], sin[t, i]
                close(out[t, h, D - R + 2 * i], a * c - b * s)
                close(out[t, h, D - R + 2 * i + 1], a * s + b * c)


def test_rotary_inverse_undoes_rotary_and_preserves_pair_norms():
    T, H, D, R = 4, 2, 16, 16
    x = randn(T, H, D, seed=11)
    cos, sin = _angles(T, R // 2, seed=12)
    y = ops.rotary_emb(x, cos, sin, False)
    close(ops.rotary_emb(y, cos, sin, True), x)
    close(ops.rotary_emb(ops.rotary_emb(x, cos, sin, True), cos, sin, False), x)
    pair_norm = lambda v: v.view(T, H, D // 2, 2).norm(dim=-1)  # noqa: E731
    close(pair_norm(y), pair_norm(x))
    # a quarter turn maps (a, b) to (-b, a)
    quarter = ops.rotary_emb(x, torch.zeros(T, R // 2, dtype=f64), torch.ones(T, R // 2, dtype=f64), False)
    close(quarter[..., 0::2], -x[..., 1::2])
    close(quarter[..., 1::2], x[..., 0::2])


# --- sparse attention ------------------------------------------------------------------------------


def _dense_attention(q, rows_per_token, sinks, scale):
    """softmax([q.k * scale for k in rows] + [sink]) over the listed rows, by hand."""
    T, H, D = q.shape
    out = torch.zeros(T, H, D, dtype=f64)
    for t in range(T):
        for h in range(H):
            logits = [float(q[t, h] @ k) * scale for k in rows_per_token[t]]
            denom = sum(math.exp(v) for v in logits) + math.exp(float(sinks[h]))
            for v, k in zip(logits, rows_per_token[t]):
                out[t, h] += math.exp(v) / denom * k
    return out


def _attention_example():
    T, H, D = 3, 2, 4
    q = randn(T, H, D, seed=13)
    kv = randn(6, D, seed=14)
    kv[0] = NAN  # never referenced
    kv[5] = NAN
    extra = randn(3, D, seed=15)
    extra[2] = NAN
    indices = torch.tensor([[1, 3, -1], [-1, 4, 2], [-1, -1, -1]])
    extra_indices = torch.tensor([[0, -1], [1, 0], [-1, -1]])
    sinks = torch.tensor([0.3, -1.2], dtype=f64)
    return q, kv, indices, sinks, 0.7, extra, extra_indices


def test_sparse_attention_equals_dense_softmax_with_sink():
    q, kv, indices, sinks, scale, extra, extra_indices = _attention_example()
    rows = [
        [kv[i] for i in indices[t] if i >= 0] + [extra[i] for i in extra_indices[t] if i >= 0]
        for t in range(3)
    ]
    out = ops.sparse_attention(q, kv, indices, sinks, scale, extra, extra_indices)
    close(out, _dense_attention(q, rows, sinks, scale))
    assert torch.equal(out[2], torch.zeros_like(out[2]))  # only the sink: output 0

    rows = [[kv[i] for i in indices[t] if i >= 0] for t in range(3)]
    close(ops.sparse_attention(q, kv, indices, sinks, scale), _dense_attention(q, rows, sinks, scale))


def test_sparse_attention_all_minus_one_is_zero_and_never_reads_the_pool():
    q = randn(2, 3, 4, seed=16)
    kv = torch.full((5, 4), NAN, dtype=f64)
    out = ops.sparse_attention(q, kv, torch.full((2, 7), -1), randn(3, seed=17), 0.5)
    assert torch.equal(out, torch.zeros_like(out))


def test_sparse_attention_slot_order_does_not_matter():
    q, kv, indices, sinks, scale, extra, extra_indices = _attention_example()
    perm = torch.tensor([2, 0, 1])
    a = ops.sparse_attention(q, kv, indices, sinks, scale, extra, extra_indices)
    b = ops.sparse_attention(q, kv, indices[:, perm], sinks, scale, extra, extra_indices.flip(-1))
    close(a, b)


def test_sinks_only_lower_the_attention_mass():
    q, kv, indices, sinks, scale, _, _ = _attention_example()
    without = ops.sparse_attention(q, kv, indices, torch.full_like(sinks, -INF), scale)
    prev = None
    for s in (-2.0, 0.0, 2.0):
        with_sink = ops.sparse_attention(q, kv, indices, torch.full_like(sinks, s), scale)
        for t in range(2):
            for h in range(2):
                z = sum(math.exp(float(q[t, h] @ kv[i]) * scale) for i in indices[t] if i >= 0)
                close(with_sink[t, h], without[t, h] * z / (z + math.exp(s)))
        norm = with_sink[:2].norm()
        assert norm < without[:2].norm() and (prev is None or norm < prev)
        prev = norm


# --- compression -----------------------------------------------------------------------------------


def test_compress_windows_equal_gates_give_the_mean():
    kv = randn(3, 5, 4, seed=18)
    gate = torch.full((3, 5, 4), 0.37, dtype=f64)
    close(ops.compress_windows(kv, gate), kv.mean(dim=1))
    gate[0, :2] = -INF  # empty slots
    gate[2, 4] = -INF
    out = ops.compress_windows(kv, gate)
    close(out[0], kv[0, 2:].mean(0))
    close(out[1], kv[1].mean(0))
    close(out[2], kv[2, :4].mean(0))


def test_compress_windows_is_a_per_channel_softmax_over_the_window():
    kv, gate = randn(2, 3, 2, seed=19), randn(2, 3, 2, seed=20)
    out = ops.compress_windows(kv, gate)
    for w in range(2):
        for d in range(2):
            e = [math.exp(float(gate[w, i, d])) for i in range(3)]
            close(out[w, d], sum(e[i] / sum(e) * kv[w, i, d] for i in range(3)))
    half = ops.compress_windows(kv.to(torch.bfloat16), gate.to(torch.bfloat16))
    assert half.dtype == torch.bfloat16
    close(
        half, ops.compress_windows(kv.to(torch.bfloat16).to(f64), gate.to(torch.bfloat16).to(f64)), 1e-2, 1e-2
    )


# --- indexer ---------------------------------------------------------------------------------------


def test_indexer_scores_are_weighted_relu_dots():
    q = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]], dtype=f64)  # [T=1, H=2, d=2]
    weights = torch.tensor([[1.0, 2.0]], dtype=f64)
    keys = torch.tensor([[9.0, 9.0], [1.0, -5.0], [0.5, 0.5], [-1.0, 1.0], [2.0, 0.1]], dtype=f64)
    keys[0] = NAN  # row 0 is never a candidate
    cand = torch.tensor([[1, 2, 3, 4, -1]])
    # scores: id1 = 1*1 + 2*relu(-5) = 1; id2 = 0.5 + 1 = 1.5; id3 = 0 + 2 = 2; id4 = 2 + 0.2 = 2.2
    assert ops.indexer_topk(q, weights, keys, cand, 3, 1.0).tolist() == [[4, 3, 2]]
    assert ops.indexer_topk(q, weights, keys, cand, 6, 1.0).tolist() == [[4, 3, 2, 1, -1, -1]]
    assert ops.indexer_topk(q, weights, keys, torch.full((1, 5), -1), 3, 1.0).tolist() == [[-1, -1, -1]]


def test_indexer_ties_go_to_the_earlier_candidate():
    q = torch.ones(1, 1, 2, dtype=f64)
    weights = torch.ones(1, 1, dtype=f64)
    keys = torch.tensor([[0.0, 0.0], [1.0, 1.0], [3.0, 0.0], [5.0, 5.0], [1.0, 2.0]], dtype=f64)
    keys[1] = keys[4] = torch.tensor([1.5, 1.5], dtype=f64)  # ids 1 and 4 tie (score 3), as does id 2
    cand = torch.tensor([[4, 3, 2, 1]])  # candidate order: 4 before 2 before 1
    assert ops.indexer_topk(q, weights, keys, cand, 4, 1.0).tolist() == [[3, 4, 2, 1]]
    assert ops.indexer_topk(q, weights, keys, cand, 2, 1.0).tolist() == [[3, 4]]
    cand = torch.tensor([[1, 2, 3, 4]])
    assert ops.indexer_topk(q, weights, keys, cand, 2, 1.0).tolist() == [[3, 1]]


# --- mHC -------------------------------------------------------------------------------------------


def _hc_pre_by_hand(streams, fn, base, scale, iters, hc_eps, norm_eps):
    T, n, D = streams.shape
    posts, combs, collapsed = [], [], []
    for t in range(T):
        v = streams[t].reshape(-1)
        v = v / math.sqrt(float((v**2).mean()) + norm_eps)
        m = fn @ v
        pre = torch.sigmoid(m[:n] * scale[0] + base[:n]) + hc_eps
        post = 2 * torch.sigmoid(m[n : 2 * n] * scale[1] + base[n : 2 * n])
        c = torch.softmax((m[2 * n :] * scale[2] + base[2 * n :]).view(n, n), dim=1) + hc_eps
        c = c / (c.sum(0, keepdim=True) + hc_eps)
        for _ in range(iters - 1):
            c = c / (c.sum(1, keepdim=True) + hc_eps)
            c = c / (c.sum(0, keepdim=True) + hc_eps)
        posts.append(post)
        combs.append(c)
        collapsed.append(sum(pre[i] * streams[t, i] for i in range(n)))
    return torch.stack(posts), torch.stack(combs), torch.stack(collapsed)


def _hc_inputs(T=3, n=4, D=8):
    streams = randn(T, n, D, seed=21) * 2
    fn = randn((2 + n) * n, n * D, seed=22) / math.sqrt(n * D)
    base, scale = randn((2 + n) * n, seed=23) * 0.5, torch.tensor([0.9, 1.1, 1.3], dtype=f64)
    return streams, fn, base, scale


def test_hc_pre_matches_the_formula_and_ranges():
    streams, fn, base, scale = _hc_inputs()
    for iters in (1, 3, 20):
        post, comb, collapsed = ops.hc_pre(streams, fn, base, scale, iters, 1e-6, 1e-6)
        want = _hc_pre_by_hand(streams, fn, base, scale, iters, 1e-6, 1e-6)
        for got, exp in zip((post, comb, collapsed), want):
            close(got, exp)
        assert ((post > 0) & (post < 2)).all()
        close(comb.sum(-2), torch.ones(3, 4, dtype=f64), atol=1e-5, rtol=0)  # columns: normalised last
    # pre = sigmoid(.) + eps lies in (eps, 1 + eps): saturating its base hits both ends
    n = streams.shape[1]
    for shift, pre in ((60.0, 1 + 1e-6), (-60.0, 1e-6)):
        b = base.clone()
        b[:n] += shift
        _, _, c = ops.hc_pre(streams, fn, b, scale, 20, 1e-6, 1e-6)
        close(c, pre * streams.sum(1), atol=1e-12, rtol=1e-9)
    # post = 2 sigmoid(.) spans (0, 2) the same way
    b = base.clone()
    b[n : 2 * n] += 60.0
    close(ops.hc_pre(streams, fn, b, scale, 20, 1e-6, 1e-6)[0], torch.full((3, n), 2.0, dtype=f64))


def test_hc_pre_comb_is_doubly_stochastic_after_sinkhorn():
    streams, fn, base, scale = _hc_inputs()
    _, comb, _ = ops.hc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6)
    close(comb.sum(-1), torch.ones(3, 4, dtype=f64), atol=1e-3, rtol=0)
    close(comb.sum(-2), torch.ones(3, 4, dtype=f64), atol=1e-5, rtol=0)
    assert (comb > 0).all()


def test_hc_pre_computes_in_float32_for_bfloat16_streams():
    streams, fn, base, scale = _hc_inputs()
    sb = streams.to(torch.bfloat16)
    post, comb, collapsed = ops.hc_pre(sb, fn.float(), base.float(), scale.float(), 20, 1e-6, 1e-6)
    want = ops.hc_pre(sb.to(f64), fn, base, scale, 20, 1e-6, 1e-6)
    close(post, want[0], 1e-5, 1e-5)
    close(comb, want[1], 1e-5, 1e-5)
    assert collapsed.dtype == torch.bfloat16
    close(collapsed, want[2], 2e-2, 1e-2)


def test_hc_post_matches_the_formula():
    T, n, D = 2, 3, 5
    block, streams = randn(T, D, seed=24), randn(T, n, D, seed=25)
    post, comb = randn(T, n, seed=26), randn(T, n, n, seed=27)
    out = ops.hc_post(block, streams, post, comb)
    for t in range(T):
        for k in range(n):
            close(out[t, k], post[t, k] * block[t] + sum(comb[t, j, k] * streams[t, j] for j in range(n)))
    identity = ops.hc_post(
        block, streams, torch.zeros(T, n, dtype=f64), torch.eye(n, dtype=f64).expand(T, n, n)
    )
    close(identity, streams)


def test_hc_head_matches_the_formula():
    T, n, D = 2, 4, 6
    streams, fn = randn(T, n, D, seed=28), randn(n, n * D, seed=29)
    base, scale = randn(n, seed=30), torch.tensor([0.8], dtype=f64)
    out = ops.hc_head(streams, fn, base, scale, 1e-6, 1e-6)
    for t in range(T):
        v = streams[t].reshape(-1)
        v = v / math.sqrt(float((v**2).mean()) + 1e-6)
        pre = torch.sigmoid(fn @ v * 0.8 + base) + 1e-6
        close(out[t], sum(pre[i] * streams[t, i] for i in range(n)))


# --- MoE -------------------------------------------------------------------------------------------


def test_moe_route_selects_with_bias_but_weighs_without():
    scores = torch.tensor([[0.9, 0.8, 0.7, 0.1]], dtype=f64)
    logits = torch.log(scores / (1 - scores))  # sigmoid(logits) == scores
    bias = torch.tensor([0.0, -0.5, 0.0, 0.9], dtype=f64)  # choice = [0.9, 0.3, 0.7, 1.0]
    weights, ids = ops.moe_route(logits, "sigmoid", 2, bias, None, 2.5)
    assert ids.tolist() == [[3, 0]]
    close(weights, torch.tensor([[0.1, 0.9]], dtype=f64) * 2.5)
    weights, ids = ops.moe_route(logits, "sigmoid", 2, None, None, 1.0)
    assert ids.tolist() == [[0, 1]]
    close(weights, torch.tensor([[0.9, 0.8]], dtype=f64) / 1.7)


def test_moe_route_scoring_functions_and_ties():
    logits = torch.tensor([[0.5, -1.0, 2.0, 2.0]], dtype=f64)
    for name, fn in (
        ("sqrtsoftplus", lambda v: math.sqrt(math.log1p(math.exp(v)))),
        ("sigmoid", lambda v: 1 / (1 + math.exp(-v))),
    ):
        weights, ids = ops.moe_route(logits, name, 4, None, None, 1.0)
        s = [fn(float(v)) for v in logits[0]]
        assert ids.tolist() == [[2, 3, 0, 1]]  # the tie between experts 2 and 3 goes to the lower id
        close(weights, torch.tensor([[s[2], s[3], s[0], s[1]]], dtype=f64) / sum(s))
    weights, ids = ops.moe_route(logits, "softmax", 1, None, None, 3.0)
    assert ids.tolist() == [[2]]
    close(weights, torch.tensor([[3.0]], dtype=f64))
    with pytest.raises(ValueError, match="scoring_func"):
        ops.moe_route(logits, "relu", 1, None, None, 1.0)


def test_hash_routing_uses_the_fixed_ids():
    logits = randn(3, 8, seed=31)
    fixed = torch.tensor([[7, 0], [3, 2], [5, 6]])
    weights, ids = ops.moe_route(logits, "sqrtsoftplus", 2, randn(8, seed=32), fixed, 1.5)
    assert torch.equal(ids, fixed)
    s = F.softplus(logits).sqrt().gather(1, fixed)
    close(weights, s / s.sum(-1, keepdim=True) * 1.5)


def test_moe_experts_equals_a_per_token_loop():
    T, D, inter, E, k = 5, 6, 4, 3, 2
    x = randn(T, D, seed=33)
    w13, w2 = randn(E, 2 * inter, D, seed=34) * 2, randn(E, D, inter, seed=35)
    ids = torch.tensor([[0, 2], [-1, 1], [-1, -1], [2, 0], [1, -1]])
    weights = randn(T, k, seed=36).abs() + 0.1
    out = ops.moe_experts(x, w13, w2, ids, weights, 3.0)
    for t in range(T):
        want = torch.zeros(D, dtype=f64)
        for slot in range(k):
            e = int(ids[t, slot])
            if e < 0:
                continue
            gate, up = (w13[e] @ x[t]).chunk(2)
            h = F.silu(gate.clamp(max=3.0)) * up.clamp(-3.0, 3.0)
            want += weights[t, slot] * (w2[e] @ h)
        close(out[t], want)
    assert torch.equal(out[2], torch.zeros(D, dtype=f64))


# --- sampling --------------------------------------------------------------------------------------


def test_apply_penalties_hand_example():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5], [2.0, -2.0, 1.0, 0.5]], dtype=f64)
    prompt = torch.tensor([[True, False, False, False], [True, False, False, False]])
    counts = torch.tensor([[0, 2, 1, 0], [0, 2, 1, 0]])
    out = ops.apply_penalties(
        logits,
        prompt,
        counts,
        torch.tensor([2.0, 1.0], dtype=f64),
        torch.tensor([0.5, 0.0], dtype=f64),
        torch.tensor([0.1, 0.0], dtype=f64),
    )
    # row 0: seen = {0 (prompt), 1, 2}; repetition: 2/2, -2*2, 1/2; then -0.1*count - 0.5*(count > 0)
    close(out[0], torch.tensor([1.0, -4.0 - 0.2 - 0.5, 0.5 - 0.1 - 0.5, 0.5], dtype=f64))
    close(out[1], logits[1])  # neutral knobs


def _keep(logits, k, p, m):
    out = ops.top_k_top_p_min_p(
        logits,
        torch.tensor([k]),
        torch.tensor([p], dtype=logits.dtype),
        torch.tensor([m], dtype=logits.dtype),
    )
    kept = torch.isfinite(out[0])
    assert torch.equal(out[0][kept], logits[0][kept])  # kept logits are untouched
    return kept.nonzero().flatten().tolist()


def test_top_k_top_p_min_p_hand_examples():
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]], dtype=f64).log()
    assert _keep(logits, 0, 1.0, 0.0) == [0, 1, 2, 3]
    assert _keep(logits, -1, 1.0, 0.0) == [0, 1, 2, 3]
    assert _keep(logits, 9, 1.0, 0.0) == [0, 1, 2, 3]
    assert _keep(logits, 2, 1.0, 0.0) == [0, 1]
    assert _keep(logits, 0, 0.3, 0.0) == [0]  # mass before token 1 is 0.4 >= 0.3
    assert _keep(logits, 0, 0.5, 0.0) == [0, 1]
    assert _keep(logits, 0, 0.75, 0.0) == [0, 1, 2]
    assert _keep(logits, 0, 1.0, 0.6) == [0, 1]  # prob < 0.6 * 0.4 = 0.24 dropped
    assert _keep(logits, 0, 1.0, 0.45) == [0, 1, 2]
    # top_p acts on the probabilities renormalised after top_k: [.444, .333, .222] -> 0.778 >= 0.75
    assert _keep(logits, 3, 0.75, 0.0) == [0, 1]
    # ties with the k-th logit are kept
    assert _keep(torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=f64), 2, 1.0, 0.0) == [0, 1, 2]


def test_top_p_keeps_ties_at_the_boundary():
    logits = torch.tensor([[0.4, 0.2, 0.2, 0.2]], dtype=f64).log()
    assert _keep(logits, 0, 0.5, 0.0) == [0, 1, 2, 3]  # token 1 is needed; 2 and 3 tie with it
    logits = torch.tensor([[0.1, 0.3, 0.3, 0.3]], dtype=f64).log()
    assert _keep(logits, 0, 0.2, 0.0) == [1, 2, 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_p_one_keeps_the_whole_large_vocab(dtype):
    logits = conf._peaky_logits(g(37), 3, 129280).to(dtype)
    out = ops.top_k_top_p_min_p(logits, torch.zeros(3, dtype=torch.long), torch.ones(3), torch.zeros(3))
    assert torch.isfinite(out).all()


def test_random_sample_is_the_exponential_race():
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0]], dtype=f64)
    noise = torch.tensor([[2.0, 0.5, 0.3, 1e-9]], dtype=f64)  # ratios 0.25, 0.6, 0.667, 0
    assert ops.random_sample(probs, noise).tolist() == [2]
    assert ops.random_sample(probs, noise).tolist() == [2]  # deterministic for fixed noise
    n = 20000
    noise = -torch.log(torch.rand(n, 4, generator=g(38), dtype=f64))
    picks = ops.random_sample(probs.expand(n, 4), noise)
    freq = torch.bincount(picks, minlength=4).to(f64) / n
    assert freq[3] == 0  # a zero-probability token is never drawn
    close(freq, probs[0], atol=0.015, rtol=0)


def test_random_sample_never_draws_zero_probability_tokens():
    probs = torch.softmax(randn(64, 50, seed=39) * 3, -1)
    probs[probs < probs.median(-1, keepdim=True).values] = 0
    for seed in range(5):
        noise = -torch.log(torch.rand(64, 50, generator=g(seed), dtype=f64))
        picks = ops.random_sample(probs, noise)
        assert (probs.gather(1, picks.unsqueeze(1)) > 0).all()


def test_apply_token_bitmask_hand_example():
    V = 35  # two words; bits past the vocab are ignored
    word0 = (1 << 0) | (1 << 5) | (1 << 31)
    word1 = (1 << 2) | (1 << 3)  # token 34 and the non-existent token 35
    bitmask = torch.tensor([[word0, word1], [-1, -1]], dtype=torch.int64).to(torch.int32)
    logits = randn(2, V, seed=40)
    out = ops.apply_token_bitmask(logits, bitmask)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [0, 5, 31, 34]
    assert torch.equal(out[0][[0, 5, 31, 34]], logits[0][[0, 5, 31, 34]])
    assert torch.equal(out[1], logits[1])

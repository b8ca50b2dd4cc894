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


#: ops whose floating output is float32 whatever their inputs (decoded FP8 / FP4 storage)
FLOAT32_OUT = {"embedding_fp8", "kv_fp4_unpack", "engram_lookup"}
#: non-floating outputs other than ids: packed KV entries are bytes, V4.1's candidate filter is a mask
NOT_IDS = {"kv_fp8_pack": torch.uint8, "kv_fp4_pack": torch.uint8, "candidate_blocks": torch.bool}


@pytest.mark.parametrize("op", sorted(CATALOGUE))
def test_float64_inputs_give_float64_outputs(op):
    for case in conf.make_cases(op, "tiny", f64):
        outs = ops.ALL_OPS[op](*case.args)
        for out in outs if isinstance(outs, tuple) else (outs,):
            if out.dtype.is_floating_point:
                want = torch.float32 if op in FLOAT32_OUT else f64
                assert out.dtype == want, f"{op}[{case.name}] returned {out.dtype}"
            else:
                assert out.dtype == NOT_IDS.get(op, torch.long), f"{op}[{case.name}] returned {out.dtype}"


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


# --- DeepSeek-V4.1: indexer scores, candidate blocks, single-pass mHC, FP4 KV, 32-channel experts ----


def _indexer_scores_by_hand(q, weights, keys, candidates, scale):
    T, H, _ = q.shape
    out = torch.full(candidates.shape, -INF, dtype=f64)
    for t in range(T):
        for c, key in enumerate(candidates[t].tolist()):
            if key >= 0:
                out[t, c] = sum(float(weights[t, h]) * max(float(q[t, h] @ keys[key]), 0.0) * scale for h in range(H))
    return out


def test_indexer_scores_are_the_indexer_topk_scores_unselected():
    q = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]], dtype=f64)
    weights = torch.tensor([[1.0, 2.0]], dtype=f64)
    keys = torch.tensor([[9.0, 9.0], [1.0, -5.0], [0.5, 0.5], [-1.0, 1.0], [2.0, 0.1]], dtype=f64)
    keys[0] = NAN  # row 0 is never a candidate
    cand = torch.tensor([[1, -1, 2, 3, 4]])
    close(ops.indexer_scores(q, weights, keys, cand, 0.5), torch.tensor([[0.5, -INF, 0.75, 1.0, 1.1]], dtype=f64))
    for case in conf.make_cases("indexer_scores", "tiny", f64):
        close(ops.indexer_scores(*case.args), _indexer_scores_by_hand(*case.args))


def _candidate_blocks_by_hand(scores, valid, block, topk_blocks):
    """Per row: block maxima over the valid columns, the last valid column's block pinned, the best
    topk_blocks (lower block first among equals) that are not -inf."""
    T, W = scores.shape
    out = torch.zeros(T, W, dtype=torch.bool)
    n_blocks = -(-W // block)
    for t in range(T):
        s, v = scores[t].tolist(), valid[t].tolist()
        best = []
        for b in range(n_blocks):
            vals = [s[c] for c in range(b * block, min(W, (b + 1) * block)) if v[c]]
            best.append(max(vals) if vals else -INF)
        cols = [c for c in range(W) if v[c]]
        if cols:
            best[cols[-1] // block] = INF
        for b in sorted(range(n_blocks), key=lambda b: (-best[b], b))[:topk_blocks]:
            if best[b] > -INF:
                for c in range(b * block, min(W, (b + 1) * block)):
                    out[t, c] = v[c]
    return out


def test_candidate_blocks_hand_examples():
    scores = torch.tensor([[5.0, 1, 2, 9, 0, 0, 7, 3, 1]], dtype=f64)  # blocks of 2: maxima 5 9 0 7 | 1
    everything = torch.ones_like(scores, dtype=torch.bool)
    keep = lambda s, v, b, k: ops.candidate_blocks(s, v, b, k)[0].nonzero().flatten().tolist()  # noqa: E731
    assert keep(scores, everything, 2, 2) == [2, 3, 8]  # the partial newest block pinned, then the best
    assert keep(scores, everything, 2, 3) == [2, 3, 6, 7, 8]
    assert keep(scores, everything, 2, 9) == list(range(9))
    valid = everything.clone()
    valid[0, 3] = False  # block 1's maximum is now 2
    assert keep(scores, valid, 2, 3) == [0, 1, 6, 7, 8]
    valid[0, 8] = False  # the newest block is block 3 (column 7)
    assert keep(scores, valid, 2, 2) == [0, 1, 6, 7]
    ties = torch.tensor([[4.0, 0, 4, 1, 0, NAN]], dtype=f64)
    valid = torch.tensor([[True, True, True, True, True, False]])
    assert keep(ties, valid, 2, 2) == [0, 1, 4]  # blocks 0 and 1 tie: the lower one; column 5 never
    scattered = torch.tensor([[True, False, False, True, False, False, True, False, False]])
    assert keep(scores, scattered, 2, 1) == [6]  # the last valid column's block, not the third block's
    assert keep(scores, torch.zeros_like(everything), 2, 3) == []
    minus_inf = torch.tensor([[-INF, -INF, 3.0, 0.0, 1.0]], dtype=f64)
    assert keep(minus_inf, torch.ones(1, 5, dtype=torch.bool), 2, 3) == [2, 3, 4]  # a -inf block never


def test_candidate_blocks_match_a_per_row_loop():
    for case in conf.make_cases("candidate_blocks", "tiny", f64) + conf.make_cases("candidate_blocks", "tiny",
                                                                                     torch.bfloat16):
        assert torch.equal(ops.candidate_blocks(*case.args), _candidate_blocks_by_hand(*case.args)), case.name
    gen = g(50)
    for trial in range(40):
        rows, width = 6, int(torch.randint(1, 60, (1,), generator=gen))
        block, keep = int(torch.randint(1, 9, (1,), generator=gen)), int(torch.randint(1, 6, (1,), generator=gen))
        scores = torch.randint(0, 4, (rows, width), generator=gen).to(f64)  # few levels: many ties
        valid = torch.rand(rows, width, generator=gen) < torch.rand(rows, 1, generator=gen)
        valid[0] = torch.arange(width) < int(torch.randint(0, width + 1, (1,), generator=gen))  # a prefix
        scores[valid & (torch.rand(rows, width, generator=gen) < 0.1)] = -INF
        got = ops.candidate_blocks(scores, valid, block, keep)
        assert torch.equal(got, _candidate_blocks_by_hand(scores, valid, block, keep)), (trial, block, keep)


def test_the_candidate_block_rows_prune_as_promised():
    """conformance.candidate_block_rows: the filter prunes, the pin and the tie decide what it keeps."""
    p = conf.PRESETS["tiny"]
    scores, valid = conf.candidate_block_rows(p, f64, g(51))
    block, keep = p.cand_block, p.cand_topk_blocks
    kept = _candidate_blocks_by_hand(scores, valid, block, keep)
    assert (valid & ~kept).any(-1).tolist() == [True, False, True, True, True, True, True]
    assert not kept[1].any() and kept[0, -1] and kept[3, int(valid[3].nonzero().max())]
    count_block = (int(valid[3].sum()) - 1) // block  # where a count of the valid columns would pin
    assert not kept[3, count_block * block : (count_block + 1) * block].any()
    tied = [b for b in range(-(-p.cand_width // block)) if scores[2, b * block : (b + 1) * block].max() == 50.0]
    assert len(tied) == keep + 1 and kept[2, tied[0] * block]
    assert not kept[2, tied[-1] * block : (tied[-1] + 1) * block].any()
    assert not kept[4, :block].any() and kept[4, block : (keep // 2) * block + 3].all()


#: every finite positive float8_e4m3fn value, ascending (code 0 = zero; subnormals m * 2^-9, then
#: (1 + m/8) * 2^(e - 7) for e = 1..15, the last code being NaN): a value's code is its index
E4M3_TABLE = [m * 2.0**-9 for m in range(8)] + [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16)
                                                for m in range(8)][:-1]
E2M1_TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _nearest(table: list[float], v: float) -> float:
    """The entry of the ascending ``table`` nearest to ``v`` >= 0, ties to the even index, saturating."""
    if v >= table[-1]:
        return table[-1]
    i = next(i for i, t in enumerate(table) if t >= v)  # table[i - 1] < v <= table[i]
    if i == 0:
        return table[0]
    lo, hi = table[i - 1], table[i]
    if v - lo != hi - v:
        return lo if v - lo < hi - v else hi
    return lo if (i - 1) % 2 == 0 else hi


def _fp4_kv_by_hand(x: torch.Tensor, block: int) -> torch.Tensor:
    flat = x.to(f64).reshape(-1, x.shape[-1])
    out = torch.zeros_like(flat)
    for r, row in enumerate(flat.tolist()):
        for start in range(0, len(row), block):
            group = row[start : start + block]
            scale = _nearest(E4M3_TABLE, max(max(abs(v) for v in group), 6 * 2.0**-9) / 6)
            for j, v in enumerate(group):
                out[r, start + j] = math.copysign(_nearest(E2M1_TABLE, abs(v) / scale) * scale, v)
    return out.view(x.shape)


def test_fp4_kv_sim_hand_examples():
    s = 1.25  # amax 7.5 = 6 * 1.25: the scale is 1.25 exactly; quotients on every e2m1 midpoint
    x = torch.tensor([[7.5, 0.25 * s, 0.75 * s, 1.25 * s, 1.75 * s, 2.5 * s, 3.5 * s, -5.0 * s]], dtype=f64)
    want = torch.tensor([[6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, -4.0]], dtype=f64) * s
    assert torch.equal(ops.fp4_kv_sim(x, 8), want)
    assert torch.equal(ops.fp4_kv_sim(x.to(torch.bfloat16), 8), want.to(torch.bfloat16))
    zero = torch.zeros(2, 16, dtype=f64)
    assert torch.equal(ops.fp4_kv_sim(zero, 16), zero)  # the floor keeps the scale 2^-9, not 0
    tiny = torch.tensor([[0.005, -0.001, 0.0, 0.0]], dtype=f64)  # amax below 6 * 2^-9: the scale is 2^-9
    assert torch.equal(ops.fp4_kv_sim(tiny, 4), torch.tensor([[3.0, -0.5, 0.0, 0.0]], dtype=f64) * 2.0**-9)
    sat = torch.tensor([[6.3, -5.9, 5.1, 5.0]], dtype=f64)  # amax / 6 = 1.05 rounds to the scale 1: saturates
    assert torch.equal(ops.fp4_kv_sim(sat, 4), torch.tensor([[6.0, -6.0, 6.0, 4.0]], dtype=f64))
    up = torch.tensor([[-6.5, 3.2, 0.6, 0.0]], dtype=f64)  # amax / 6 = 1.083 rounds to the scale 1.125
    assert torch.equal(ops.fp4_kv_sim(up, 4), torch.tensor([[-6.0, 3.0, 0.5, 0.0]], dtype=f64) * 1.125)
    groups = torch.tensor([[0.03, 1.0, 1.0, 0.0, 9.0]], dtype=f64)  # groups of 2, the last one partial
    close(ops.fp4_kv_sim(groups, 2), _fp4_kv_by_hand(groups, 2), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [f64, torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_fp4_kv_sim_matches_a_table_search_per_group(dtype):
    for case in conf.make_cases("fp4_kv_sim", "tiny", dtype):
        x, block = case.args
        got = ops.fp4_kv_sim(x, block)
        assert got.dtype == dtype and torch.equal(got.to(f64), _fp4_kv_by_hand(x, block)), case.name


def test_fp4_kv_rows_carry_their_edge_groups():
    x = conf.fp4_kv_rows(g(52), 4, 32, 16)
    groups = x.view(4, 2, 16).abs().amax(-1)
    assert groups[0].eq(0).all() and groups[1, 0] < 6 * 2.0**-9 < groups[1, 1] < 6 * 2.0**-6  # a subnormal scale
    for row, group in ((2, 0), (2, 1)):
        values = x[row, group * 16 : (group + 1) * 16].double()
        scale = float(values.abs().max()) / 6
        assert scale in E4M3_TABLE and set(conf.E2M1_MIDPOINTS) <= set((values.abs() / scale).tolist())
    amax = x[3].view(2, 16).abs().amax(-1).tolist()  # amax / 6 rounds down to its scale (1), then up (1.125)
    assert amax[0] > 6 and [_nearest(E4M3_TABLE, a / 6) for a in amax] == [1.0, 1.125]
    ties = x[2]  # the midpoints survive rounding to the 16-bit dtypes
    assert torch.equal(ties.to(torch.bfloat16).float(), ties) and torch.equal(ties.half().float(), ties)


def _hc_mixes_by_hand(streams, fn, base, scale, iters, hc_eps, norm_eps):
    T, n, D = streams.shape
    pres, posts, combs = [], [], []
    for t in range(T):
        v = streams[t].reshape(-1)
        m = fn @ (v / math.sqrt(float((v**2).mean()) + norm_eps))
        pres.append(torch.sigmoid(m[:n] * scale[0] + base[:n]) + hc_eps)
        posts.append(2 * torch.sigmoid(m[n : 2 * n] * scale[1] + base[n : 2 * n]))
        c = torch.softmax((m[2 * n :] * scale[2] + base[2 * n :]).view(n, n), dim=1) + hc_eps
        c = c / (c.sum(0, keepdim=True) + hc_eps)
        for _ in range(iters - 1):
            c = c / (c.sum(1, keepdim=True) + hc_eps)
            c = c / (c.sum(0, keepdim=True) + hc_eps)
        combs.append(c)
    return torch.stack(pres), torch.stack(posts), torch.stack(combs)


def test_hc_mixes_match_the_formula_and_hc_pre():
    streams, fn, base, scale = _hc_inputs()
    for iters in (1, 20):
        pre, post, comb = ops.hc_mixes(streams, fn, base, scale, iters, 1e-6, 1e-6)
        for got, want in zip((pre, post, comb), _hc_mixes_by_hand(streams, fn, base, scale, iters, 1e-6, 1e-6)):
            close(got, want)
        assert ((pre > 1e-6) & (pre < 1 + 1e-6)).all()
        # hc_pre is these mixes and the collapse by pre
        p_post, p_comb, collapsed = ops.hc_pre(streams, fn, base, scale, iters, 1e-6, 1e-6)
        assert torch.equal(p_post, post) and torch.equal(p_comb, comb)
        assert torch.equal(collapsed, ops.hc_collapse(streams, pre))
    zero = torch.zeros_like(streams[:1])  # V4.1's norm eps 1e-20: an all-zero token's mixes are the biases
    pre, post, _ = ops.hc_mixes(zero, fn, base, scale, 20, 1e-6, 1e-20)
    close(pre, torch.sigmoid(base[:4]).unsqueeze(0) + 1e-6)
    close(post, 2 * torch.sigmoid(base[4:8]).unsqueeze(0))


def test_hc_collapse_matches_the_formula():
    T, n, D = 3, 4, 7
    streams, pre = randn(T, n, D, seed=53), torch.rand(T, n, generator=g(54), dtype=f64)
    out = ops.hc_collapse(streams, pre)
    for t in range(T):
        close(out[t], sum(pre[t, i] * streams[t, i] for i in range(n)))
    half = ops.hc_collapse(streams.to(torch.bfloat16), pre.float())
    assert half.dtype == torch.bfloat16
    close(half, ops.hc_collapse(streams.to(torch.bfloat16).to(f64), pre.float().to(f64)), 2e-2, 1e-2)


def _act_quant_by_hand(row: list[float], block: int) -> list[float]:
    """DeepSeek's act_quant per ``block`` values: the power-of-two scale that fits the amax (floored at
    1e-4) into 448, each value rounded to E4M3 (nearest, ties to even, saturating)."""
    out = []
    for start in range(0, len(row), block):
        group = row[start : start + block]
        mantissa, exponent = math.frexp(max(max(abs(v) for v in group), 1e-4) / 448)
        scale = 2.0 ** (exponent - 1 if mantissa == 0.5 else exponent)
        out += [math.copysign(_nearest(E4M3_TABLE, abs(v) / scale) * scale, v) for v in group]
    return out


def _moe_experts_quant_act_by_hand(x, w13, w2, ids, weights, limit, block):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        xq = torch.tensor(_act_quant_by_hand(x[t].tolist(), block), dtype=f64)
        for slot, e in enumerate(ids[t].tolist()):
            if e < 0:
                continue
            gate, up = (w13[e] @ xq).chunk(2)
            h = F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit) * weights[t, slot]
            out[t] += w2[e] @ torch.tensor(_act_quant_by_hand(h.tolist(), block), dtype=f64)
    return out


def test_moe_experts_quant_act_quantises_per_block_as_a_per_token_loop():
    for case in conf.make_cases("moe_experts_quant_act", "tiny", f64):
        close(ops.moe_experts_quant_act(*case.args), _moe_experts_quant_act_by_hand(*case.args))
    T, D, inter, E, k = 5, 40, 24, 3, 2  # groups of 16: partial last ones on both sides
    x = randn(T, D, seed=55) * torch.logspace(-3, 2, D, dtype=f64)
    w13, w2 = randn(E, 2 * inter, D, seed=56), randn(E, D, inter, seed=57)
    ids = torch.tensor([[0, 2], [-1, 1], [-1, -1], [2, 0], [1, -1]])
    weights = randn(T, k, seed=58).abs() + 0.1
    args = (x, w13, w2, ids, weights, 3.0)
    close(ops.moe_experts_quant_act(*args, 16), _moe_experts_quant_act_by_hand(*args, 16))
    assert torch.equal(ops.moe_experts_quant_act(*args, 128), ops.moe_experts_act_quant(*args))
    assert not torch.equal(ops.moe_experts_quant_act(*args, 16), ops.moe_experts_act_quant(*args))


def _pow2_scale(amax: float, qmax: float, eps: float) -> float:
    """The smallest power of two s with max(amax, eps) / s <= qmax."""
    mantissa, exponent = math.frexp(max(amax, eps) / qmax)
    return 2.0 ** (exponent - 1 if mantissa == 0.5 else exponent)


def _kv_fp4_values_by_hand(x: torch.Tensor, kind: str) -> torch.Tensor:
    """The values a packed KV entry of ``kind`` holds: window E4M3 per 32 with power-of-two scales,
    compressed as fp4_kv_sim per 16, index e2m1 per 32 with power-of-two scales (amax floor 6 * 2^-126)."""
    if kind == "compressed":
        return _fp4_kv_by_hand(x, 16)
    out = []
    for row in x.to(f64).tolist():
        if kind == "window":
            out.append(_act_quant_by_hand(row, 32))
            continue
        values = []
        for start in range(0, len(row), 32):
            group = row[start : start + 32]
            scale = _pow2_scale(max(abs(v) for v in group), 6.0, 6 * 2.0**-126)
            values += [math.copysign(_nearest(E2M1_TABLE, abs(v) / scale) * scale, v) for v in group]
        out.append(values)
    return torch.tensor(out, dtype=f64)


@pytest.mark.parametrize("dtype", [f64, torch.float32, torch.bfloat16], ids=str)
def test_packed_kv_entries_hold_the_quantised_values(dtype):
    for case in conf.make_cases("kv_fp4_pack", "tiny", dtype):
        x, kind = case.args
        rows = ops.kv_fp4_pack(x, kind)
        group, per_value = {"window": (32, 1.0), "compressed": (16, 0.5), "index": (32, 0.5)}[kind]
        width = int(x.shape[1] * per_value) + x.shape[1] // group  # the codes, then a byte per group
        assert rows.dtype == torch.uint8 and rows.shape == (x.shape[0], width)
        values = ops.kv_fp4_unpack(rows, kind, x.shape[-1])
        assert values.dtype == torch.float32 and torch.equal(values.to(f64), _kv_fp4_values_by_hand(x, kind)), kind
    x = conf.make_cases("fp4_kv_sim", "tiny", dtype)[0].args[0]
    assert torch.equal(ops.kv_fp4_unpack(ops.kv_fp4_pack(x, "compressed"), "compressed", x.shape[-1]).to(dtype),
                       ops.fp4_kv_sim(x, 16))


def test_packed_kv_nibbles_and_scale_bytes():
    x = torch.tensor([[0.5, -1.0, 6.0, 0.0] + [0.0] * 12], dtype=f64)  # amax 6: scale 1 (E4M3 byte 0x38)
    rows = ops.kv_fp4_pack(x, "compressed")
    assert rows[0, :2].tolist() == [0x1 | (0xA << 4), 0x7] and rows[0, 8:].tolist() == [0x38]


def test_embedding_fp8_scales_each_group_of_a_row():
    weight = torch.tensor([[1.0, 2.0, 3.0, 4.0], [NAN] * 4, [0.5, -0.5, 448.0, -6.0]]).to(torch.float8_e4m3fn)
    scale = torch.tensor([[2.0, 0.25], [NAN, NAN], [1.0, 0.5]])
    out = ops.embedding_fp8(torch.tensor([2, 0, 2]), weight, scale)
    assert out.dtype == torch.float32
    assert out.tolist() == [[0.5, -0.5, 224.0, -3.0], [2.0, 4.0, 0.75, 1.0], [0.5, -0.5, 224.0, -3.0]]


def test_engram_gate_matches_the_formula():
    T, n, D = 3, 2, 8
    streams, key, value = randn(T, n, D, seed=59), randn(T, n, D, seed=60), randn(T, D, seed=61)
    key[0, 1] = 0.0  # dot 0: the gate is sigmoid(sqrt(1e-6))
    qw, kw = 1 + randn(n, D, seed=62) / 10, 1 + randn(n, D, seed=63) / 10
    out = ops.engram_gate(streams, key, value, qw, kw, 1e-20)
    for t in range(T):
        for i in range(n):
            h, k = streams[t, i], key[t, i]
            dot = float((h * qw[i] * kw[i] * k).sum()) / math.sqrt(float((h**2).mean()) + 1e-20)
            dot = dot / math.sqrt(float((k**2).mean()) + 1e-20) / math.sqrt(D)
            gate = 1 / (1 + math.exp(-math.copysign(math.sqrt(max(abs(dot), 1e-6)), dot)))
            close(out[t, i], h + gate * value[t])
    close(out[0, 1], streams[0, 1] + value[0] / (1 + math.exp(-1e-3)))

"""Op conformance: the ``--backend`` backend (default cpu_ref) against the cpu_ref reference.

Each op runs on the cases of ``deepinfer_core.testing.conformance`` at the ``tiny`` preset in every
dtype (the ``v4_flash`` preset, at the real model widths, is marked slow). With the default backend
the candidate is whatever the engine would resolve for cpu_ref, so an installed kernel pack that
overrides an op is checked against the cpu_ref implementation it overrides.

The rest of the file checks the suite itself: the comparison helpers, the reference table, that the
generated cases are as adversarial as promised, and that broken implementations are caught.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from deepinfer_cpu_ref.ops import ALL_OPS as _ref

from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.ops.catalogue import CATALOGUE
from deepinfer_core.ops.registry import BuildContext, OpImpl, OpTable, resolve_ops
from deepinfer_core.plugins import (
    LoadedBackend,
    PluginError,
    _new_manager,
    collect_registry,
    installed_backends,
)
from deepinfer_core.testing import conformance as conf
from deepinfer_core.testing.compare import TOLERANCES, assert_close, assert_index_sets_match

OPS = sorted(CATALOGUE)
TINY_DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
SLOW_DTYPES = [torch.bfloat16, torch.float32]
REF_PROVIDER = "deepinfer.backends:cpu_ref"


def _dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@pytest.fixture
def one_thread():
    """Tiny ops are far faster on one thread, and immune to a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def reference_table() -> OpTable:
    return conf.reference_op_table()


@pytest.fixture(scope="session")
def backend_tables(backend_name):
    """``(table_for(dtype), device)`` for the selected backend; tables are built once per dtype."""
    try:
        device = conf.backend_device(backend_name)
    except PluginError as exc:
        pytest.fail(f"--backend {backend_name}: {exc}", pytrace=False)
    tables: dict[torch.dtype, OpTable] = {}

    def table_for(dtype: torch.dtype) -> OpTable:
        if dtype not in tables:
            tables[dtype] = conf.candidate_op_table(backend_name, dtype, device)
        return tables[dtype]

    return table_for, device


def _conform(op, preset, dtype, backend_name, backend_tables, reference_table):
    table_for, device = backend_tables
    results = conf.check_op(
        op, table_for(dtype), reference_table, preset, dtype, device=device, backend=backend_name
    )
    assert results, f"no cases generated for {op}"
    if all(r.fallback for r in results):
        pytest.skip(f"backend {backend_name!r} has no implementation of {op} (cpu_ref fallback)")
    failed = [r for r in results if not r.passed]
    if failed:
        pytest.fail("\n\n".join(str(r) for r in failed), pytrace=False)


@pytest.mark.parametrize("dtype", TINY_DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("op", OPS)
def test_op_tiny(op, dtype, backend_name, backend_tables, reference_table, one_thread):
    _conform(op, "tiny", dtype, backend_name, backend_tables, reference_table)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", SLOW_DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("op", OPS)
def test_op_v4_flash(op, dtype, backend_name, backend_tables, reference_table):
    _conform(op, "v4_flash", dtype, backend_name, backend_tables, reference_table)


def test_run_conformance_covers_every_op(backend_name, one_thread):
    results = conf.run_conformance(backend_name, "tiny", ["float32"])
    assert {r.op for r in results} == set(CATALOGUE)
    assert all(r.passed for r in results), conf.summarize(results)
    assert all(r.preset == "tiny" and r.dtype == "float32" for r in results)


# --- the reference and kernel-pack overrides -------------------------------------------------------


def test_reference_table_holds_only_cpu_ref_implementations(reference_table):
    assert set(reference_table.chosen) == set(CATALOGUE)
    assert {reference_table.provider(op) for op in CATALOGUE} == {REF_PROVIDER}


def _rms_norm_via_torch(x, weight, eps):
    acc = torch.promote_types(x.dtype, torch.float32)
    return F.rms_norm(x.to(acc), (x.shape[-1],), None if weight is None else weight.to(acc), eps).to(x.dtype)


def _swiglu_without_limit(gate_up, limit):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class _FakePack:
    """A kernel pack for cpu_ref, registered in-process (no entry point needed)."""

    def __init__(self, impls):
        self.impls = impls

    @hookimpl
    def deepinfer_register_ops(self, registry, backend):
        if backend.name == "cpu_ref":
            for op, fn in self.impls.items():
                registry.register(op, fn, priority=10)


def _cpu_ref_with_pack(impls) -> LoadedBackend:
    from deepinfer_cpu_ref import plugin

    pm = _new_manager()
    pm.register(plugin, name=REF_PROVIDER)
    pm.register(_FakePack(impls), name="deepinfer.kernels:fake_pack")
    info = pm.hook.deepinfer_backend_info()
    return LoadedBackend(info, pm, installed_backends()["cpu_ref"], ["fake_pack"])


def test_kernel_pack_override_is_checked_against_the_cpu_ref_reference(one_thread):
    loaded = _cpu_ref_with_pack({"rms_norm": _rms_norm_via_torch, "swiglu": _swiglu_without_limit})
    candidate = resolve_ops(collect_registry(loaded), BuildContext(backend="cpu_ref", dtype=torch.float32))
    reference = conf.reference_op_table(loaded=loaded)
    assert candidate.provider("rms_norm") == "deepinfer.kernels:fake_pack"
    assert reference.provider("rms_norm") == REF_PROVIDER
    assert reference.provider("swiglu") == REF_PROVIDER

    for dtype in TINY_DTYPES:
        good = conf.check_op("rms_norm", candidate, reference, "tiny", dtype, backend="cpu_ref")
        assert all(r.passed and r.provider == "deepinfer.kernels:fake_pack" for r in good), conf.summarize(
            good
        )
        assert not any(r.fallback for r in good)

    bad = conf.check_op("swiglu", candidate, reference, "tiny", torch.float32, backend="cpu_ref")
    failed = [r for r in bad if not r.passed]
    assert failed, "an override that ignores the swiglu limit must fail"
    assert "swiglu[tiny/float32/" in failed[0].message and "fake_pack" in failed[0].message


# --- the cases are as adversarial as promised ------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_dtype_id)
def test_sparse_attention_cases_hide_nan_rows_behind_minus_one(dtype):
    for case in conf.make_cases("sparse_attention", "tiny", dtype):
        q, kv, indices, sinks, scale, extra_kv, extra_indices = case.args
        pairs = [(kv, indices)] + ([(extra_kv, extra_indices)] if extra_kv is not None else [])
        for pool, idx in pairs:
            nan_rows = torch.isnan(pool).any(-1)
            assert nan_rows[0] and nan_rows[-1] and nan_rows.sum() > 2
            assert not nan_rows[idx[idx >= 0]].any(), "a referenced row is NaN"
            assert (idx == -1).any()
            assert (idx[:, :-1] == -1).logical_and(idx[:, 1:] >= 0).any(), "-1 only at row ends"
        empty = (indices < 0).all(-1)
        if extra_indices is not None:
            empty &= (extra_indices < 0).all(-1)
        assert empty.any(), "no token with every index -1"


def test_indexer_cases_pad_and_hide_nan_rows():
    cases = {c.name: c for c in conf.make_cases("indexer_topk", "tiny", torch.float32)}
    for case in cases.values():
        q, weights, keys, candidates, topk, scale = case.args
        assert torch.isnan(keys[0]).all()
        assert not torch.isnan(keys[candidates[candidates >= 0]]).any()
        assert (candidates < 0).all(-1).any()
    few = cases["few_candidates"].args
    assert few[3].shape[1] < few[4], "a case with fewer candidates than topk (output padded with -1)"


def test_indexer_scores_cases_hide_nan_rows_behind_minus_one():
    for case in conf.make_cases("indexer_scores", "tiny", torch.float32):
        q, weights, keys, candidates, scale = case.args
        assert torch.isnan(keys[0]).all() and not torch.isnan(keys[candidates[candidates >= 0]]).any()
        assert (candidates < 0).all(-1).any() and (candidates[:, :-1] < 0).logical_and(candidates[:, 1:] >= 0).any()
        assert q.shape[1] == conf.PRESETS["tiny"].v41_index_heads


def test_other_cases_carry_their_edge_values():
    for case in conf.make_cases("compress_windows", "tiny", torch.float32):
        kv, gate = case.args
        assert torch.isneginf(gate).any()
        assert torch.isfinite(gate).any(dim=1).all(), "every window keeps a finite slot"
    x, w13, w2, ids, weights, limit = conf.make_cases("moe_experts", "tiny", torch.float32)[0].args
    assert (ids == -1).any() and (ids == -1).all(-1).any()
    assert (weights[ids == -1] != 0).all(), "skipped slots carry nonzero weights"
    gate = torch.einsum("td,eid->tei", x, w13[:, : w13.shape[1] // 2])
    assert (gate > limit).any(), "some gate activations exceed the swiglu limit"
    ids, weight = conf.make_cases("embedding", "tiny", torch.float32)[0].args
    assert torch.isnan(weight).any() and not torch.isnan(weight[ids]).any()
    assert {0, weight.shape[0] - 1} <= set(ids.tolist())
    logits, bitmask = conf.make_cases("apply_token_bitmask", "tiny", torch.float32)[0].args
    assert logits.shape[1] % 32 != 0 and bitmask.shape[1] == math.ceil(logits.shape[1] / 32)
    assert (bitmask < 0).any(), "words with bit 31 set"


def _comparable(t: torch.Tensor) -> torch.Tensor:
    """NaN-free float64 copy of floating tensors (float8 has no nan_to_num), others as they are."""
    return t.double().nan_to_num() if t.is_floating_point() else t


def test_cases_are_reproducible_from_the_seed():
    for op in OPS:
        a = conf.make_cases(op, "tiny", torch.float32, seed=3)
        b = conf.make_cases(op, "tiny", torch.float32, seed=3)
        c = conf.make_cases(op, "tiny", torch.float32, seed=4)
        flat = [[t for t in case.args if isinstance(t, torch.Tensor)] for case in a]
        for case, tensors in zip(b, flat):
            same = [t for t in case.args if isinstance(t, torch.Tensor)]
            assert all(torch.equal(_comparable(x), _comparable(y)) for x, y in zip(tensors, same)), op
        floating = any(isinstance(x, torch.Tensor) and x.is_floating_point() for case in a for x in case.args)
        assert any(
            not torch.equal(_comparable(x), _comparable(y))
            for ca, cc in zip(a, c)
            for x, y in zip(ca.args, cc.args)
            if isinstance(x, torch.Tensor) and (x.is_floating_point() or not floating)  # bytes in: the bytes
        ), op


def test_v4_flash_preset_has_the_real_widths():
    p = conf.PRESETS["v4_flash"]
    assert (p.hidden, p.heads, p.head_dim, p.rope_dim, p.q_lora) == (4096, 64, 512, 64, 1024)
    assert (p.n_experts, p.top_k, p.moe_inter) == (256, 6, 2048)
    assert (p.index_heads, p.index_dim, p.index_topk) == (64, 128, 512)
    assert (p.o_groups, p.o_lora, p.vocab, p.hc_mult, p.window) == (8, 1024, 129280, 4, 128)
    assert p.compress_rates == (4, 128)
    assert p.tokens <= 8
    # DeepSeek-V4.1-Flash's widths for its own ops; its candidate filter prunes the rows it is given
    assert (p.v41_hidden, p.v41_moe_inter, p.v41_index_heads, p.index_dim) == (5120, 2304, 32, 128)
    assert (p.cand_block, p.cand_topk_blocks, p.kv_fp4_block, p.act_block) == (8, 2048, 16, 32)
    for preset in conf.PRESETS.values():
        assert preset.cand_width % preset.cand_block
        assert -(-preset.cand_width // preset.cand_block) >= preset.cand_topk_blocks + 3
    assert p.cand_width > 16384


# --- broken implementations are caught -------------------------------------------------------------


def _neox_rotary(x, cos, sin, inverse=False):
    rope = 2 * cos.shape[-1]
    c, s = torch.cat([cos, cos], -1).unsqueeze(-2), torch.cat([sin, sin], -1).unsqueeze(-2)
    s = -s if inverse else s
    nope, r = x[..., :-rope], x[..., -rope:]
    half = torch.cat([-r[..., rope // 2 :], r[..., : rope // 2]], -1)
    return torch.cat([nope, (r * c + half * s).to(x.dtype)], -1)


def _indexer_without_relu(q, weights, keys, candidates, topk, scale):
    ck = keys[candidates.clamp(min=0)].masked_fill((candidates < 0).unsqueeze(-1), 0)
    s = (torch.einsum("thd,tcd->thc", q.float(), ck.float()) * scale * weights.float().unsqueeze(-1)).sum(1)
    s = s.masked_fill(candidates < 0, float("-inf"))
    k = min(topk, candidates.shape[1])
    order = s.sort(dim=-1, descending=True, stable=True).indices[:, :k]
    out = torch.where(s.gather(1, order).isfinite(), candidates.gather(1, order), -1)
    return torch.cat([out, out.new_full((out.shape[0], topk - k), -1)], 1)


def _route_weights_from_biased_scores(logits, scoring, top_k, bias, fixed, factor):
    weights, ids = _ref["moe_route"](logits, scoring, top_k, bias, fixed, factor)
    if bias is None:
        return weights, ids
    scores = F.softplus(logits).sqrt() if scoring == "sqrtsoftplus" else logits.sigmoid()
    picked = (scores + bias.to(scores.dtype)).gather(1, ids)
    return picked / picked.sum(-1, keepdim=True) * factor, ids


def _reversed_bits(logits, bitmask):
    bits = 31 - torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, : logits.shape[-1]]
    return logits.masked_fill(~allowed, float("-inf"))


def _indexer_scores_without_relu(q, weights, keys, candidates, scale):
    ck = keys[candidates.clamp(min=0)].masked_fill((candidates < 0).unsqueeze(-1), 0)
    s = (torch.einsum("thd,tcd->thc", q.float(), ck.float()) * scale * weights.float().unsqueeze(-1)).sum(1)
    return s.masked_fill(candidates < 0, float("-inf"))


def _candidate_blocks_variant(scores, valid, block, topk_blocks, pin="last", later_ties=False):
    """candidate_blocks with the pinned block chosen otherwise (``"count"``: the block of the number of
    valid columns minus one; None: no pin) or ties broken towards the later block."""
    rows, width = scores.shape
    n = -(-width // block)
    padded = torch.full((rows, n * block), float("-inf"), dtype=torch.float64)
    padded[:, :width] = scores.double().masked_fill(~valid, float("-inf"))
    best = padded.view(rows, n, block).amax(-1)
    if pin == "last":
        newest = torch.where(valid, torch.arange(width), -1).amax(-1, keepdim=True) // block
    else:
        newest = (valid.sum(-1, keepdim=True) - 1) // block if pin == "count" else torch.full((rows, 1), -1)
    best = best.masked_fill(torch.arange(n) == newest, float("inf"))
    if later_ties:
        order = n - 1 - torch.sort(best.flip(-1), dim=-1, descending=True, stable=True).indices
    else:
        order = torch.sort(best, dim=-1, descending=True, stable=True).indices
    order = order[:, :topk_blocks]
    kept = torch.zeros(rows, n, dtype=torch.bool).scatter_(1, order, best.gather(1, order) > float("-inf"))
    return kept.repeat_interleave(block, -1)[:, :width] & valid


def _fp4_kv_variant(x, block, e4m3_scale=True, away=False, floor=6 * 2.0**-9):
    """fp4_kv_sim with one step changed: the scale left unrounded, ties rounded away from zero, or no floor."""
    k = x.shape[-1]
    groups = F.pad(x.double(), (0, -k % block)).unflatten(-1, (-1, block))
    scale = groups.abs().amax(-1, keepdim=True).clamp(min=floor) / 6
    if e4m3_scale:
        scale = scale.float().to(torch.float8_e4m3fn).double()
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
    dist = ((groups / scale).abs().clamp(max=6).unsqueeze(-1) - table).abs()
    nearest = dist == dist.min(-1, keepdim=True).values
    if away:  # the last of the nearest: away from zero
        code = 7 - nearest.flip(-1).int().argmax(-1)
    else:  # the nearest, ties to the even code
        even = nearest & (torch.arange(8) % 2 == 0)
        code = torch.where(even.any(-1), even.int().argmax(-1), nearest.int().argmax(-1))
    out = torch.copysign(table[code], groups) * scale
    return out.flatten(-2)[..., :k].to(x.dtype)


def _moe_experts_clamped_ids(x, w13, w2, ids, weights, limit):
    return _ref["moe_experts"](x, w13, w2, ids.clamp(min=0), weights, limit)


def _engram_hash_pads_one_shift(history, token_map, multipliers, primes, offsets, pad_id):
    """The hash with each blocked slot padded but the look-back beyond it kept (no cut at the first block)."""
    return _hash_ids(torch.where(history < 0, pad_id, token_map[history.clamp_min(0)]), multipliers, primes, offsets)


def _hash_ids(ids, multipliers, primes, offsets):
    products = ids.unsqueeze(1) * multipliers
    running, columns = products[..., 0], []
    for size in range(2, ids.shape[1] + 1):
        running = running ^ products[..., size - 1]
        columns.append(running.unsqueeze(-1) % primes[:, size - 2])
    return torch.cat(columns, dim=-1) + offsets


MUTANTS = {
    "embedding off by one row": ("embedding", lambda ids, w: w[(ids + 1) % w.shape[0]]),
    "rms_norm drops the weight": ("rms_norm", lambda x, w, eps: _ref["rms_norm"](x, None, eps)),
    "rotary_emb in NeoX (half-split) layout": ("rotary_emb", _neox_rotary),
    "linear drops the bias": ("linear", lambda x, w, b=None: _ref["linear"](x, w, None)),
    "grouped_linear uses group 0 for all": (
        "grouped_linear",
        lambda x, w: torch.einsum("tgk,nk->tgn", x, w[: w.shape[0] // x.shape[1]]),
    ),
    "swiglu ignores the limit": ("swiglu", _swiglu_without_limit),
    "sparse_attention reads -1 slots as row 0": (
        "sparse_attention",
        lambda q, kv, i, s, sc, ekv=None, ei=None: _ref["sparse_attention"](
            q, kv, i.clamp(min=0), s, sc, ekv, None if ei is None else ei.clamp(min=0)
        ),
    ),
    "sparse_attention without the sink": (
        "sparse_attention",
        lambda q, kv, i, s, sc, ekv=None, ei=None: _ref["sparse_attention"](
            q, kv, i, torch.full_like(s, -30.0), sc, ekv, ei
        ),
    ),
    "sparse_attention ignores extra_kv": (
        "sparse_attention",
        lambda q, kv, i, s, sc, ekv=None, ei=None: _ref["sparse_attention"](q, kv, i, s, sc),
    ),
    "compress_windows treats -inf gates as 0": (
        "compress_windows",
        lambda kv, gate: _ref["compress_windows"](kv, gate.nan_to_num(neginf=0.0)),
    ),
    "indexer_topk reads -1 candidates": (
        "indexer_topk",
        lambda q, w, k, c, n, s: _ref["indexer_topk"](q, w, k, c.clamp(min=0), n, s),
    ),
    "indexer_topk without relu": ("indexer_topk", _indexer_without_relu),
    "hc_pre without Sinkhorn iterations": (
        "hc_pre",
        lambda st, fn, b, sc, it, he, ne: _ref["hc_pre"](st, fn, b, sc, 1, he, ne),
    ),
    "hc_post with transposed comb": (
        "hc_post",
        lambda bo, st, post, comb: _ref["hc_post"](bo, st, post, comb.transpose(-1, -2)),
    ),
    "hc_head without base": (
        "hc_head",
        lambda st, fn, b, sc, he, ne: _ref["hc_head"](st, fn, torch.zeros_like(b), sc, he, ne),
    ),
    "moe_route ignores the correction bias": (
        "moe_route",
        lambda lg, sf, k, bias, fixed, f: _ref["moe_route"](lg, sf, k, None, fixed, f),
    ),
    "moe_route weights from biased scores": ("moe_route", _route_weights_from_biased_scores),
    "moe_experts runs -1 ids on expert 0": ("moe_experts", _moe_experts_clamped_ids),
    "moe_experts ignores the swiglu limit": (
        "moe_experts",
        lambda x, a, b, i, w, lim: _ref["moe_experts"](x, a, b, i, w, float("inf")),
    ),
    "apply_penalties ignores the prompt": (
        "apply_penalties",
        lambda lg, pm, oc, r, p, f: _ref["apply_penalties"](lg, torch.zeros_like(pm), oc, r, p, f),
    ),
    "top_k_top_p_min_p ignores min_p": (
        "top_k_top_p_min_p",
        lambda lg, k, p, m: _ref["top_k_top_p_min_p"](lg, k, p, torch.zeros_like(m)),
    ),
    "top_k_top_p_min_p ignores top_p": (
        "top_k_top_p_min_p",
        lambda lg, k, p, m: _ref["top_k_top_p_min_p"](lg, k, torch.ones_like(p), m),
    ),
    "random_sample ignores the noise": ("random_sample", lambda probs, noise: probs.argmax(-1)),
    "apply_token_bitmask reads bits MSB first": ("apply_token_bitmask", _reversed_bits),
    "indexer_scores reads -1 candidates": (
        "indexer_scores",
        lambda q, w, k, c, s: _ref["indexer_scores"](q, w, k, c.clamp(min=0), s),
    ),
    "indexer_scores without relu": ("indexer_scores", _indexer_scores_without_relu),
    "candidate_blocks pins the block the count of valid columns points at": (
        "candidate_blocks",
        lambda s, v, b, k: _candidate_blocks_variant(s, v, b, k, pin="count"),
    ),
    "candidate_blocks without the pin": (
        "candidate_blocks",
        lambda s, v, b, k: _candidate_blocks_variant(s, v, b, k, pin=None),
    ),
    "candidate_blocks breaks ties towards the later block": (
        "candidate_blocks",
        lambda s, v, b, k: _candidate_blocks_variant(s, v, b, k, later_ties=True),
    ),
    "hc_mixes without Sinkhorn iterations": (
        "hc_mixes",
        lambda st, fn, b, sc, it, he, ne: _ref["hc_mixes"](st, fn, b, sc, 1, he, ne),
    ),
    "hc_mixes swaps pre and post": (
        "hc_mixes",
        lambda *args: (lambda pre, post, comb: (post / 2, 2 * pre, comb))(*_ref["hc_mixes"](*args)),
    ),
    "hc_collapse with uniform pre": ("hc_collapse", lambda st, pre: _ref["hc_collapse"](st, torch.full_like(pre, 0.5))),
    "fp4_kv_sim with power-of-two scales": (
        "fp4_kv_sim",
        lambda x, block: _ref["act_quant_sim"](x, block, "e2m1", False),
    ),
    "fp4_kv_sim without rounding its scales to E4M3": (
        "fp4_kv_sim",
        lambda x, block: _fp4_kv_variant(x, block, e4m3_scale=False),
    ),
    "fp4_kv_sim rounds ties away from zero": ("fp4_kv_sim", lambda x, block: _fp4_kv_variant(x, block, away=True)),
    "fp4_kv_sim without the amax floor": ("fp4_kv_sim", lambda x, block: _fp4_kv_variant(x, block, floor=0.0)),
    "moe_experts_quant_act quantises per 128 channels": (
        "moe_experts_quant_act",
        lambda x, a, b, i, w, lim, block: _ref["moe_experts_act_quant"](x, a, b, i, w, lim),
    ),
    "moe_experts_fp4_quant_act quantises per 128 channels": (
        "moe_experts_fp4_quant_act",
        lambda x, a, sa, b, sb, i, w, lim, block: _ref["moe_experts_fp4"](x, a, sa, b, sb, i, w, lim, True),
    ),
    "embedding_fp8 ignores the scales": ("embedding_fp8", lambda ids, w, s: w[ids].float()),
    "engram_hash lets a dead token through": (
        "engram_hash", lambda h, *layout: _ref["engram_hash"](h.masked_fill(h == -2, 0), *layout)),
    "engram_hash pads only the blocked shift": ("engram_hash", _engram_hash_pads_one_shift),
    "engram_lookup reads another shard's ids as its own": (
        "engram_lookup", lambda ids, w, s, start: _ref["engram_lookup"](ids.clamp(start, start + w.shape[0] - 1),
                                                                        w, s, start)),
}


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_broken_implementation_is_caught(mutant, reference_table, one_thread):
    op, fn = MUTANTS[mutant]
    candidate = OpTable({op: OpImpl(op, fn, 0, "test:mutant")})
    results = conf.check_op(op, candidate, reference_table, "tiny", torch.float32)
    failed = [r for r in results if not r.passed]
    assert failed, f"the suite did not notice: {mutant}"
    assert all(f"{op}[tiny/float32/{r.case}" in r.message and "test:mutant" in r.message for r in failed)


def test_a_crashing_implementation_is_a_failure_not_an_error(reference_table):
    def crash(*args):
        raise RuntimeError("kernel launch failed")

    candidate = OpTable({"swiglu": OpImpl("swiglu", crash, 0, "test:crash")})
    results = conf.check_op("swiglu", candidate, reference_table, "tiny", torch.float32)
    assert results and not any(r.passed for r in results)
    assert "RuntimeError: kernel launch failed" in results[0].message


# --- the comparison helpers ------------------------------------------------------------------------


def test_tolerances_cover_the_model_dtypes():
    assert set(TOLERANCES) == {torch.float64, torch.float32, torch.bfloat16, torch.float16}
    order = [TOLERANCES[d] for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16)]
    assert all(
        a.atol <= b.atol and a.rtol <= b.rtol and a.min_cosine >= b.min_cosine
        for a, b in zip(order, order[1:])
    )


def _raises(fn, *fragments):
    with pytest.raises(AssertionError) as info:
        fn()
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_assert_close_reports_what_failed():
    e = torch.arange(12, dtype=torch.float64).view(3, 4) / 7
    assert_close(e.float(), e, dtype=torch.float32, name="op[case]")
    _raises(lambda: assert_close(e[:2], e, name="op[case]"), "op[case]", "shape")
    a = e.clone()
    a[1, 2] = float("nan")
    _raises(lambda: assert_close(a, e, name="op[case]"), "op[case]", "NaN at different positions", "(1, 2)")
    a = e.clone()
    a[2, 0] = float("-inf")
    _raises(lambda: assert_close(a, e, name="x"), "-inf at different positions", "(2, 0)")
    a = e.clone()
    a[0, 3] += 1e-3
    _raises(
        lambda: assert_close(a, e, dtype=torch.float32, name="x"), "outside atol", "max abs err", "(0, 3)"
    )
    assert_close(a, e, dtype=torch.bfloat16, name="x")
    _raises(lambda: assert_close(-e, e, dtype=torch.bfloat16, name="x"), "cosine similarity")
    _raises(lambda: assert_close(e.to(torch.bfloat16), e, exact=True, name="x"), "not exactly equal")
    _raises(lambda: assert_close(e.float(), e, check_dtype=torch.float64, name="x"), "dtype torch.float32")
    both_nan = torch.tensor([float("nan"), 1.0, float("inf")])
    assert_close(both_nan.clone(), both_nan, exact=True)


def test_assert_close_compares_integers_exactly():
    e = torch.tensor([[1, 2], [3, 4]])
    assert_close(e.clone(), e, name="ids")
    _raises(lambda: assert_close(torch.tensor([[1, 2], [3, 5]]), e, name="ids"), "ids", "(1, 1)", "exactly")
    _raises(lambda: assert_close(e.double(), e, name="ids"), "floating point")


def test_index_sets_allow_only_ties():
    scores = torch.tensor([[5.0, 3.0, 3.0, 1.0, float("-inf")]], dtype=torch.float64)
    expected = torch.tensor([[0, 1]])
    assert_index_sets_match(torch.tensor([[0, 2]]), expected, scores, dtype=torch.float32)  # tie at 3.0
    assert_index_sets_match(torch.tensor([[1, 0]]), expected, scores, dtype=torch.float32)  # unordered
    _raises(
        lambda: assert_index_sets_match(
            torch.tensor([[1, 0]]), expected, scores, dtype=torch.float32, ordered=True
        ),
        "not best first",
    )
    _raises(
        lambda: assert_index_sets_match(torch.tensor([[0, 3]]), expected, scores, dtype=torch.float32),
        "beyond ties",
    )
    _raises(
        lambda: assert_index_sets_match(torch.tensor([[0, 4]]), expected, scores, dtype=torch.float32),
        "not selectable",
    )
    _raises(
        lambda: assert_index_sets_match(torch.tensor([[0, 0]]), expected, scores, dtype=torch.float32),
        "duplicate",
    )
    _raises(
        lambda: assert_index_sets_match(torch.tensor([[0, -1]]), expected, scores, dtype=torch.float32),
        "1 picks",
    )
    padded = torch.tensor([[0, 1, -1]])
    few = torch.tensor([[5.0, 3.0, float("-inf")]], dtype=torch.float64)
    assert_index_sets_match(padded, padded, few, dtype=torch.float32)
    _raises(
        lambda: assert_index_sets_match(torch.tensor([[0, -1, 1]]), padded, few, dtype=torch.float32),
        "padding",
    )
    # 3.0 vs 3.05 is a tie at bfloat16 tolerance but not at float32
    near = torch.tensor([[5.0, 3.05, 3.0]], dtype=torch.float64)
    assert_index_sets_match(torch.tensor([[0, 2]]), torch.tensor([[0, 1]]), near, dtype=torch.bfloat16)
    _raises(
        lambda: assert_index_sets_match(
            torch.tensor([[0, 2]]), torch.tensor([[0, 1]]), near, dtype=torch.float32
        ),
        "beyond ties",
    )

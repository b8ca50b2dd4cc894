"""Op conformance: run a backend's ops and the cpu_ref reference on identical inputs and compare.

For every op in :data:`~deepinfer_core.ops.catalogue.CATALOGUE` a case generator builds realistic
inputs at the shapes of a preset (``tiny``: fast on a CPU; ``v4_flash``: the real DeepSeek-V4-Flash
widths with a few tokens) for one dtype, from a seeded ``torch.Generator``. The inputs are adversarial
where the semantics say something is never read: KV/key pools hold NaN rows that no index references
(row 0 included, so reading a ``-1`` slot as row 0 shows up), index lists carry ``-1`` slots and whole
``-1`` rows, compression gates carry ``-inf`` slots, expert ids carry ``-1`` (with nonzero weights).

The candidate runs on the inputs as generated (moved to the backend's device); the reference runs on
the same values upcast to float64 (floating tensors only; ``embedding`` is exact and runs as is) and
the outputs are compared at the candidate dtype's tolerance (:mod:`deepinfer_core.testing.compare`).
Selections (``indexer_topk``, ``moe_route``, ``random_sample``) compare as sets up to tied scores,
recomputed here in float64.

The reference is what cpu_ref serves: the core's native bodies (:mod:`deepinfer_core.ops.native`).
Where a backend resolves an op to the same native body (below its kernels, for a dtype they do not
take), the check is that body at the candidate's dtype and device against itself in float64: it still
catches a dtype or device the body mishandles, and it is not reported as a cpu_ref fallback.

    results = run_conformance("nvidia_sm100", "tiny", ["bfloat16", "float32"])
    failed = [r for r in results if not r.passed]
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from deepinfer_core.ops.catalogue import CATALOGUE
from deepinfer_core.ops.registry import BuildContext, OpRegistry, OpTable, resolve_ops
from deepinfer_core.plugins import (
    BACKEND_GROUP,
    REFERENCE_BACKEND,
    LoadedBackend,
    build_op_table,
    collect_registry,
    load_backend,
)
from deepinfer_core.quant.fp8 import quantize_fp8_block
from deepinfer_core.testing.compare import Tolerance, assert_close, assert_index_sets_match, tolerance_for

# --- presets ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Preset:
    name: str
    tokens: int  # T of the activation ops
    batch: int  # B of apply_penalties (the other sampler ops use one row per behaviour they check)
    hidden: int
    heads: int
    head_dim: int
    rope_dim: int
    q_lora: int
    o_groups: int
    o_lora: int
    n_experts: int
    top_k: int  # routed experts per token
    moe_inter: int
    local_experts: int  # experts one rank holds (moe_experts weights; other ids arrive as -1)
    route_tokens: int
    index_heads: int
    index_dim: int
    index_topk: int
    index_candidates: int
    vocab: int
    hc_mult: int
    window: int
    compress_rates: tuple[int, ...]
    kv_pool: int  # rows of the compressed-KV pool sparse_attention gathers from
    window_pool: int  # rows of the sliding-window pool (extra_kv)
    # DeepSeek-V4.1's ops (indexer_scores, candidate_blocks, hc_mixes, hc_collapse, fp4_kv_sim,
    # moe_experts_quant_act), at V4.1's widths where the preset is real-shaped
    v41_hidden: int  # the mHC streams' width and the experts' hidden size
    v41_moe_inter: int
    v41_index_heads: int  # indexer heads (of index_dim)
    cand_block: int  # candidate_blocks: columns a block
    cand_topk_blocks: int  # candidate_blocks: blocks kept
    cand_width: int  # candidate columns a query scores (more than cand_block * cand_topk_blocks: pruning bites)
    kv_fp4_block: int  # fp4_kv_sim: values per E4M3 scale (of head_dim)
    act_block: int  # moe_experts_quant_act: channels per activation scale
    swiglu_limit: float = 10.0
    # DeepSeek-V4.1's vision encoder (encoder_attention): heads, head width, patches of one image
    vit_heads: int = 4
    vit_head_dim: int = 32
    vit_patches: int = 9

    @property
    def index_rope_dim(self) -> int:
        return min(self.rope_dim, self.index_dim // 2)


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        name="tiny",
        tokens=5,
        batch=5,
        hidden=64,
        heads=4,
        head_dim=32,
        rope_dim=16,
        q_lora=48,
        o_groups=2,
        o_lora=32,
        n_experts=8,
        top_k=2,
        moe_inter=32,
        local_experts=8,
        route_tokens=16,
        index_heads=4,
        index_dim=16,
        index_topk=8,
        index_candidates=24,
        vocab=1003,
        hc_mult=4,
        window=8,
        compress_rates=(4, 128),
        kv_pool=64,
        window_pool=32,
        v41_hidden=96,  # three activation groups
        v41_moe_inter=48,  # a partial activation group
        v41_index_heads=4,
        cand_block=4,
        cand_topk_blocks=3,
        cand_width=30,  # 8 blocks, the last one partial
        kv_fp4_block=16,
        act_block=32,
    ),
    # DeepSeek-V4-Flash widths; token counts kept small so that a CPU reference stays feasible.
    "v4_flash": Preset(
        name="v4_flash",
        tokens=4,
        batch=5,
        hidden=4096,
        heads=64,
        head_dim=512,
        rope_dim=64,
        q_lora=1024,
        o_groups=8,
        o_lora=1024,
        n_experts=256,
        top_k=6,
        moe_inter=2048,
        local_experts=4,
        route_tokens=32,
        index_heads=64,
        index_dim=128,
        index_topk=512,
        index_candidates=1536,
        vocab=129280,
        hc_mult=4,
        window=128,
        compress_rates=(4, 128),
        kv_pool=2048,
        window_pool=512,
        # DeepSeek-V4.1-Flash
        v41_hidden=5120,
        v41_moe_inter=2304,
        v41_index_heads=32,
        cand_block=8,
        cand_topk_blocks=2048,
        cand_width=20483,  # 2561 blocks (the last partial), 513 of them pruned
        kv_fp4_block=16,
        act_block=32,
        vit_heads=16,
        vit_head_dim=64,
        vit_patches=81,
    ),
}


# --- cases and results -----------------------------------------------------------------------------


@dataclass
class Case:
    """One call of an op: positional args as the candidate receives them (on the CPU)."""

    op: str
    name: str
    args: tuple
    kwargs: dict[str, Any] = field(default_factory=dict)
    #: dtype of each output: a dtype, or None for "any floating dtype"
    out_dtypes: tuple[torch.dtype | None, ...] = ()
    #: run the reference on float64 copies of the floating inputs (off only for exact ops)
    upcast_reference: bool = True


@dataclass
class CaseResult:
    op: str
    case: str
    preset: str
    dtype: str
    provider: str
    passed: bool
    message: str = ""
    seconds: float = 0.0
    #: the backend lacks this op and the reference implementation stood in for it
    fallback: bool = False

    def __str__(self) -> str:
        status = "ok" if self.passed else "FAIL"
        where = f"{self.op}[{self.preset}/{self.dtype}/{self.case}]"
        head = f"{status} {where} via {self.provider} ({self.seconds:.2f}s)"
        return head if self.passed else f"{head}\n  {self.message}"


#: outputs (by op) whose values are copies or masks of the inputs: compared exactly
EXACT_OPS = frozenset({"embedding", "apply_token_bitmask", "top_k_top_p_min_p", "candidate_blocks", "embedding_fp8",
                       "engram_hash", "engram_lookup"})

OUTPUT_NAMES = {"hc_pre": ("post", "comb", "collapsed"), "moe_route": ("weights", "ids"),
                "hc_mixes": ("pre", "post", "comb")}


# --- generation helpers ----------------------------------------------------------------------------


def _generator(seed: int, op: str) -> torch.Generator:
    # one stream per (seed, op): an op's inputs depend neither on which other ops ran nor on the dtype
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(op.encode()))


def _param_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of small float parameters the model keeps in float32 (sinks, mHC, biases, sampler knobs)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _randn(g: torch.Generator, *shape: int, std: float = 1.0) -> torch.Tensor:
    return torch.randn(shape, generator=g) * std


def _rand(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.rand(shape, generator=g)


def _randint(g: torch.Generator, low: int, high: int, *shape: int) -> torch.Tensor:
    return torch.randint(low, high, shape, generator=g)


def _perm(g: torch.Generator, n: int) -> torch.Tensor:
    return torch.randperm(n, generator=g)


def _weight(g: torch.Generator, n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    return _randn(g, n, k, std=k**-0.5).to(dtype)


def _nan_pool(
    g: torch.Generator, rows: int, dim: int, used: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """A pool whose ``used`` rows are random and every other row is NaN."""
    pool = torch.full((rows, dim), float("nan"), dtype=dtype)
    pool[used] = _randn(g, used.numel(), dim).to(dtype)
    return pool


def _used_rows(g: torch.Generator, rows: int, count: int) -> torch.Tensor:
    """``count`` distinct rows, never the first or the last (those stay NaN)."""
    assert count <= rows - 2
    return _perm(g, rows - 2)[:count] + 1


def _index_rows(
    g: torch.Generator, tokens: int, width: int, used: torch.Tensor, empty_rows: Sequence[int] = ()
) -> torch.Tensor:
    """[tokens, width] distinct ids from ``used`` per row, with -1 slots.

    Row 0 fills a quarter of its slots, -1 after them (an early token); the last row fills every slot;
    rows from 2 on scatter their -1 slots among the ids; ``empty_rows`` are all -1.
    """
    out = torch.full((tokens, width), -1, dtype=torch.long)
    for t in range(tokens):
        if t in empty_rows:
            continue
        if t == 0:
            n_valid = max(1, width // 4)
        elif t == tokens - 1:
            n_valid = width
        else:
            n_valid = max(1, width * (t + 1) // (tokens + 1))
        n_valid = min(n_valid, used.numel())
        ids = used[_perm(g, used.numel())[:n_valid]]
        row = torch.cat([ids, ids.new_full((width - n_valid,), -1)])
        out[t] = row[_perm(g, width)] if t >= 2 else row
    return out


# --- case generators, one per op ------------------------------------------------------------------

CaseGen = Callable[[Preset, torch.dtype, torch.Generator], list[Case]]
GENERATORS: dict[str, CaseGen] = {}


def _gen(op: str) -> Callable[[CaseGen], CaseGen]:
    def register(fn: CaseGen) -> CaseGen:
        GENERATORS[op] = fn
        return fn

    return register


@_gen("embedding")
def _embedding(p: Preset, dtype: torch.dtype, g: torch.Generator) -> list[Case]:
    ids = torch.cat([torch.tensor([0, p.vocab - 1]), _randint(g, 0, p.vocab, p.tokens)])
    ids = torch.cat([ids, ids[2:3]])  # a repeated id
    weight = torch.full((p.vocab, p.hidden), float("nan"), dtype=dtype)  # rows never looked up are NaN
    rows = ids.unique()
    weight[rows] = _randn(g, rows.numel(), p.hidden).to(dtype)
    return [Case("embedding", "lookup", (ids, weight), out_dtypes=(dtype,), upcast_reference=False)]


@_gen("rms_norm")
def _rms_norm(p: Preset, dtype: torch.dtype, g: torch.Generator) -> list[Case]:
    def act(*shape: int) -> torch.Tensor:
        x = _randn(g, *shape, std=2.0)
        x[..., 3] *= 30.0  # a massive-activation channel
        return x.to(dtype)

    def w(d: int) -> torch.Tensor:
        return (1 + _randn(g, d, std=0.1)).to(dtype)

    T = p.tokens
    return [
        Case("rms_norm", "hidden", (act(T, p.hidden), w(p.hidden), 1e-6), out_dtypes=(dtype,)),
        Case("rms_norm", "q_lora", (act(T, p.q_lora), w(p.q_lora), 1e-6), out_dtypes=(dtype,)),
        Case(
            "rms_norm", "per_head_unweighted", (act(T, p.heads, p.head_dim), None, 1e-6), out_dtypes=(dtype,)
        ),
        Case("rms_norm", "hc_streams", (act(T, p.hc_mult, p.hidden), w(p.hidden), 1e-6), out_dtypes=(dtype,)),
    ]


def _rope_tables(
    g: torch.Generator, tokens: int, rope_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    pos = _randint(g, 0, 65536, tokens).to(torch.float64)
    pos[0] = 0
    inv_freq = 10000.0 ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    angles = pos[:, None] * inv_freq[None]
    return angles.cos().to(dtype), angles.sin().to(dtype)


@_gen("rotary_emb")
def _rotary_emb(p: Preset, dtype: torch.dtype, g: torch.Generator) -> list[Case]:
    T, pdt = p.tokens, _param_dtype(dtype)
    cos, sin = _rope_tables(g, T, p.rope_dim, pdt)
    icos, isin = _rope_tables(g, T, p.index_rope_dim, pdt)
    q = _randn(g, T, p.heads, p.head_dim).to(dtype)
    kv = _randn(g, T, 1, p.head_dim).to(dtype)
    iq = _randn(g, T, p.index_heads, p.index_dim).to(dtype)
    return [
        Case("rotary_emb", "q", (q, cos, sin, False), out_dtypes=(dtype,)),
        Case("rotary_emb", "o_inverse", (q, cos, sin, True), out_dtypes=(dtype,)),
        Case("rotary_emb", "kv_single_head", (kv, cos, sin, False), out_dtypes=(dtype,)),
        Case("rotary_emb", "indexer_q", (iq, icos, isin, False), out_dtypes=(dtype,)),
    ]


@_gen("linear")
def _linear(p: Preset, dtype: torch.dtype, g: torch.Generator) -> list[Case]:
    T = p.tokens

    def x(*shape: int) -> torch.Tensor:
        return _randn(g, *shape).to(dtype)

    bias = _randn(g, p.n_experts, std=0.5).to(dtype)
    return [
        Case(
            "linear",
            "q_a",
            (x(T, p.hidden), _weight(g, p.q_lora, p.hidden, dtype), None),
            out_dtypes=(dtype,),
        ),
        Case(
            "linear",
            "q_b",
            (x(T, p.q_lora), _weight(g, p.heads * p.head_dim, p.q_lora, dtype), None),
            out_dtypes=(dtype,),
        ),
        Case(
            "linear",
            "o_b",
            (x(T, p.o_groups * p.o_lora), _weight(g, p.hidden, p.o_groups * p.o_lora, dtype), None),
            out_dtypes=(dtype,),
        ),
        Case(
            "linear",
            "gate_3d_bias",
            (x(2, T, p.hidden), _weight(g, p.n_experts, p.hidden, dtype), bias),
            out_dtypes=(dtype,),
        ),
    ]


@_gen("grouped_linear")
def _grouped_linear(p: Preset, dtype: torch.dtype, g: torch.Generator) -> list[Case]:
    k = p.heads * p.head_dim // p.o_groups
    x = _randn(g, p.tokens, p.o_groups, k).to(dtype)
    w = _weight(g, p.o_groups * p.o_lora, k, dtype)
    return [Case("grouped_linear", "o_a", (x, w), out_dtypes=(dtype,))]


@_gen("swiglu")
def _swiglu(p: Preset, dtype: torch.dtype, g: torch.Generator) -> list[Case]:
    lim = p.swiglu_limit
    gate_up = _randn(g, p.tokens, 2 * p.moe_inter, std=3.0)
    inter = p.moe_inter
    gate_up[0, :4] = lim + 5  # gate above the limit
    gate_up[1, inter : inter + 4] = torch.tensor([lim + 3, -(lim + 3), lim + 0.5, -(lim + 0.5)])  # up clamped
    gate_up = gate_up.to(dtype)
    return [
        Case("swiglu", "limit10", (gate_up, lim), out_dtypes=(dtype,)),
        Case("swiglu", "tight_limit", (gate_up, 1.5), out_dtypes=(dtype,)),
    ]


@_gen("sparse_attention")
def _sparse_attention(p: Preset, dtype: torch.dtype, g: torch.Generator) -> list[Case]:
    T, H, D = p.tokens, p.heads, p.head_dim
    empty = (1,)  # token 1 sees no key at all: only the sink, output 0
    used = _used_rows(g, p.kv_pool, p.kv_pool * 3 // 4)
    kv = _nan_pool(g, p.kv_pool, D, used, dtype)
    indices = _index_rows(g, T, p.index_topk, used, empty)
    wused = _used_rows(g, p.window_pool, p.window_pool // 2)
    wkv = _nan_pool(g, p.window_pool, D, wused, dtype)
    windices = _index_rows(g, T, p.window, wused, empty)
    q = _randn(g, T, H, D)
    # realistic, peaky attention: each head leans towards one of its token's keys
    for t in range(T):
        valid = indices[t][indices[t] >= 0]
        if valid.numel():
            pick = valid[_randint(g, 0, valid.numel(), H)]
            q[t] += 0.15 * kv[pick].float()
    q = q.to(dtype)
    sinks = _randn(g, H).to(_param_dtype(dtype))
    scale = D**-0.5
    return [
        Case(
            "sparse_attention",
            "compressed+window",
            (q, kv, indices, sinks, scale, wkv, windices),
            out_dtypes=(dtype,),
        ),
        Case(
            "sparse_attention",
            "compressed_only",
            (q, kv, indices, sinks, scale, None, None),
            out_dtypes=(dtype,),
        ),
    ]


@_gen("encoder_attention")
def _encoder_attention(p: Preset, dtype: torch.dtype, g: torch.Generator) -> list[Case]:
    """Two images' patches (the second with one head attending almost only to one patch: a peaked
    softmax), and a single patch (its output is its own value)."""
    B, N, H, D = 2, p.vit_patches, p.vit_heads, p.vit_head_dim
    q, k, v = (_randn(g, B, N, H, D) for _ in range(3))
    q[1, :, 0] = 4 * k[1, 3, 0]
    one = tuple(_randn(g, 1, 1, H, D).to(dtype) for _ in range(3))
    return [
        Case("encoder_attention", "two_images", (q.to(dtype), k.to(dtype), v.to(dtype), D**-0.5),
             out_dtypes=(dtype,)),
        Case("encoder_attention", "one_patch", (*one, D**-0.5), out_dtypes=(dtype,)),
    ]


@_gen("compress_windows")
def _compress_windows(p: Preset, dtype: torch.dtype, g: torch.Generator) -> list[Case]:
    cases = []
    shapes = [(p.compress_rates[0], p.head_dim, "attn"), (p.compress_rates[-1], p.head_dim, "attn")]
    shapes.append((p.compress_rates[0], p.index_dim, "index"))
    windows = 3
    for rate, dim, what in shapes:
        length = 2 * rate if rate == p.compress_rates[0] else rate  # the small rate uses overlapping windows
        kv = _randn(g, windows, length, dim)
        gate = _randn(g, windows, length, dim)
        gate[0, : length // 2] = float("-inf")  # first window: the overlap half is still empty
        gate[windows - 1, int(_randint(g, 0, length, 1))] = float("-inf")  # one empty slot elsewhere
        cases.append(
            Case("compress_windows", f"c{rate}_{what}", (kv.to(dtype), gate.to(dtype)), out_dtypes=(dtype,))
        )
    return cases


@_gen("indexer_topk")
def _indexer_topk(p: Preset, dtype: torch.dtype, g: torch.Generator) -> list[Case]:
    T, IH, d, k = p.tokens, p.index_heads, p.index_dim, p.index_topk
    cases = []
    for name, n_cand in (("many_candidates", p.index_candidates), ("few_candidates", k // 2 + 3)):
        pool_rows = n_cand + n_cand // 2 + 2
        used = _used_rows(g, pool_rows, n_cand + n_cand // 4)
        keys = _nan_pool(g, pool_rows, d, used, dtype)
        candidates = _index_rows(g, T, n_cand, used, empty_rows=(1,))
        q = _randn(g, T, IH, d).to(dtype)
        weights = _randn(g, T, IH, std=IH**-0.5).to(dtype)
        cases.append(
            Case("indexer_topk", name, (q, weights, keys, candidates, k, d**-0.5), out_dtypes=(torch.long,))
        )
    return cases


def _doubly_stochastic(g: torch.Generator, tokens: int, n: int) -> torch.Tensor:
    comb = torch.softmax(_randn(g, tokens, n, n, std=2.0), dim=-1)
    for _ in range(10):
        comb = comb / comb.sum(dim=-2, keepdim=True)
        comb = comb / comb.sum(dim=-1, keepdim=True)
    return comb


@_gen("hc_pre")
def _hc_pre(p: Preset, dtype: torch.dtype, g: torch.Generator) -> list[Case]:
    n, D, pdt = p.hc_mult, p.hidden, _param_dtype(dtype)
    streams = _randn(g, p.tokens, n, D, std=2.0).to(dtype)
    fn = _randn(g, (2 + n) * n, n * D, std=(n * D) ** -0.5).to(pdt)
    base = _randn(g, (2 + n) * n, std=0.5).to(pdt)
    scale = (0.5 + _rand(g, 3)).to(pdt)
    out = (None, None, dtype)
    return [
        Case("hc_pre", "sinkhorn20", (streams, fn, base, scale, 20, 1e-6, 1e-6), out_dtypes=out),
        Case("hc_pre", "sinkhorn1", (streams, fn, base, scale, 1, 1e-6, 1e-6), out_dtypes=out),
    ]


@_gen("hc_post")
def _hc_post(p: Preset, dtype: torch.dtype, g: torch.Generator) -> list[Case]:
    n, D, T, pdt = p.hc_mult, p.hidden, p.tokens, _param_dtype(dtype)
    block_out = _randn(g, T, D).to(dtype)
    streams = _randn(g, T, n, D).to(dtype)
    post = (2 * torch.sigmoid(_randn(g, T, n))).to(pdt)
    comb = _doubly_stochastic(g, T, n).to(pdt)
    return [Case("hc_post", "mix", (block_out, streams, post, comb), out_dtypes=(dtype,))]


@_gen("hc_head")
def _hc_head(p: Preset, dtype: torch.dtype, g: torch.Generator) -> list[Case]:
    n, D, pdt = p.hc_mult, p.hidden, _param_dtype(dtype)
    streams = _randn(g, p.tokens, n, D, std=2.0).to(dtype)
    fn = _randn(g, n, n * D, std=(n * D) ** -0.5).to(pdt)
    base = _randn(g, n, std=0.5).to(pdt)
    scale = (0.5 + _rand(g, 1)).to(pdt)
    return [Case("hc_head", "collapse", (streams, fn, base, scale, 1e-6, 1e-6), out_dtypes=(dtype,))]


_SCORING: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sqrtsoftplus": lambda x: F.softplus(x).sqrt(),
    "sigmoid": torch.sigmoid,
    "softmax": lambda x: torch.softmax(x, dim=-1),
}


@_gen("moe_route")
def _moe_route(p: Preset, dtype: torch.dtype, g: torch.Generator) -> list[Case]:
    T, E, k, pdt = p.route_tokens, p.n_experts, p.top_k, _param_dtype(dtype)
    logits = _randn(g, T, E, std=1.5).to(dtype)
    bias = _randn(g, E, std=0.1).to(pdt)
    fixed = torch.stack([_perm(g, E)[:k] for _ in range(T)])
    out = (None, torch.long)
    return [
        Case("moe_route", "sqrtsoftplus_bias", (logits, "sqrtsoftplus", k, bias, None, 1.5), out_dtypes=out),
        Case("moe_route", "sigmoid_bias", (logits, "sigmoid", k, bias, None, 2.5), out_dtypes=out),
        Case("moe_route", "softmax", (logits, "softmax", k, None, None, 1.0), out_dtypes=out),
        Case("moe_route", "hash", (logits, "sqrtsoftplus", k, None, fixed, 1.5), out_dtypes=out),
    ]


@_gen("moe_experts")
def _moe_experts(p: Preset, dtype: torch.dtype, g: torch.Generator) -> list[Case]:
    E, D, inter, k, T = p.local_experts, p.hidden, p.moe_inter, p.top_k, 2 * p.tokens
    x = _randn(g, T, D).to(dtype)
    w13 = _randn(g, E, 2 * inter, D, std=D**-0.5)
    w13[:, _perm(g, inter)[: max(2, inter // 32)]] *= 6.0  # hot gate channels, some beyond the swiglu limit
    w13 = w13.to(dtype)
    w2 = _randn(g, E, D, inter, std=inter**-0.5).to(dtype)
    ids = torch.full((T, k), -1, dtype=torch.long)  # -1: routed to an expert on another rank
    for t in range(T):
        n_local = 0 if t == 0 else min(E, k) if t == 1 else int(_randint(g, 0, min(E, k) + 1, 1))
        ids[t, _perm(g, k)[:n_local]] = _perm(g, E)[:n_local]
    weights = (0.2 + _rand(g, T, k)).to(_param_dtype(dtype))  # nonzero on -1 slots too: they must be skipped
    return [Case("moe_experts", "ep_local", (x, w13, w2, ids, weights, p.swiglu_limit), out_dtypes=(dtype,))]


def _fp8_weight(g: torch.Generator, *shape: int, hot_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A block-FP8 weight [..., N, K] (E4M3 and its float32 tile scales), tiles of very different ranges."""
    w = _randn(g, *shape, std=shape[-1] ** -0.5)
    w[..., : min(shape[-2], 128), :] *= 8.0  # one loud row of tiles must not cost the others precision
    if hot_rows:
        w[..., _perm(g, shape[-2])[:hot_rows], :] *= 6.0
    return quantize_fp8_block(w)


def _fp8_act(g: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    x = _randn(g, *shape)
    x[..., 3] *= 30.0  # a massive-activation channel: its group gets a coarse scale, the others do not
    x[..., 0, :] = 0.0  # an all-zero token: the amax floor keeps its scale finite
    return x.to(dtype)


@_gen("linear_fp8")
def _linear_fp8(p: Preset, dtype: torch.dtype, g: torch.Generator) -> list[Case]:
    T = p.tokens
    shapes = {  # name -> (N, K); "ragged": neither a multiple of 128
        "q_a": (p.q_lora, p.hidden),
        "q_b": (p.heads * p.head_dim, p.q_lora),
        "kv": (p.head_dim, p.hidden),
        "o_b": (p.hidden, p.o_groups * p.o_lora),
        "ragged": (p.q_lora + 37, p.hidden + 72),
    }
    cases = []
    for name, (n, k) in shapes.items():
        w, s = _fp8_weight(g, n, k)
        cases.append(Case("linear_fp8", name, (_fp8_act(g, T, k, dtype=dtype), w, s), out_dtypes=(dtype,)))
    w, s = _fp8_weight(g, p.hidden, p.hidden)
    cases.append(Case("linear_fp8", "3d", (_fp8_act(g, 2, T, p.hidden, dtype=dtype), w, s), out_dtypes=(dtype,)))
    return cases


@_gen("moe_experts_fp8")
def _moe_experts_fp8(p: Preset, dtype: torch.dtype, g: torch.Generator) -> list[Case]:
    E, k, T = p.local_experts, p.top_k, 2 * p.tokens
    cases = []
    for name, d, inter in (("ep_local", p.hidden, p.moe_inter), ("ragged", p.hidden + 40, p.moe_inter + 24)):
        x = _fp8_act(g, T, d, dtype=dtype)
        w13, s13 = _fp8_weight(g, E, 2 * inter, d, hot_rows=max(2, inter // 32))  # some beyond the limit
        w2, s2 = _fp8_weight(g, E, d, inter)
        ids = torch.full((T, k), -1, dtype=torch.long)  # -1: routed to an expert on another rank
        for t in range(T):
            n_local = 0 if t == 0 else min(E, k) if t == 1 else int(_randint(g, 0, min(E, k) + 1, 1))
            ids[t, _perm(g, k)[:n_local]] = _perm(g, E)[:n_local]
        weights = (0.2 + _rand(g, T, k)).to(_param_dtype(dtype))
        args = (x, w13, s13, w2, s2, ids, weights, p.swiglu_limit)
        cases.append(Case("moe_experts_fp8", name, args, out_dtypes=(dtype,)))
    return cases


@_gen("apply_penalties")
def _apply_penalties(p: Preset, dtype: torch.dtype, g: torch.Generator) -> list[Case]:
    B, V, pdt = p.batch, p.vocab, _param_dtype(dtype)
    logits = _randn(g, B, V, std=3.0).to(dtype)
    prompt_mask = _rand(g, B, V) < 0.05
    counts = _randint(g, 1, 4, B, V) * (_rand(g, B, V) < 0.03)
    knobs = torch.tensor(
        [[1.0, 0.0, 0.0], [1.3, 0.5, 0.2], [1.1, 0.0, 0.7], [2.0, 1.0, 0.0], [0.8, 0.1, 0.1]]
    )
    knobs = knobs[torch.arange(B) % knobs.shape[0]].to(pdt)  # row 0: all off
    rep, pres, freq = knobs.unbind(-1)
    return [
        Case("apply_penalties", "mixed", (logits, prompt_mask, counts, rep, pres, freq), out_dtypes=(dtype,))
    ]


def _peaky_logits(g: torch.Generator, rows: int, vocab: int, head: int = 32) -> torch.Tensor:
    """LM-like logits: a long tail plus a head of a few dozen likely tokens."""
    logits = _randn(g, rows, vocab, std=1.5)
    for r in range(rows):
        logits[r, _perm(g, vocab)[:head]] += 8 + 6 * _rand(g, head)
    return logits


@_gen("top_k_top_p_min_p")
def _top_k_top_p_min_p(p: Preset, dtype: torch.dtype, g: torch.Generator) -> list[Case]:
    V, pdt = p.vocab, _param_dtype(dtype)
    logits = _peaky_logits(g, 5, V).to(dtype)
    top_k = torch.tensor([20, 0, -1, 25, V + 7])
    top_p = torch.ones(5, dtype=torch.float64)
    min_p = torch.zeros(5, dtype=torch.float64)
    # put the top_p and min_p thresholds mid-way between distinct probability levels, so that the kept
    # sets do not hinge on rounding: computed from the values the op sees, after the top_k cut
    for r, (use_p, use_m) in enumerate(
        [(False, False), (True, False), (False, True), (True, True), (False, False)]
    ):
        row = logits[r].to(torch.float64)
        if top_k[r] > 0:
            kth = row.sort(descending=True).values[min(int(top_k[r]), V) - 1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, -1).sort(descending=True).values
        if use_p:
            i = 4 + int(_randint(g, 0, 6, 1))
            cum = probs.cumsum(0)
            top_p[r] = (cum[i - 1] + cum[i]) / 2
        if use_m:
            ratio = probs[:-1] / probs[1:]
            gaps = [j for j in range(3, 15) if ratio[j] > 1.05]
            j = gaps[0] if gaps else 3
            min_p[r] = (probs[j] * probs[j + 1]).sqrt() / probs[0]
    return [
        Case("top_k_top_p_min_p", "mixed", (logits, top_k, top_p.to(pdt), min_p.to(pdt)), out_dtypes=(dtype,))
    ]


@_gen("random_sample")
def _random_sample(p: Preset, dtype: torch.dtype, g: torch.Generator) -> list[Case]:
    B, V = 4, p.vocab
    probs = torch.softmax(_peaky_logits(g, B, V).to(torch.float64), -1)
    top = probs[1].topk(50).indices
    probs[1] = torch.zeros(V, dtype=torch.float64).index_copy(0, top, probs[1, top])  # top-50 survivors
    probs[2] = 0
    probs[2, _perm(g, V)[:17]] = 1.0  # uniform over 17 tokens
    probs[3] = 0
    probs[3, int(_randint(g, 0, V, 1))] = 1.0  # one-hot
    probs = probs / probs.sum(-1, keepdim=True)
    noise = -torch.log(_rand(g, B, V).clamp(min=1e-12))  # Exp(1)
    return [
        Case(
            "random_sample",
            "race",
            (probs.to(dtype), noise.to(_param_dtype(dtype))),
            out_dtypes=(torch.long,),
        )
    ]


@_gen("apply_token_bitmask")
def _apply_token_bitmask(p: Preset, dtype: torch.dtype, g: torch.Generator) -> list[Case]:
    B, V = 4, p.vocab
    words = (V + 31) // 32
    logits = _randn(g, B, V, std=3.0).to(dtype)
    bitmask = _randint(g, -(2**31), 2**31, B, words).to(torch.int32)  # bit 31 set in about half the words
    bitmask[0] = -1  # everything allowed
    bitmask[1] = 0
    last = V - 1
    bitmask[1, last // 32] = torch.tensor(1 << (last % 32), dtype=torch.int64).to(
        torch.int32
    )  # only the last
    return [Case("apply_token_bitmask", "xgrammar", (logits, bitmask), out_dtypes=(dtype,))]


def make_cases(op: str, preset: str | Preset, dtype: torch.dtype, seed: int = 0) -> list[Case]:
    """The input cases of ``op`` at ``preset`` shapes in ``dtype`` (CPU tensors, reproducible by seed)."""
    p = PRESETS[preset] if isinstance(preset, str) else preset
    return GENERATORS[op](p, dtype, _generator(seed, op))


# --- checks ----------------------------------------------------------------------------------------

Check = Callable[[Case, Any, Any, tuple, torch.dtype, str], None]
CHECKS: dict[str, Check] = {}


def _as_tuple(out: Any) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _check_outputs(
    case: Case, actual: Any, expected: Any, ref_args: tuple, dtype: torch.dtype, label: str
) -> None:
    actual, expected = _as_tuple(actual), _as_tuple(expected)
    if len(actual) != len(expected):
        raise AssertionError(f"{label}: returned {len(actual)} outputs, expected {len(expected)}")
    names = OUTPUT_NAMES.get(case.op, ("out",) * len(expected))
    for i, (a, e) in enumerate(zip(actual, expected)):
        name = f"{label} {names[i]}" if len(expected) > 1 else label
        _check_dtype(case, i, a, name)
        assert_close(a, e, dtype=dtype, name=name, exact=case.op in EXACT_OPS)


def _check_dtype(case: Case, i: int, actual: Any, name: str) -> None:
    if not isinstance(actual, torch.Tensor):
        raise AssertionError(f"{name}: expected a tensor, got {type(actual).__name__}")
    want = case.out_dtypes[i] if i < len(case.out_dtypes) else None
    if want is None:
        if not actual.dtype.is_floating_point:
            raise AssertionError(f"{name}: dtype {actual.dtype}, expected a floating dtype")
    elif actual.dtype != want:
        raise AssertionError(f"{name}: dtype {actual.dtype}, expected {want}")


def _check(op: str) -> Callable[[Check], Check]:
    def register(fn: Check) -> Check:
        CHECKS[op] = fn
        return fn

    return register


@_check("indexer_topk")
def _check_indexer_topk(
    case: Case, actual: Any, expected: Any, ref_args: tuple, dtype: torch.dtype, label: str
):
    _check_dtype(case, 0, actual, label)
    q, weights, keys, candidates, _, scale = ref_args
    cand_keys = keys[candidates.clamp(min=0)].masked_fill((candidates < 0).unsqueeze(-1), 0)
    dots = torch.einsum("thd,tcd->thc", q, cand_keys)
    scores = (dots.relu() * scale * weights.unsqueeze(-1)).sum(1).masked_fill(candidates < 0, float("-inf"))
    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(f"{label}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    cols_a, cols_e = _key_ids_to_columns(actual, candidates), _key_ids_to_columns(expected, candidates)
    assert_index_sets_match(
        cols_a,
        cols_e,
        scores,
        dtype=dtype,
        ordered=True,
        name=f"{label} (ids as candidate columns; -2 = a key id that is not one of the row's candidates)",
    )


def _key_ids_to_columns(ids: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    cols = torch.full(ids.shape, -1, dtype=torch.long)
    for t in range(ids.shape[0]):
        col_of = {c: j for j, c in enumerate(candidates[t].tolist()) if c >= 0}
        cols[t] = torch.tensor(
            [-1 if i == -1 else col_of.get(i, -2) for i in ids[t].tolist()], dtype=torch.long
        )
    return cols


@_check("moe_route")
def _check_moe_route(case: Case, actual: Any, expected: Any, ref_args: tuple, dtype: torch.dtype, label: str):
    actual, expected = _as_tuple(actual), _as_tuple(expected)
    if len(actual) != 2:
        raise AssertionError(f"{label}: returned {len(actual)} outputs, expected 2 (weights, ids)")
    (weights, ids), (_, e_ids) = actual, expected
    _check_dtype(case, 0, weights, f"{label} weights")
    _check_dtype(case, 1, ids, f"{label} ids")
    logits, scoring, top_k, bias, fixed, factor = ref_args
    scores = _SCORING[scoring](logits)
    if fixed is not None:
        assert_close(ids, fixed, name=f"{label} ids (hash routing must return the fixed ids)")
    else:
        choice = scores if bias is None else scores + bias
        assert_index_sets_match(ids, e_ids, choice, dtype=dtype, name=f"{label} ids")
    # the weights must belong to the ids the candidate chose: scores[ids] normalised and scaled
    picked = scores.gather(1, ids.cpu().clamp(0, scores.shape[1] - 1))
    want = picked / picked.sum(-1, keepdim=True) * factor
    if tuple(weights.shape) != tuple(want.shape):
        raise AssertionError(f"{label} weights: shape {tuple(weights.shape)}, expected {tuple(want.shape)}")
    assert_close(weights, want, dtype=dtype, name=f"{label} weights (for the returned ids)")


@_check("random_sample")
def _check_random_sample(
    case: Case, actual: Any, expected: Any, ref_args: tuple, dtype: torch.dtype, label: str
):
    _check_dtype(case, 0, actual, label)
    probs, noise = ref_args
    scores = (probs / noise).masked_fill(probs <= 0, float("-inf"))  # zero-probability tokens: never
    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(f"{label}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    assert_index_sets_match(actual.unsqueeze(-1), expected.unsqueeze(-1), scores, dtype=dtype, name=label)


#: moe_experts_fp8 quantises its intermediate h: an h value within rounding noise of an E4M3 rounding
#: boundary may round either way (one E4M3 step, 2^-3 relative, on that element), which float32 and
#: float16 tolerances cannot absorb (measured at V4-Flash widths, float32: 13 of 33k outputs off by up
#: to 1.1e-3)
FP8_REQUANT = Tolerance(atol=5e-3, rtol=5e-3, min_cosine=1 - 1e-5)


@_check("moe_experts_fp8")
def _check_moe_experts_fp8(
    case: Case, actual: Any, expected: Any, ref_args: tuple, dtype: torch.dtype, label: str
):
    _check_dtype(case, 0, actual, label)
    own = tolerance_for(dtype)
    tol = Tolerance(max(own.atol, FP8_REQUANT.atol), max(own.rtol, FP8_REQUANT.rtol),
                    min(own.min_cosine, FP8_REQUANT.min_cosine))
    assert_close(actual, expected, dtype=dtype, name=label, tol=tol)


# --- running ---------------------------------------------------------------------------------------


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        return tuple(_map_tensors(o, fn) for o in obj)
    if isinstance(obj, list):
        return [_map_tensors(o, fn) for o in obj]
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj


def _upcast(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float64) if t.dtype.is_floating_point else t.clone()


def reference_provider(reference: str = REFERENCE_BACKEND) -> str:
    """The provider name under which the reference backend's own implementations are registered."""
    return f"{BACKEND_GROUP}:{reference}"


def reference_registry(loaded: LoadedBackend, reference: str = REFERENCE_BACKEND) -> OpRegistry:
    """The reference backend's own implementations only (kernel packs that override them are dropped)."""
    full = collect_registry(loaded)
    provider = reference_provider(reference)
    only = OpRegistry()
    only.impls = {op: [i for i in impls if i.provider == provider] for op, impls in full.impls.items()}
    return only


def reference_op_table(reference: str = REFERENCE_BACKEND, loaded: LoadedBackend | None = None) -> OpTable:
    loaded = loaded or load_backend(reference)
    ctx = BuildContext(backend=reference, dtype=torch.float64, device=torch.device("cpu"))
    return resolve_ops(reference_registry(loaded, reference), ctx)


def backend_device(backend: str) -> torch.device:
    """Where the backend computes (its ``deepinfer_init_device`` hook; the CPU when it has none)."""
    device = load_backend(backend).hook.deepinfer_init_device(local_rank=0)
    return torch.device(device) if device is not None else torch.device("cpu")


def candidate_op_table(backend: str, dtype: torch.dtype, device: torch.device | None = None) -> OpTable:
    """What the engine would resolve for ``backend`` at ``dtype`` (kernel packs included); ops the
    backend lacks fall back to the reference and are reported as such."""
    return build_op_table(backend, dtype=dtype, device=device, allow_reference_fallback=True)


def as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return value


def check_op(
    op: str,
    candidate: OpTable,
    reference: OpTable,
    preset: str | Preset,
    dtype: str | torch.dtype,
    seed: int = 0,
    device: torch.device | str | None = None,
    backend: str | None = None,
    reference_backend: str = REFERENCE_BACKEND,
) -> list[CaseResult]:
    """Run every case of ``op``: the candidate table's implementation against the reference table's."""
    dtype = as_dtype(dtype)
    p = PRESETS[preset] if isinstance(preset, str) else preset
    dname = str(dtype).removeprefix("torch.")
    impl = candidate.chosen[op]
    provider = impl.provider
    fallback = backend not in (None, reference_backend) and provider == reference_provider(reference_backend)
    device = torch.device(device) if device is not None else torch.device("cpu")
    check = CHECKS.get(op, _check_outputs)
    results = []
    for case in make_cases(op, p, dtype, seed):
        label = f"{op}[{p.name}/{dname}/{case.name}, seed={seed}] via {provider}"
        start = time.perf_counter()
        try:
            ref_args = _map_tensors(case.args, _upcast) if case.upcast_reference else case.args
            ref_kwargs = _map_tensors(case.kwargs, _upcast) if case.upcast_reference else case.kwargs
            expected = getattr(reference, op)(*ref_args, **ref_kwargs)
            args = _map_tensors(case.args, lambda t: t.to(device))
            kwargs = _map_tensors(case.kwargs, lambda t: t.to(device))
            try:
                actual = impl.fn(*args, **kwargs)
            except Exception as exc:  # a crash is a conformance failure, reported like one
                raise AssertionError(f"{label}: raised {type(exc).__name__}: {exc}") from exc
            actual = _map_tensors(actual, lambda t: t.detach().cpu())
            check(case, actual, expected, ref_args, dtype, label)
            passed, message = True, ""
        except AssertionError as exc:
            passed, message = False, str(exc)
        results.append(
            CaseResult(
                op, case.name, p.name, dname, provider, passed, message, time.perf_counter() - start, fallback
            )
        )
    return results


def run_conformance(
    backend: str,
    preset: str,
    dtypes: Iterable[str | torch.dtype],
    reference: str = REFERENCE_BACKEND,
    ops: Iterable[str] | None = None,
    seed: int = 0,
) -> list[CaseResult]:
    """Check every op (or ``ops``) of ``backend`` against ``reference`` at ``preset`` for each dtype."""
    ref_table = reference_op_table(reference)
    device = backend_device(backend)
    results: list[CaseResult] = []
    for dtype in map(as_dtype, dtypes):
        table = candidate_op_table(backend, dtype, device)
        for op in ops or CATALOGUE:
            results += check_op(op, table, ref_table, preset, dtype, seed, device, backend, reference)
    return results


def summarize(results: Sequence[CaseResult]) -> str:
    failed = [r for r in results if not r.passed]
    lines = [f"{len(results) - len(failed)}/{len(results)} cases passed"]
    lines += [str(r) for r in failed]
    return "\n".join(lines)


__all__ = [
    "CHECKS",
    "EXACT_OPS",
    "GENERATORS",
    "PRESETS",
    "Case",
    "CaseResult",
    "Preset",
    "as_dtype",
    "backend_device",
    "candidate_op_table",
    "check_op",
    "make_cases",
    "reference_op_table",
    "reference_provider",
    "reference_registry",
    "run_conformance",
    "summarize",
]


# --- FP4 routed experts ------------------------------------------------------------------------------


@_gen("moe_experts_fp4")
def _moe_experts_fp4(p: Preset, dtype: torch.dtype, g: torch.Generator) -> list[Case]:
    """Packed e2m1 experts with e8m0 scales, without and with DeepSeek's activation quantisation."""
    from deepinfer_core.quant.fp4 import quantize_fp4_block

    E, k, T, D, inter = p.local_experts, p.top_k, 2 * p.tokens, p.hidden, p.moe_inter
    x = _randn(g, T, D).to(dtype)
    w13 = _randn(g, E, 2 * inter, D, std=D**-0.5)
    w13[:, _perm(g, inter)[: max(2, inter // 32)]] *= 6.0  # hot gate channels, some beyond the swiglu limit
    w13, s13 = quantize_fp4_block(w13)
    w2, s2 = quantize_fp4_block(_randn(g, E, D, inter, std=inter**-0.5))
    ids = torch.full((T, k), -1, dtype=torch.long)  # -1: routed to an expert on another rank
    for t in range(T):
        n_local = 0 if t == 0 else min(E, k) if t == 1 else int(_randint(g, 0, min(E, k) + 1, 1))
        ids[t, _perm(g, k)[:n_local]] = _perm(g, E)[:n_local]
    weights = (0.2 + _rand(g, T, k)).to(_param_dtype(dtype))
    return [Case("moe_experts_fp4", name, (x, w13, s13, w2, s2, ids, weights, p.swiglu_limit, quant),
                 out_dtypes=(dtype,)) for name, quant in (("w4a16", False), ("w4a8_deepseek", True))]


@_check("moe_experts_fp4")
def _check_moe_experts_fp4(
    case: Case, actual: Any, expected: Any, ref_args: tuple, dtype: torch.dtype, label: str
):
    """With quant_act the intermediate h is rounded to x.dtype and re-quantised to E4M3 (DeepSeek's
    steps), which a float64 reference does not round: an h element near an E4M3 boundary may land one
    E4M3 step (2^-3 relative) away, moving every output of its token. Up to 2% of the elements may
    then lie outside the dtype's tolerance (bf16, measured on the tiny preset: 3 of 640); the cosine
    must still meet it (a wrong nibble order or scale fails it by far)."""
    if not case.args[-1]:
        return _check_outputs(case, actual, expected, ref_args, dtype, label)
    _check_with_requant_flips(case, actual, expected, dtype, label, max_fraction=0.02)


def _check_with_requant_flips(case: Case, actual: Any, expected: Any, dtype: torch.dtype, label: str,
                              max_fraction: float, min_cosine: float = 1 - 2e-4) -> None:
    """The dtype's tolerance (at least FP8_REQUANT's) on all but ``max_fraction`` of the elements, and
    its cosine (or ``min_cosine`` where lower) on all of them."""
    _check_dtype(case, 0, actual, label)
    own = tolerance_for(dtype)
    tol = Tolerance(max(own.atol, FP8_REQUANT.atol), max(own.rtol, FP8_REQUANT.rtol),
                    min(own.min_cosine, min_cosine))
    a, e = actual.double(), expected.double()
    outside = (a - e).abs() > tol.atol + tol.rtol * e.abs()
    if outside.float().mean() > max_fraction:
        raise AssertionError(f"{label}: {int(outside.sum())} of {outside.numel()} elements outside atol={tol.atol} "
                             f"+ rtol={tol.rtol}*|e| (at most {max_fraction:.0%} may be re-quantisation flips)")
    cosine = torch.nn.functional.cosine_similarity(a.flatten(), e.flatten(), dim=0)
    if cosine < tol.min_cosine:
        raise AssertionError(f"{label}: cosine {float(cosine):.6f} < {tol.min_cosine}")


@_gen("act_quant_sim")
def _act_quant_sim(p: Preset, dtype: torch.dtype, g: torch.Generator) -> list[Case]:
    """The three uses in DeepSeek's model: activations per 128 (a partial last group here), a KV entry's
    non-RoPE values per 64, indexer queries Hadamard-rotated and FP4 per 32; rows of very different
    ranges and an all-zero row."""
    T = p.tokens
    x = _randn(g, T, p.hidden + 40) * torch.logspace(-3, 3, T).unsqueeze(1)
    x[0] = 0.0
    kv = _randn(g, T, p.head_dim - p.rope_dim) * 4.0
    q = _randn(g, T, p.index_heads, p.index_dim)
    return [
        Case("act_quant_sim", "act_e4m3_128", (x.to(dtype), 128, "e4m3", False), out_dtypes=(dtype,)),
        Case("act_quant_sim", "kv_e4m3_64", (kv.to(dtype), 64, "e4m3", False), out_dtypes=(dtype,)),
        Case("act_quant_sim", "index_hadamard_e2m1_32", (q.to(dtype), 32, "e2m1", True), out_dtypes=(dtype,)),
    ]


@_check("act_quant_sim")
def _check_act_quant_sim(
    case: Case, actual: Any, expected: Any, ref_args: tuple, dtype: torch.dtype, label: str
):
    """Without rotation exact: the power-of-two scales and the roundings of x.dtype values are the same
    in any precision. With it the rotated values are rounded to x.dtype first (bf16: 2^-9 relative),
    which moves some across an e2m1 boundary: up to 5% of the elements may differ by one step, an e2m1
    step being up to a third of the value (cosine 0.998; measured on the tiny preset: 0.99938)."""
    if not case.args[-1]:
        _check_dtype(case, 0, actual, label)
        assert_close(actual, expected.to(actual.dtype), dtype=dtype, name=label, exact=True)
        return
    _check_with_requant_flips(case, actual, expected, dtype, label, max_fraction=0.05, min_cosine=0.998)


# --- DeepSeek's FP8 KV entry: write (kv_fp8_pack) and read (sparse_attention_fp8) --------------------


def _kv_rows(g: torch.Generator, rows: int, p: Preset) -> torch.Tensor:
    """KV rows of very different ranges: an all-zero row, a row whose amax is a power of two times 448
    (its own scale), signed zeros and values that tie between E4M3 neighbours."""
    kv = _randn(g, rows, p.head_dim) * torch.logspace(-4, 3, rows).unsqueeze(1)
    kv[0] = 0.0
    if rows > 2:
        kv[1, 0], kv[1, 1], kv[1, 2] = 448.0 * 2.0**-3, -0.0, 1.0625 * 2.0**-3  # 1.0625: halfway, to even
    return kv


@_gen("kv_fp8_pack")
def _kv_fp8_pack(p: Preset, dtype: torch.dtype, g: torch.Generator) -> list[Case]:
    """Bytes compare exactly: the quantisation runs from the same dtype values on every backend (the
    reference is not upcast: the entry stores its RoPE values in the input's dtype)."""
    kv = _kv_rows(g, 4 * p.tokens, p).to(dtype)
    return [Case("kv_fp8_pack", "entries", (kv, p.rope_dim), out_dtypes=(torch.uint8,), upcast_reference=False)]


@_check("kv_fp8_pack")
def _check_kv_fp8_pack(case: Case, actual: Any, expected: Any, ref_args: tuple, dtype: torch.dtype, label: str):
    _check_dtype(case, 0, actual, label)
    if tuple(actual.shape) != tuple(expected.shape) or not torch.equal(actual, expected):
        bad = "shape" if tuple(actual.shape) != tuple(expected.shape) else \
            f"{int((actual != expected).sum())} bytes"
        raise AssertionError(f"{label}: entries differ from the reference ({bad})")


def _fp8_pool(g: torch.Generator, rows: int, used: torch.Tensor, p: Preset, dtype: torch.dtype) -> torch.Tensor:
    """Packed entries: the ``used`` rows real KV, every other row 0xFF bytes (NaN values and scales)."""
    from deepinfer_core.quant.kv_fp8 import pack_kv_fp8

    packed = pack_kv_fp8(_randn(g, used.numel(), p.head_dim).to(dtype), p.rope_dim)
    pool = torch.full((rows, packed.shape[-1]), 0xFF, dtype=torch.uint8)
    pool[used] = packed
    return pool


@_gen("sparse_attention_fp8")
def _sparse_attention_fp8(p: Preset, dtype: torch.dtype, g: torch.Generator) -> list[Case]:
    from deepinfer_core.quant.kv_fp8 import unpack_kv_fp8

    T, H, D = p.tokens, p.heads, p.head_dim
    empty = (1,)
    used = _used_rows(g, p.kv_pool, p.kv_pool * 3 // 4)
    kv = _fp8_pool(g, p.kv_pool, used, p, dtype)
    indices = _index_rows(g, T, p.index_topk, used, empty)
    wused = _used_rows(g, p.window_pool, p.window_pool // 2)
    wkv = _fp8_pool(g, p.window_pool, wused, p, dtype)
    windices = _index_rows(g, T, p.window, wused, empty)
    q = _randn(g, T, H, D)
    for t in range(T):
        valid = indices[t][indices[t] >= 0]
        if valid.numel():
            pick = valid[_randint(g, 0, valid.numel(), H)]
            q[t] += 0.15 * unpack_kv_fp8(kv[pick], D, p.rope_dim, dtype, torch.float32)
    q = q.to(dtype)
    sinks = _randn(g, H).to(_param_dtype(dtype))
    args = (q, kv, indices, sinks, D**-0.5, p.rope_dim, dtype)
    return [
        Case("sparse_attention_fp8", "compressed+window", (*args, wkv, windices), out_dtypes=(dtype,)),
        Case("sparse_attention_fp8", "compressed_only", (*args, None, None), out_dtypes=(dtype,)),
    ]


# --- DeepSeek's quantised linears over weights kept in FP8 or in a float dtype ---------------------


@_gen("linear_fp8_ue8m0")
def _linear_fp8_ue8m0(p: Preset, dtype: torch.dtype, g: torch.Generator) -> list[Case]:
    """linear_fp8's shapes with DeepSeek's power-of-two weight scales (a ragged one included)."""
    T, cases = p.tokens, []
    for name, (n, k) in {"q_a": (p.q_lora, p.hidden), "o_b": (p.hidden, p.o_groups * p.o_lora),
                         "ragged": (p.q_lora + 37, p.hidden + 72)}.items():
        w, s = quantize_fp8_block(_randn(g, n, k, std=k**-0.5), ue8m0=True)
        cases.append(Case("linear_fp8_ue8m0", name, (_fp8_act(g, T, k, dtype=dtype), w, s), out_dtypes=(dtype,)))
    return cases


@_gen("moe_experts_act_quant")
def _moe_experts_act_quant(p: Preset, dtype: torch.dtype, g: torch.Generator) -> list[Case]:
    """moe_experts_fp4's case with the weights in the candidate's dtype."""
    E, k, T, D, inter = p.local_experts, p.top_k, 2 * p.tokens, p.hidden, p.moe_inter
    x = _randn(g, T, D).to(dtype)
    w13 = _randn(g, E, 2 * inter, D, std=D**-0.5)
    w13[:, _perm(g, inter)[: max(2, inter // 32)]] *= 6.0  # hot gate channels, some beyond the swiglu limit
    w2 = _randn(g, E, D, inter, std=inter**-0.5)
    ids = torch.full((T, k), -1, dtype=torch.long)
    for t in range(T):
        n_local = 0 if t == 0 else min(E, k) if t == 1 else int(_randint(g, 0, min(E, k) + 1, 1))
        ids[t, _perm(g, k)[:n_local]] = _perm(g, E)[:n_local]
    weights = (0.2 + _rand(g, T, k)).to(_param_dtype(dtype))
    args = (x, w13.to(dtype), w2.to(dtype), ids, weights, p.swiglu_limit)
    return [Case("moe_experts_act_quant", "ep_local", args, out_dtypes=(dtype,))]


@_check("moe_experts_act_quant")
def _check_moe_experts_act_quant(
    case: Case, actual: Any, expected: Any, ref_args: tuple, dtype: torch.dtype, label: str
):
    """Re-quantisation flips of the intermediate, as for moe_experts_fp4 with quant_act."""
    _check_with_requant_flips(case, actual, expected, dtype, label, max_fraction=0.02)


# --- DeepSeek-V4.1: indexer scores, candidate blocks, single-pass mHC, FP4 KV, 32-channel experts ----


@_gen("indexer_scores")
def _indexer_scores(p: Preset, dtype: torch.dtype, g: torch.Generator) -> list[Case]:
    """V4.1's indexer heads over every compressed candidate of a query (the scores candidate_blocks ranks):
    NaN pool rows that no candidate references, -1 slots at row ends and scattered, a row of only -1."""
    T, IH, d, width = p.tokens, p.v41_index_heads, p.index_dim, p.cand_width
    pool_rows = width + width // 2 + 2
    used = _used_rows(g, pool_rows, width + width // 4)
    keys = _nan_pool(g, pool_rows, d, used, dtype)
    candidates = _index_rows(g, T, width, used, empty_rows=(1,))
    q = _randn(g, T, IH, d).to(dtype)
    weights = _randn(g, T, IH, std=IH**-0.5).to(dtype)
    out = (_param_dtype(dtype),)  # scores come back in the accumulation dtype
    return [
        Case("indexer_scores", "every_candidate", (q, weights, keys, candidates, d**-0.5), out_dtypes=out),
        # the model folds the softmax scale into the weights and passes scale 1
        Case("indexer_scores", "prescaled_weights", (q, (weights.double() * d**-0.5).to(dtype), keys, candidates,
                                                     1.0), out_dtypes=out),
    ]


def candidate_block_rows(p: Preset, dtype: torch.dtype, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [7, W], valid [7, W]) of rows that make candidate_blocks prune (W = ``p.cand_width``, blocks
    of ``p.cand_block``, the last one partial, more than ``p.cand_topk_blocks`` + 2 of them):

    0. every column valid; the newest block (the partial last one) scores lowest: only its pin keeps it
    1. no valid column (NaN and huge scores on the invalid ones): nothing kept
    2. a prefix ending one column into a block; ``topk_blocks + 1`` older blocks tie for the best maximum,
       so the pin and the tie towards the lower block decide which one is cut
    3. valid columns scattered among invalid ones: the pinned block is the one of the last valid column
       (not the one the number of valid columns points at), which scores lowest
    4. fewer reachable blocks than ``topk_blocks``: every one kept but an older one whose valid columns
       all score -inf
    5. the newest block among the best (its pin changes nothing)
    6. invalid columns holding the best scores and NaN: never counted
    """
    block, keep, width = p.cand_block, p.cand_topk_blocks, p.cand_width
    n_blocks = -(-width // block)
    assert width % block and n_blocks >= keep + 3, "the preset's candidate rows must make the filter prune"
    scores = _randn(g, 7, width)
    valid = torch.zeros(7, width, dtype=torch.bool)
    low, high = -100.0, 50.0
    # 0
    valid[0] = True
    scores[0, (n_blocks - 1) * block :] += low
    # 1
    scores[1, _perm(g, width)[: width // 3]] = 1e4
    scores[1, 0] = float("nan")
    # 2
    newest = n_blocks - 2
    valid[2, : newest * block + 1] = True
    scores[2, newest * block] += low
    tied = _perm(g, newest)[: keep + 1]
    scores[2, tied * block + _randint(g, 0, block, keep + 1)] = high
    # 3
    last = width - block - 2
    valid[3, : last + 1] = _rand(g, last + 1) < 0.6
    valid[3, last] = True
    first_of_newest = last // block * block
    scores[3, first_of_newest : first_of_newest + block] += low
    # 4
    reach = (keep // 2) * block + 3
    valid[4, :reach] = True
    scores[4, :block] = float("-inf")
    # 5
    valid[5, : width - 1] = True
    scores[5, (n_blocks - 1) * block :] += high
    # 6
    valid[6, : width // 2] = True
    scores[6, width // 2 :] = 1e4
    scores[6, width - 1] = float("nan")
    return scores.to(dtype), valid


@_gen("candidate_blocks")
def _candidate_blocks(p: Preset, dtype: torch.dtype, g: torch.Generator) -> list[Case]:
    """The filter over the rows of :func:`candidate_block_rows`, in the candidate dtype (bf16 scores add ties
    of their own), and the same rows with every block kept (topk_blocks above the number of blocks)."""
    scores, valid = candidate_block_rows(p, dtype, g)
    n_blocks = -(-p.cand_width // p.cand_block)
    return [
        Case("candidate_blocks", "prune", (scores, valid, p.cand_block, p.cand_topk_blocks), out_dtypes=(torch.bool,)),
        Case("candidate_blocks", "keep_all", (scores, valid, p.cand_block, n_blocks + 1), out_dtypes=(torch.bool,)),
    ]


@_gen("hc_mixes")
def _hc_mixes(p: Preset, dtype: torch.dtype, g: torch.Generator) -> list[Case]:
    """hc_pre's mixes at V4.1's width; one token's streams all zero (V4.1's norm eps 1e-20 keeps its
    normalisation finite: its mixes are the biases alone)."""
    n, D, pdt = p.hc_mult, p.v41_hidden, _param_dtype(dtype)
    streams = _randn(g, p.tokens, n, D, std=2.0)
    streams[0] = 0.0
    streams = streams.to(dtype)
    fn = _randn(g, (2 + n) * n, n * D, std=(n * D) ** -0.5).to(pdt)
    base = _randn(g, (2 + n) * n, std=0.5).to(pdt)
    scale = (0.5 + _rand(g, 3)).to(pdt)
    out = (None, None, None)
    return [
        Case("hc_mixes", "sinkhorn20_v41_eps", (streams, fn, base, scale, 20, 1e-6, 1e-20), out_dtypes=out),
        Case("hc_mixes", "sinkhorn1", (streams, fn, base, scale, 1, 1e-6, 1e-6), out_dtypes=out),
    ]


@_gen("hc_collapse")
def _hc_collapse(p: Preset, dtype: torch.dtype, g: torch.Generator) -> list[Case]:
    """The collapse with a ``pre`` as hc_mixes gives it (float32, in (eps, 1 + eps)), one token's saturated
    at both ends."""
    n, D, T, pdt = p.hc_mult, p.v41_hidden, p.tokens, _param_dtype(dtype)
    streams = _randn(g, T, n, D, std=2.0).to(dtype)
    pre = torch.sigmoid(_randn(g, T, n, std=2.0)) + 1e-6
    pre[0] = torch.tensor([1 + 1e-6, 1e-6] * (n // 2) + [0.5] * (n % 2))
    return [Case("hc_collapse", "pre_mix", (streams, pre.to(pdt)), out_dtypes=(dtype,))]


#: e2m1 midpoints (ties: 0.25, 1.25, 2.5 and 5 round down to the even code, 0.75, 1.75 and 3.5 up)
E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def fp4_kv_rows(g: torch.Generator, rows: int, width: int, block: int) -> torch.Tensor:
    """[rows, width] float32 KV values of very different ranges (width a multiple of ``block``, at least two
    groups a row, ``rows`` >= 4), with groups on the edges of fp4_kv_sim (which they stay on in bf16 and
    fp16): row 0 all zero and a group of row 1 below the amax floor (scale 2^-9); a group of row 1 whose scale is
    an E4M3 subnormal; groups of row 2 whose values lie on the e2m1 midpoints of an exact scale (amax = 6 *
    an E4M3 value, positive in one group, negative in the other); groups of row 3 whose amax / 6 rounds
    down to its scale (its amax saturating at 6) and up."""
    assert width % block == 0 and width >= 2 * block and rows >= 4
    x = _randn(g, rows, width) * torch.logspace(-3, 2, rows).unsqueeze(1)
    x[0] = 0.0
    edge = torch.zeros(block)
    edge[:4] = torch.tensor([0.005, -0.003, 0.0001, 0.0])  # amax 0.005 < 6 * 2^-9
    x[1, :block] = edge[_perm(g, block)]
    edge[:4] = torch.tensor([0.03, -0.02, 0.0042, 0.0011])  # scale 0.005 -> 3 * 2^-9, an E4M3 subnormal
    x[1, block : 2 * block] = edge[_perm(g, block)]
    for group, s0, sign in ((0, 1.25, 1.0), (1, 0.375, -1.0)):
        mids = torch.tensor(E2M1_MIDPOINTS) * s0
        tie = torch.cat([torch.tensor([6.0 * s0 * sign]), mids, -mids, torch.zeros(block)])[:block]
        x[2, group * block : (group + 1) * block] = tie[_perm(g, block)]
    edge = torch.zeros(block)
    edge[:5] = torch.tensor([6.3, -5.9, 5.1, 5.0, 0.3])  # amax / 6 = 1.05: scale 1, 6.3 / 1 saturates at 6
    x[3, :block] = edge[_perm(g, block)]
    edge[:5] = torch.tensor([-6.5, 3.2, 1.1, 0.6, 0.1])  # amax / 6 = 1.083: scale 1.125
    x[3, block : 2 * block] = edge[_perm(g, block)]
    return x


@_gen("fp4_kv_sim")
def _fp4_kv_sim(p: Preset, dtype: torch.dtype, g: torch.Generator) -> list[Case]:
    """V4.1's compressed KV entries (head_dim values in groups of kv_fp4_block) with the edge groups of
    :func:`fp4_kv_rows`, and a 3-D input whose last group is partial."""
    block, rows = p.kv_fp4_block, 4 * p.tokens
    x = fp4_kv_rows(g, rows, p.head_dim, block)
    ragged = (_randn(g, rows, p.head_dim + block // 2) * torch.logspace(-2, 1, rows).unsqueeze(1)).view(
        rows // 2, 2, -1)
    ragged[0, 0, -block // 2 :] = 0.0  # the partial group all zero
    return [
        Case("fp4_kv_sim", "compressed_kv", (x.to(dtype), block), out_dtypes=(dtype,)),
        Case("fp4_kv_sim", "partial_last_group", (ragged.to(dtype), block), out_dtypes=(dtype,)),
    ]


@_check("fp4_kv_sim")
def _check_fp4_kv_sim(case: Case, actual: Any, expected: Any, ref_args: tuple, dtype: torch.dtype, label: str):
    """Exact: the scales and the roundings of x.dtype values come out the same in any precision, and every
    result (an e2m1 value times an E4M3 scale) is exact in bf16 and fp16."""
    _check_dtype(case, 0, actual, label)
    assert_close(actual, expected.to(actual.dtype), dtype=dtype, name=label, exact=True)


@_gen("moe_experts_quant_act")
def _moe_experts_quant_act(p: Preset, dtype: torch.dtype, g: torch.Generator) -> list[Case]:
    """moe_experts_act_quant's case at V4.1's widths with its activation groups of ``act_block`` channels.
    Power-of-two scales make the group size matter only where a value falls into E4M3's subnormals, so x
    has a massive channel in every 128 and the channels past the first ``act_block`` of each 128 are quiet
    (1e-3; the weights scaled inversely, so every channel weighs in about equally): per ``act_block`` they
    keep E4M3's precision, per 128 they would be rounded to a few subnormal steps. Hot gate rows beyond
    the swiglu limit, -1 ids with nonzero weights."""
    E, k, T, D, inter = p.local_experts, p.top_k, 2 * p.tokens, p.v41_hidden, p.v41_moe_inter
    quiet = torch.arange(D) % 128 >= p.act_block
    x = _randn(g, T, D)
    x[:, 3::128] *= 30.0
    x[:, quiet] *= 1e-3
    w13 = _randn(g, E, 2 * inter, D, std=D**-0.5)
    w13[..., quiet] *= 1e3
    w13[..., 3::128] /= 30.0  # every channel weighs in about equally
    w13[:, _perm(g, inter)[: max(2, inter // 32)]] *= 6.0
    w2 = _randn(g, E, D, inter, std=inter**-0.5)
    ids = torch.full((T, k), -1, dtype=torch.long)
    for t in range(T):
        n_local = 0 if t == 0 else min(E, k) if t == 1 else int(_randint(g, 0, min(E, k) + 1, 1))
        ids[t, _perm(g, k)[:n_local]] = _perm(g, E)[:n_local]
    weights = (0.2 + _rand(g, T, k)).to(_param_dtype(dtype))
    args = (x.to(dtype), w13.to(dtype), w2.to(dtype), ids, weights, p.swiglu_limit, p.act_block)
    return [Case("moe_experts_quant_act", "ep_local", args, out_dtypes=(dtype,))]


@_check("moe_experts_quant_act")
def _check_moe_experts_quant_act(
    case: Case, actual: Any, expected: Any, ref_args: tuple, dtype: torch.dtype, label: str
):
    """Re-quantisation flips of the intermediate, as for moe_experts_act_quant, here with 32-channel groups
    and fewer tokens: one flip moves every output of its token, so the outputs of one token in eight may
    lie outside the tolerance, and the cosine may drop to 0.998 (measured over seeds 0-7, tiny preset:
    worst fraction 9% (fp16, FP4 experts), worst cosine 0.99899 (bf16); seed 0 at V4.1's widths, bf16:
    0.35%, 0.99988). Quantised per 128 instead, the outputs are off by far (cosine 0.996 or less)."""
    _check_with_requant_flips(case, actual, expected, dtype, label, max_fraction=0.125, min_cosine=0.998)


# --- DeepSeek-V4.1's FP8 Engram table, Engram gate, packed KV entries and FP4 experts -----------------


@_gen("embedding_fp8")
def _embedding_fp8(p: Preset, dtype: torch.dtype, g: torch.Generator) -> list[Case]:
    """Engram's table rows: E4M3 values scaled per group of 32 by float32 or E8M0 scales; the rows never
    looked up are NaN (their scales too), ids at both ends and repeated. The output is float32 whatever
    the model dtype, computed from the same bytes: compared exactly."""
    from deepinfer_core.quant.fp4 import e8m0_from_float

    V, D, group = p.vocab, p.v41_hidden, 32
    ids = torch.cat([torch.tensor([0, V - 1]), _randint(g, 0, V, p.tokens)])
    ids = torch.cat([ids, ids[2:3]])
    rows = ids.unique()
    weight = torch.full((V, D), float("nan")).to(torch.float8_e4m3fn)
    weight[rows] = (_randn(g, rows.numel(), D) * 100).to(torch.float8_e4m3fn)
    scale = torch.full((V, D // group), float("nan"))
    scale[rows] = _rand(g, rows.numel(), D // group) * 0.01 + 1e-4
    pow2 = torch.full((V, D // group), 1.0)
    pow2[rows] = torch.exp2(_randint(g, -12, 2, rows.numel(), D // group).float())
    out = (torch.float32,)
    return [
        Case("embedding_fp8", "f32_scales", (ids, weight, scale), out_dtypes=out, upcast_reference=False),
        Case("embedding_fp8", "e8m0_scales", (ids, weight, e8m0_from_float(pow2)), out_dtypes=out,
             upcast_reference=False),
    ]


@_gen("engram_gate")
def _engram_gate(p: Preset, dtype: torch.dtype, g: torch.Generator) -> list[Case]:
    """Engram's gate at V4.1's width over hc_mult streams: keys aligned with some streams and opposed to
    others (gates near 0 and 1), one token's key all zero (dot 0: the 1e-6 floor under the square root) and
    V4.1's norm eps 1e-20."""
    n, D, T, pdt = p.hc_mult, p.v41_hidden, p.tokens, _param_dtype(dtype)
    streams = _randn(g, T, n, D, std=2.0)
    key = 0.5 * streams * torch.tensor([1.0, -1.0] * (n // 2) + [1.0] * (n % 2)).view(1, n, 1) + _randn(g, T, n, D)
    key[0] = 0.0
    value = _randn(g, T, D)
    q_weight, k_weight = (1 + _randn(g, n, D, std=0.1)).to(pdt), (1 + _randn(g, n, D, std=0.1)).to(pdt)
    args = (streams.to(dtype), key.to(dtype), value.to(dtype), q_weight, k_weight, 1e-20)
    return [Case("engram_gate", "gates", args, out_dtypes=(dtype,))]


@_gen("engram_hash")
def _engram_hash(p: Preset, dtype: torch.dtype, g: torch.Generator) -> list[Case]:
    """DeepSeek-V4.1's n-gram hash over two Engram layers, 4-grams, 2 heads: a token map that merges ids,
    histories cut by the sequence start (-1) and by dead tokens (-2) at every shift, ids at both ends of the
    map. Integer arithmetic: compared exactly."""
    from deepinfer_core.models.deepseek_v41.engram_hash import EngramHashLayout

    vocab = p.vocab
    token_map = _randint(g, 0, vocab // 3, vocab)
    token_map[: vocab // 3] = torch.arange(vocab // 3)  # every compressed id is used
    layout = EngramHashLayout.build(layer_ids=(1, 5), max_ngram_size=4, n_heads=2, vocab_size=4 * vocab,
                                    token_map=token_map.tolist(), pad_token_id=2)
    history = _randint(g, 0, vocab, 4 * p.tokens, 4)
    history[0] = torch.tensor([0, vocab - 1, 2, 1])
    for shift in range(1, 4):  # a sequence start, then a dead token, at each shift
        history[shift, shift:] = -1
        history[3 + shift, shift] = -2
    args = (history, torch.tensor(layout.token_map), torch.tensor(layout.multipliers), torch.tensor(layout.primes),
            torch.tensor(layout.offsets), layout.pad_id)
    return [Case("engram_hash", "ngrams", args, out_dtypes=(torch.int64,), upcast_reference=False)]


@_gen("engram_lookup")
def _engram_lookup(p: Preset, dtype: torch.dtype, g: torch.Generator) -> list[Case]:
    """Engram's rows of a whole table and of a shard of one (ids outside it give zero rows), E8M0 and
    float32 scales; the rows never looked up are NaN. Float32 out of the same bytes: compared exactly."""
    from deepinfer_core.quant.fp4 import e8m0_from_float

    V, D, group, cols = p.vocab, 64, 32, 6
    ids = _randint(g, 0, V, p.tokens, cols)
    ids[0, :2] = torch.tensor([0, V - 1])
    rows = ids.unique()
    weight = torch.full((V, D), float("nan")).to(torch.float8_e4m3fn)
    weight[rows] = (_randn(g, rows.numel(), D) * 100).to(torch.float8_e4m3fn)
    pow2 = torch.full((V, D // group), float("nan"))
    pow2[rows] = torch.exp2(_randint(g, -12, 2, rows.numel(), D // group).float())
    scale = e8m0_from_float(pow2.nan_to_num(1.0))
    start, stop = V // 3, 2 * V // 3  # a shard: the rows outside are another rank's (NaN here: never read)
    out = (torch.float32,)
    return [
        Case("engram_lookup", "table", (ids, weight, scale, 0), out_dtypes=out, upcast_reference=False),
        Case("engram_lookup", "f32_scales", (ids, weight, pow2, 0), out_dtypes=out, upcast_reference=False),
        Case("engram_lookup", "shard", (ids, weight[start:stop].clone(), scale[start:stop].clone(), start),
             out_dtypes=out, upcast_reference=False),
    ]


def _kv_fp4_case_rows(p: Preset, g: torch.Generator, kind: str) -> torch.Tensor:
    """Rows of one packed KV kind at its width (window and compressed: head_dim; index: index_dim, at least
    one group of 32): the compressed ones with fp4_kv_rows' edge groups, the others of very different
    ranges with an all-zero row."""
    rows = 4 * p.tokens
    if kind == "compressed":
        return fp4_kv_rows(g, rows, p.head_dim, 16)
    dim = p.head_dim if kind == "window" else -(-p.index_dim // 32) * 32
    x = _randn(g, rows, dim) * torch.logspace(-4, 3, rows).unsqueeze(1)
    x[0] = 0.0
    return x


@_gen("kv_fp4_pack")
def _kv_fp4_pack(p: Preset, dtype: torch.dtype, g: torch.Generator) -> list[Case]:
    """Every kind's entries; the bytes compare exactly (quantised from the same dtype values everywhere:
    the reference is not upcast)."""
    return [Case("kv_fp4_pack", kind, (_kv_fp4_case_rows(p, g, kind).to(dtype), kind), out_dtypes=(torch.uint8,),
                 upcast_reference=False) for kind in ("window", "compressed", "index")]


@_check("kv_fp4_pack")
def _check_kv_fp4_pack(case: Case, actual: Any, expected: Any, ref_args: tuple, dtype: torch.dtype, label: str):
    _check_kv_fp8_pack(case, actual, expected, ref_args, dtype, label)


@_gen("kv_fp4_unpack")
def _kv_fp4_unpack(p: Preset, dtype: torch.dtype, g: torch.Generator) -> list[Case]:
    """Every kind's entries packed from values in the candidate dtype, decoded to float32: exactly."""
    from deepinfer_core.quant.kv_fp4 import pack_kv_fp4

    cases = []
    for kind in ("window", "compressed", "index"):
        x = _kv_fp4_case_rows(p, g, kind).to(dtype)
        cases.append(Case("kv_fp4_unpack", kind, (pack_kv_fp4(x, kind), kind, x.shape[-1]),
                          out_dtypes=(torch.float32,), upcast_reference=False))
    return cases


@_check("kv_fp4_unpack")
def _check_kv_fp4_unpack(case: Case, actual: Any, expected: Any, ref_args: tuple, dtype: torch.dtype, label: str):
    _check_dtype(case, 0, actual, label)
    assert_close(actual, expected, name=label, exact=True)


@_gen("moe_experts_fp4_quant_act")
def _moe_experts_fp4_quant_act(p: Preset, dtype: torch.dtype, g: torch.Generator) -> list[Case]:
    """moe_experts_quant_act's case (massive and quiet channels, hot gate rows, -1 ids) with the experts
    packed in FP4 (the intermediate width rounded up to FP4's groups of 32)."""
    from deepinfer_core.quant.fp4 import quantize_fp4_block

    E, k, T, D, inter = p.local_experts, p.top_k, 2 * p.tokens, p.v41_hidden, -(-p.v41_moe_inter // 32) * 32
    quiet = torch.arange(D) % 128 >= p.act_block
    x = _randn(g, T, D)
    x[:, 3::128] *= 30.0
    x[:, quiet] *= 1e-3
    w13 = _randn(g, E, 2 * inter, D, std=D**-0.5)
    w13[..., quiet] *= 1e3
    w13[..., 3::128] /= 30.0
    w13[:, _perm(g, inter)[: max(2, inter // 32)]] *= 6.0
    w13, s13 = quantize_fp4_block(w13)
    w2, s2 = quantize_fp4_block(_randn(g, E, D, inter, std=inter**-0.5))
    ids = torch.full((T, k), -1, dtype=torch.long)
    for t in range(T):
        n_local = 0 if t == 0 else min(E, k) if t == 1 else int(_randint(g, 0, min(E, k) + 1, 1))
        ids[t, _perm(g, k)[:n_local]] = _perm(g, E)[:n_local]
    weights = (0.2 + _rand(g, T, k)).to(_param_dtype(dtype))
    args = (x.to(dtype), w13, s13, w2, s2, ids, weights, p.swiglu_limit, p.act_block)
    return [Case("moe_experts_fp4_quant_act", "w4a8_v41", args, out_dtypes=(dtype,))]


@_check("moe_experts_fp4_quant_act")
def _check_moe_experts_fp4_quant_act(
    case: Case, actual: Any, expected: Any, ref_args: tuple, dtype: torch.dtype, label: str
):
    """As moe_experts_quant_act."""
    _check_moe_experts_quant_act(case, actual, expected, ref_args, dtype, label)

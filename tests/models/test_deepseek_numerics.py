"""``numerics="deepseek"`` against a CPU port of the arithmetic of DeepSeek's ``inference/model.py``.

The oracle below is written here from the published model's description (not imported): one prefill of
a whole sequence (model.py's ``start_pos == 0`` path), batch 1, with plain-torch stand-ins for its
kernels: ``act_quant`` (E4M3 with power-of-two scales), ``fp4_act_quant`` (e2m1, power-of-two scales),
``fp8_gemm`` / ``fp4_gemm`` (the dequantised operands multiplied), ``sparse_attn`` (a softmax with a
sink over gathered rows), ``hc_split_sinkhorn`` and ``hadamard_transform`` (a Sylvester matrix).
``quant=False`` switches its quantisation steps off: that is transformers' arithmetic, which the
engine's ``numerics="transformers"`` must then equal.

The checkpoint is a tiny one in the published layout (FP8 ue8m0 linears, FP4 experts, hash routing,
CSA and HCA layers, an MTP block), at widths that are whole quantisation groups (the kernels assert them).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from model_fixtures import engine_logits, no_kernel_packs, prompt
from safetensors.torch import load_file

from deepinfer_core.config import ModelConfig
from deepinfer_core.models import load_model
from deepinfer_core.models.deepseek_v4.model import RotaryTables
from deepinfer_core.testing.model_runner import SimpleRunner
from deepinfer_core.testing.published_checkpoint import build_published_checkpoint, dequantised

#: the tiny layout at widths of whole groups: 128 for activations, 64 for KV, 32 for FP4
ORACLE_CONFIG = dict(hidden_size=128, num_attention_heads=2, head_dim=128, partial_rotary_factor=0.5,
                     q_lora_rank=128, o_groups=2, o_lora_rank=64, moe_intermediate_size=128, n_routed_experts=4,
                     index_n_heads=2, index_head_dim=128, index_topk=3)
SEQ = 40


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return build_published_checkpoint(tmp_path_factory.mktemp("oracle") / "tiny", "tiny", seed=3, **ORACLE_CONFIG)


# --- the kernels' stand-ins ------------------------------------------------------------------------

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def pow2_ceil(v: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.ceil(torch.log2(v.double())))


def act_quant(x: torch.Tensor, block: int) -> torch.Tensor:
    """kernel.act_quant(x, block, "ue8m0", inplace=True): E4M3 per ``block`` values, power-of-two scales."""
    g = x.double().unflatten(-1, (-1, block))
    s = pow2_ceil(g.abs().amax(-1, keepdim=True).clamp(min=1e-4) / 448.0)
    q = (g / s).clamp(-448, 448).to(torch.float8_e4m3fn).double()
    return (q * s).flatten(-2).to(x.dtype)


def fp4_round(v: torch.Tensor) -> torch.Tensor:
    """The e2m1 value nearest to each |v| <= 6, ties to the even code, the sign kept."""
    dist = (v.abs().clamp(max=6.0).unsqueeze(-1) - E2M1).abs()
    best = dist == dist.min(-1, keepdim=True).values
    even = best & (torch.arange(8) % 2 == 0)
    pick = torch.where(even.any(-1, keepdim=True), even, best).double().argmax(-1)
    return E2M1[pick] * torch.sign(v)


def fp4_act_quant(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """kernel.fp4_act_quant(x, block, inplace=True)."""
    g = x.double().unflatten(-1, (-1, block))
    s = pow2_ceil(g.abs().amax(-1, keepdim=True).clamp(min=6 * 2.0**-126) / 6.0)
    return (fp4_round(g / s) * s).flatten(-2).to(x.dtype)


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1]
    idx = torch.arange(n)
    bits = torch.tensor([bin(v).count("1") for v in (idx.unsqueeze(1) & idx).flatten().tolist()]).view(n, n)
    h = (1 - 2 * (bits % 2)).to(x.dtype)
    return x @ h * n**-0.5


# --- the port ---------------------------------------------------------------------------------------


class Oracle:
    """model.py's Transformer.forward for one sequence from position 0, every position's logits."""

    def __init__(self, cfg: ModelConfig, params: dict[str, torch.Tensor], dtype: torch.dtype, quant: bool,
                 rope_tables=None):
        """``rope_tables(kind, positions) -> (cos, sin)``: rotate with these in ``dtype`` instead of
        model.py's complex64 rotation (to see what else differs once the RoPE rounding is the same)."""
        self.c, self.dtype, self.quant, self.rope_tables = cfg, dtype, quant, rope_tables
        self.p = {k: (v if v.dtype in (torch.int32, torch.int64) else v.to(dtype)) for k, v in params.items()}
        self.rd = int(cfg.head_dim * cfg.partial_rotary_factor)
        self.eps = cfg.rms_norm_eps

    # pieces
    def lin(self, x, name, fp8: bool = False):
        """model.linear: a quantised weight quantises its input first (fp8_gemm / fp4_gemm)."""
        if fp8 and self.quant:
            x = act_quant(x, 128)
        return x @ self.p[name].T

    def norm(self, x, name=None):
        y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps)
        return y if name is None else y * self.p[name]

    def freqs(self, layer_ratio: int, positions: torch.Tensor) -> torch.Tensor:
        """precompute_freqs_cis: theta 10000 without YaRN on sliding layers; the compress theta with YaRN;
        in float32 as model.py computes it (its rotations are complex64 whatever the model's dtype)."""
        if self.rope_tables is not None:
            return torch.complex(*self.rope_tables("compress" if layer_ratio else "main", positions, torch.float64))
        c, dim = self.c, self.rd
        rope = c.rope_parameters["compress" if layer_ratio else "main"]
        base = rope["rope_theta"]
        freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        if layer_ratio:
            factor, orig = rope["factor"], rope["original_max_position_embeddings"]
            fast, slow = rope.get("beta_fast", 32), rope.get("beta_slow", 1)

            def corr(rot):
                return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

            low, high = max(math.floor(corr(fast)), 0), min(math.ceil(corr(slow)), dim - 1)
            high = high + 0.001 if low == high else high
            ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
            smooth = 1 - ramp
            freqs = freqs / factor * (1 - smooth) + freqs * smooth
        angles = torch.outer(positions, freqs)
        return torch.polar(torch.ones_like(angles), angles)

    def rope(self, x, freqs, inverse=False):
        """apply_rotary_emb on the trailing rd values, (2i, 2i+1) pairs as complex numbers."""
        head, tail = x[..., : -self.rd], x[..., -self.rd :]
        z = tail.float() if self.rope_tables is None else tail.double()
        z = torch.view_as_complex(z.unflatten(-1, (-1, 2)).contiguous())
        f = freqs.conj() if inverse else freqs
        f = f.view(f.shape[0], *([1] * (z.dim() - 2)), f.shape[-1])
        return torch.cat([head, torch.view_as_real(z * f).flatten(-2).to(x.dtype)], dim=-1)

    def hc_pre(self, x, prefix):
        c, n = self.c, self.c.hc_mult
        flat = x.flatten(1)
        mixes = (flat @ self.p[prefix + "fn"].T) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.eps)
        s, b = self.p[prefix + "scale"], self.p[prefix + "base"]
        pre = torch.sigmoid(mixes[:, :n] * s[0] + b[:n]) + c.hc_eps
        post = 2 * torch.sigmoid(mixes[:, n : 2 * n] * s[1] + b[n : 2 * n])
        comb = (mixes[:, 2 * n :] * s[2] + b[2 * n :]).view(-1, n, n).softmax(-1) + c.hc_eps
        comb = comb / (comb.sum(-2, keepdim=True) + c.hc_eps)
        for _ in range(c.hc_sinkhorn_iters - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + c.hc_eps)
            comb = comb / (comb.sum(-2, keepdim=True) + c.hc_eps)
        return (pre.unsqueeze(-1) * x).sum(1), post, comb

    @staticmethod
    def hc_post(x, residual, post, comb):
        return post.unsqueeze(-1) * x.unsqueeze(1) + (comb.unsqueeze(-1) * residual.unsqueeze(2)).sum(1)

    def compressor(self, x, prefix, ratio, d, rotate, freqs_all):
        """Compressor.forward at start_pos 0: gated pooling of every closed window (overlapping at ratio 4)."""
        s = x.shape[0]
        cutoff = s - s % ratio
        kv = self.lin(x, prefix + "wkv.weight")[:cutoff].unflatten(0, (-1, ratio))
        score = self.lin(x, prefix + "wgate.weight")[:cutoff].unflatten(0, (-1, ratio)) + self.p[prefix + "ape"]
        if ratio == 4:  # overlap: the previous window's first half of the dims, this window's second half
            def overlap(t, fill):
                out = t.new_full((t.shape[0], 2 * ratio, d), fill)
                out[:, ratio:] = t[:, :, d:]
                out[1:, :ratio] = t[:-1, :, :d]
                return out

            kv, score = overlap(kv, 0.0), overlap(score, float("-inf"))
        kv = (kv * score.softmax(dim=1)).sum(dim=1)
        kv = self.rope(self.norm(kv, prefix + "norm.weight"), freqs_all[:cutoff:ratio])
        if not self.quant:
            return kv
        if rotate:
            return fp4_act_quant(hadamard_transform(kv))
        return torch.cat([act_quant(kv[..., : -self.rd], 64), kv[..., -self.rd :]], dim=-1)

    def attention(self, x, layer):
        c, p = self.c, f"layers.{layer}.attn."
        s, h, hd, rd = x.shape[0], c.num_attention_heads, c.head_dim, self.rd
        ratio = c.compress_rate(layer)
        freqs = self.freqs(ratio, torch.arange(s))
        qr = self.norm(self.lin(x, p + "wq_a.weight", True), p + "q_norm.weight")
        q = self.rope(self.norm(self.lin(qr, p + "wq_b.weight", True).view(s, h, hd)), freqs)
        kv = self.rope(self.norm(self.lin(x, p + "wkv.weight", True), p + "kv_norm.weight"), freqs)
        if self.quant:
            kv = torch.cat([act_quant(kv[..., :-rd], 64), kv[..., -rd:]], dim=-1)
        t = torch.arange(s).unsqueeze(1)
        win = (t - c.sliding_window + 1).clamp(min=0) + torch.arange(min(s, c.sliding_window))
        idx = torch.where(win > t, -1, win)
        keys = kv
        if ratio:
            comp = self.compressor(x, p + "compressor.", ratio, hd, False, freqs)
            n = comp.shape[0]
            visible = torch.arange(n).unsqueeze(0) < (t + 1) // ratio  # [s, n]
            if c.is_csa(layer):
                chosen = self.indexer(x, qr, layer, freqs, visible)
            else:
                chosen = torch.where(visible, torch.arange(n), -1)
            idx = torch.cat([idx, torch.where(chosen >= 0, chosen + s, -1)], dim=1)
            keys = torch.cat([kv, comp])
        gathered = keys[idx.clamp(min=0)]  # [s, K, hd]
        logits = torch.einsum("shd,skd->shk", q, gathered) * hd**-0.5
        logits = logits.masked_fill((idx < 0).unsqueeze(1), float("-inf"))
        sink = self.p[p + "attn_sink"].view(1, h, 1).expand(s, h, 1)
        probs = torch.cat([logits, sink], dim=-1).softmax(-1)[..., :-1]
        o = self.rope(torch.einsum("shk,skd->shd", probs, gathered), freqs, inverse=True)
        g = c.o_groups
        o = torch.einsum("sgd,grd->sgr", o.reshape(s, g, -1), self.p[p + "wo_a.weight"].view(g, c.o_lora_rank, -1))
        return self.lin(o.flatten(1), p + "wo_b.weight", True)

    def indexer(self, x, qr, layer, freqs, visible):
        c, p = self.c, f"layers.{layer}.attn.indexer."
        s, ih, idim = x.shape[0], c.index_n_heads, c.index_head_dim
        q = self.rope(self.lin(qr, p + "wq_b.weight", True).view(s, ih, idim), freqs)
        if self.quant:
            q = fp4_act_quant(hadamard_transform(q))
        keys = self.compressor(x, p + "compressor.", 4, idim, True, freqs)
        weights = self.lin(x, p + "weights_proj.weight") * (idim**-0.5 * ih**-0.5)
        score = (torch.einsum("shd,td->sht", q, keys).relu() * weights.unsqueeze(-1)).sum(1)
        score = score.masked_fill(~visible, float("-inf"))
        # model.py's topk leaves ties open (with relu'd scores many candidates score exactly 0): take the
        # catalogue's rule, the earlier candidate first
        top = score.sort(dim=-1, descending=True, stable=True).indices[:, : min(c.index_topk, keys.shape[0])]
        return torch.where(visible.gather(1, top), top, -1)

    def moe(self, x, layer, ids):
        c, p = self.c, f"layers.{layer}.ffn."
        scores = F.softplus(self.lin(x, p + "gate.weight")).sqrt()
        if c.mlp_layer_types[layer] == "hash_moe":
            chosen = self.p[p + "gate.tid2eid"][ids].long()
        else:
            chosen = (scores + self.p[p + "gate.bias"]).topk(c.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, chosen)
        weights = weights / weights.sum(-1, keepdim=True) * c.routed_scaling_factor
        y = torch.zeros_like(x)
        for e in range(c.n_routed_experts):
            rows, slot = torch.where(chosen == e)
            if rows.numel():
                y[rows] += self.expert(x[rows], f"{p}experts.{e}.", weights[rows, slot].unsqueeze(-1))
        return y + self.expert(x, p + "shared_experts.", None)

    def expert(self, x, p, weights):
        """Expert.forward: both kinds of expert are quantised linears (FP4 routed, FP8 shared)."""
        lim = self.c.swiglu_limit
        gate = self.lin(x, p + "w1.weight", True).clamp(max=lim)
        up = self.lin(x, p + "w3.weight", True).clamp(-lim, lim)
        h = F.silu(gate) * up
        if weights is not None:
            h = weights * h
        return self.lin(h, p + "w2.weight", True)

    def forward(self, ids: list[int]) -> torch.Tensor:
        c, t = self.c, torch.tensor(ids)
        h = self.p["embed.weight"][t].unsqueeze(1).repeat(1, c.hc_mult, 1)
        for layer in range(c.num_hidden_layers):
            x, post, comb = self.hc_pre(h, f"layers.{layer}.hc_attn_")
            h = self.hc_post(self.attention(self.norm(x, f"layers.{layer}.attn_norm.weight"), layer), h, post, comb)
            x, post, comb = self.hc_pre(h, f"layers.{layer}.hc_ffn_")
            h = self.hc_post(self.moe(self.norm(x, f"layers.{layer}.ffn_norm.weight"), layer, t), h, post, comb)
        flat = h.flatten(1)
        mixes = (flat @ self.p["hc_head_fn"].T) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.eps)
        pre = torch.sigmoid(mixes * self.p["hc_head_scale"] + self.p["hc_head_base"]) + c.hc_eps
        x = self.norm((pre.unsqueeze(-1) * h).sum(1), "norm.weight")
        return x @ self.p["head.weight"].T


def oracle_logits(path: Path, ids: list[int], dtype: torch.dtype, quant: bool, engine_rope: bool = False
                  ) -> torch.Tensor:
    cfg = ModelConfig.from_pretrained(path)
    params = dequantised(load_file(str(path / "model.safetensors")))
    tables = RotaryTables(cfg, "cpu") if engine_rope else None
    return Oracle(cfg, params, dtype, quant, tables).forward(ids)


def engine(path: Path, numerics: str, dtype: torch.dtype):
    with no_kernel_packs():
        return load_model(path, dtype=dtype, numerics=numerics)


def rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per position: max |a - b| over the vocab, over the logits' scale."""
    a, b = a.double(), b.double()
    return (a - b).abs().max(-1).values / b.abs().max()


def assert_equal_to_the_port(ours: torch.Tensor, theirs: torch.Tensor, dtype: torch.dtype) -> None:
    """float64: every position to 1e-12. float32: the engine and the port sum in different orders, so an
    activation a last bit apart can sit on an E4M3 boundary and round the other way (measured: 1 position
    of 40, moved by 1e-2 of the logits' scale, depending on the random weights); every other position to
    1e-6, none beyond 5e-2, the greedy tokens all equal."""
    diff = rel(ours, theirs)
    if dtype == torch.float64:
        assert diff.max() <= 1e-12, diff
        return
    assert (diff > 1e-6).sum() <= 1 and diff.max() <= 0.05, diff
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


IDS = prompt(SEQ, 384, seed=5)


def test_the_oracle_exercises_every_part(checkpoint):
    cfg = ModelConfig.from_pretrained(checkpoint)
    assert [cfg.compress_rate(i) for i in range(4)] == [0, 4, 8, 4] and cfg.mlp_layer_types[0] == "hash_moe"
    assert SEQ > 3 * cfg.sliding_window and SEQ // 4 > cfg.index_topk  # windows slide, the indexer chooses
    tensors = load_file(str(checkpoint / "model.safetensors"))
    assert tensors["layers.1.ffn.experts.0.w1.weight"].dtype == torch.int8
    assert tensors["layers.1.attn.wq_a.scale"].dtype == torch.float8_e8m0fnu and "mtp.0.e_proj.scale" in tensors


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_deepseek_numerics_equal_the_model_py_port(checkpoint, dtype):
    """Every position's logits, against model.py's arithmetic as it is: its RoPE rotates in complex64
    whatever the dtype, the engine with float32 cos/sin in the model's dtype, so values differ in the
    last float32 bits (transformers numerics below: 8e-8). Where such a value sits on a quantisation
    boundary (measured: 1 position of 40, moved by 1e-2 of the logits' scale) it rounds the other way;
    the greedy tokens are all equal."""
    ours = engine_logits(engine(checkpoint, "deepseek", dtype), IDS)
    theirs = oracle_logits(checkpoint, IDS, dtype, quant=True)
    diff = rel(ours, theirs)
    close = 1e-6 if dtype == torch.float64 else 1e-5
    assert (diff <= close).float().mean() >= 0.9 and diff.median() <= close / 10, diff
    assert diff.max() <= 0.05, diff
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_deepseek_numerics_equal_the_port_exactly_with_the_same_rope_rounding(checkpoint):
    """The port rotating with the engine's cos/sin: nothing else differs, every position to 1e-12."""
    ours = engine_logits(engine(checkpoint, "deepseek", torch.float64), IDS)
    theirs = oracle_logits(checkpoint, IDS, torch.float64, quant=True, engine_rope=True)
    assert rel(ours, theirs).max() <= 1e-12


def test_transformers_numerics_equal_the_port_without_its_quantisation_steps(checkpoint):
    """No quantisation step: only the RoPE rounding differs (model.py's complex64 rotation)."""
    ours = engine_logits(engine(checkpoint, "transformers", torch.float64), IDS)
    assert rel(ours, oracle_logits(checkpoint, IDS, torch.float64, quant=False)).max() <= 1e-6
    assert rel(ours, oracle_logits(checkpoint, IDS, torch.float64, quant=False, engine_rope=True)).max() <= 1e-12


def test_the_two_numerics_differ_by_the_quantisation_steps_only(checkpoint, record_property):
    """The figure the issue asks for: how far the quantisation steps move the tiny model's logits."""
    ds = engine_logits(engine(checkpoint, "deepseek", torch.float64), IDS)
    tf = engine_logits(engine(checkpoint, "transformers", torch.float64), IDS)
    diff = rel(ds, tf)
    agree = float((ds.argmax(-1) == tf.argmax(-1)).float().mean())
    record_property("deepseek_vs_transformers", {"max_rel": float(diff.max()), "median_rel": float(diff.median()),
                                                 "top1_agreement": agree})
    print(f"deepseek vs transformers numerics: max rel {float(diff.max()):.3g}, median {float(diff.median()):.3g}, "
          f"top-1 agreement {agree:.3f} over {len(IDS)} positions")
    assert diff.max() > 1e-3  # the steps are there


def test_deepseek_numerics_decode_equals_prefill(checkpoint):
    """The quantisation steps sit where the cache is written: one token at a time gives the same logits."""
    model = engine(checkpoint, "deepseek", torch.float64)
    whole = engine_logits(model, IDS)
    stepped = engine_logits(model, IDS, chunk=1)
    assert rel(stepped, whole).max() <= 1e-9


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_deepseek_numerics_with_fp8_kept_weights_equal_the_port(checkpoint, dtype):
    """quantization="fp8": the published E4M3 weights stay E4M3 and go through linear_fp8_ue8m0, which
    quantises activations as model.py's act_quant does; the same logits as with dequantised weights
    (bit for bit: both multiply the same values in the same accumulation dtype) and so the port's."""
    with no_kernel_packs():
        model = load_model(checkpoint, dtype=dtype, quantization="fp8", numerics="deepseek")
    attn = model.weights.layers[1].attn
    assert attn.wq_a.is_fp8 and not attn.compressor.wkv.is_fp8 and model.weights.layers[1].moe.experts.is_fp4
    assert "linear_fp8_ue8m0" in model.ops_in_use() and "linear_fp8" not in model.ops_in_use()
    ours = engine_logits(model, IDS)
    assert torch.equal(ours, engine_logits(engine(checkpoint, "deepseek", dtype), IDS))
    theirs = oracle_logits(checkpoint, IDS, dtype, quant=True, engine_rope=True)
    assert_equal_to_the_port(ours, theirs, dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_the_fp8_kv_entries_hold_what_the_port_caches(checkpoint, dtype):
    """Under deepseek numerics the cache stores DeepSeek's FP8 entries (uint8 rows: E4M3 values with
    ue8m0 scales per 64, RoPE values in the model's dtype), where the port keeps act_quant'ed values:
    with the same RoPE rounding every position's logits agree to 1e-12 (float64; measured 5e-16), and in
    float32 as :func:`assert_equal_to_the_port` says, the greedy tokens all equal."""
    model = engine(checkpoint, "deepseek", dtype)
    runner = SimpleRunner(model, 1, SEQ, block_size=16)
    assert runner.cache.kv_spec.layout == "fp8_ds"
    assert {p.dtype for p in [*runner.cache.window_kv, *runner.cache.comp_kv.values()]} == {torch.uint8}
    ours = runner.step({0: IDS}, all_logits=True)[0]
    theirs = oracle_logits(checkpoint, IDS, dtype, quant=True, engine_rope=True)
    assert_equal_to_the_port(ours, theirs, dtype)

"""The second, independent oracle: DeepSeek's own ``inference/model.py``, imported from
``../shared/reference/deepseek-v4-flash/inference/model.py`` (beside this repository), run on the
CPU in one process with torch stand-ins, written here, for the six functions of its ``kernel.py``
(``act_quant``, ``fp4_act_quant``, ``fp8_gemm``, ``fp4_gemm``, ``sparse_attn``, ``hc_split_sinkhorn``) and
for ``fast_hadamard_transform.hadamard_transform``, on the tiny published-layout checkpoint (FP8 ue8m0
linears, FP4 experts, a hash layer, CSA and HCA layers, MTP weights present).

model.py runs in float32 (its default dtype; the two projections it declares bf16, ``wo_a`` and the
indexer's ``weights_proj``, hold their bf16 values in float32; its ``rotate_activation`` asserts bf16 and
is replaced by the same rotation without the assertion); its head returns the last position's logits,
so the comparison is a prefill and then greedy decoding one token at a time (its cached decode path).
The engine runs ``numerics="deepseek"`` in float32 with its FP8 KV entries.

Measured, not asserted: both in bf16 (model.py's own dtype) the greedy tokens agree on 8 of 13 steps of
this random tiny model, logits' cosine >= 0.964: each rounds at its own points, which a random model's
flat logits do not absorb.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from model_fixtures import no_kernel_packs, prompt
from safetensors.torch import load_file
from test_deepseek_numerics import ORACLE_CONFIG

from deepinfer_core.config import ModelConfig
from deepinfer_core.models import load_model
from deepinfer_core.quant.fp4 import hadamard, unpack_fp4
from deepinfer_core.quant.fp8 import dequantize_fp8_block
from deepinfer_core.testing.model_runner import SimpleRunner
from deepinfer_core.testing.published_checkpoint import build_published_checkpoint

MODEL_PY = Path(__file__).resolve().parents[3] / "shared/reference/deepseek-v4-flash/inference/model.py"
STEPS = 12

pytestmark = pytest.mark.skipif(not MODEL_PY.exists(), reason=f"{MODEL_PY} not present")


# --- kernel.py in torch --------------------------------------------------------------------------


def _pow2_ceil(v: torch.Tensor) -> torch.Tensor:
    m, e = torch.frexp(v)
    return torch.ldexp(torch.ones_like(v), e - (m == 0.5).to(e.dtype))


def act_quant(x, block_size=128, scale_fmt=None, scale_dtype=torch.float32, inplace=False):
    g = x.float().unflatten(-1, (-1, block_size))
    amax = g.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    s = amax * (1 / 448.0)
    if scale_fmt is not None:
        s = _pow2_ceil(s)
    q = (g / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    if inplace:
        x.copy_((q.float() * s).flatten(-2))
        return x
    return q.flatten(-2), s.squeeze(-1).to(scale_dtype)


_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _e2m1_round(v: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 value, ties to the even code, the sign kept."""
    a = v.abs().clamp(max=6.0)
    code = torch.zeros(v.shape, dtype=torch.long)
    for mid, up in ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True),
                    (5.0, False)):
        code += (a >= mid if up else a > mid).long()
    return _E2M1[code] * torch.where(v < 0, -1.0, 1.0)


def fp4_act_quant(x, block_size=32, inplace=False):
    assert inplace, "model.py only simulates FP4 activations"
    g = x.float().unflatten(-1, (-1, block_size))
    s = _pow2_ceil(g.abs().amax(-1, keepdim=True).clamp(min=6 * 2.0**-126) * (1 / 6.0))
    x.copy_((_e2m1_round(g / s) * s).flatten(-2))
    return x


def _act(a, a_s):
    return a.float() * a_s.float().repeat_interleave(128, -1)[..., : a.shape[-1]]


def fp8_gemm(a, a_s, b, b_s, scale_dtype=torch.float32):
    w = dequantize_fp8_block(b, b_s.float())
    return (_act(a, a_s) @ w.T).to(torch.get_default_dtype())


def fp4_gemm(a, a_s, b, b_s, scale_dtype=torch.float32):
    w = unpack_fp4(b.view(torch.uint8)) * b_s.float().repeat_interleave(32, -1)
    return (_act(a, a_s) @ w.T).to(torch.get_default_dtype())


def sparse_attn(q, kv, attn_sink, topk_idxs, softmax_scale):
    idx = topk_idxs.long()  # [b, s, k], -1 unused
    rows = torch.stack([kv[b][idx[b].clamp(min=0)] for b in range(kv.shape[0])])  # [b, s, k, d]
    logits = torch.einsum("bshd,bskd->bshk", q.float(), rows.float()) * softmax_scale
    logits = logits.masked_fill((idx < 0).unsqueeze(2), float("-inf"))
    sink = attn_sink.float().view(1, 1, -1, 1).expand(*logits.shape[:3], 1)
    probs = torch.cat([logits, sink], -1).softmax(-1)[..., :-1]
    return torch.einsum("bshk,bskd->bshd", probs, rows.float()).to(q.dtype)


def hc_split_sinkhorn(mixes, hc_scale, hc_base, hc_mult=4, sinkhorn_iters=20, eps=1e-6):
    n = hc_mult
    pre = torch.sigmoid(mixes[..., :n] * hc_scale[0] + hc_base[:n]) + eps
    post = 2 * torch.sigmoid(mixes[..., n : 2 * n] * hc_scale[1] + hc_base[n : 2 * n])
    comb = (mixes[..., 2 * n :] * hc_scale[2] + hc_base[2 * n :]).unflatten(-1, (n, n)).softmax(-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb


def hadamard_transform(x, scale=1.0):
    return hadamard(x) * (scale * x.shape[-1] ** 0.5)


@pytest.fixture(scope="module")
def model_py():
    return import_model_py()


def import_model_py():
    kernel = types.ModuleType("kernel")
    for fn in (act_quant, fp4_act_quant, fp8_gemm, fp4_gemm, sparse_attn, hc_split_sinkhorn):
        setattr(kernel, fn.__name__, fn)
    fht = types.ModuleType("fast_hadamard_transform")
    fht.hadamard_transform = hadamard_transform
    saved = {k: sys.modules.get(k) for k in ("kernel", "fast_hadamard_transform")}
    sys.modules.update(kernel=kernel, fast_hadamard_transform=fht)
    try:
        spec = importlib.util.spec_from_file_location("deepseek_v4_model_py", MODEL_PY)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    module.rotate_activation = lambda x: hadamard_transform(x, scale=x.size(-1) ** -0.5)
    return module


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return build_published_checkpoint(tmp_path_factory.mktemp("model_py") / "tiny", "tiny", seed=3, **ORACLE_CONFIG)


def model_args(m, cfg: ModelConfig):
    main, comp = cfg.rope_parameters["main"], cfg.rope_parameters["compress"]
    n_mtp = cfg.num_nextn_predict_layers or 0
    return m.ModelArgs(
        max_batch_size=1, max_seq_len=256, dtype="fp8", scale_fmt="ue8m0", expert_dtype="fp4", scale_dtype="fp8",
        vocab_size=cfg.vocab_size, dim=cfg.hidden_size, moe_inter_dim=cfg.moe_intermediate_size,
        n_layers=cfg.num_hidden_layers, n_hash_layers=cfg.mlp_layer_types.count("hash_moe"), n_mtp_layers=n_mtp,
        n_heads=cfg.num_attention_heads, n_routed_experts=cfg.n_routed_experts,
        n_activated_experts=cfg.num_experts_per_tok, score_func=cfg.scoring_func,
        route_scale=cfg.routed_scaling_factor, swiglu_limit=cfg.swiglu_limit, q_lora_rank=cfg.q_lora_rank,
        head_dim=cfg.head_dim, rope_head_dim=cfg.rope_dim, norm_eps=cfg.rms_norm_eps, o_groups=cfg.o_groups,
        o_lora_rank=cfg.o_lora_rank, window_size=cfg.sliding_window,
        compress_ratios=tuple(cfg.compress_rate(i) for i in range(cfg.num_hidden_layers)) + (0,) * n_mtp,
        compress_rope_theta=comp["rope_theta"], original_seq_len=comp["original_max_position_embeddings"],
        rope_theta=main["rope_theta"], rope_factor=comp["factor"], beta_fast=comp.get("beta_fast", 32),
        beta_slow=comp.get("beta_slow", 1), index_n_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim,
        index_topk=cfg.index_topk, hc_mult=cfg.hc_mult, hc_sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps,
    )


def build_transformer(m, path: Path):
    cfg = ModelConfig.from_pretrained(path)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        model = m.Transformer(model_args(m, cfg))
    finally:
        torch.set_default_dtype(before)
    tensors = load_file(str(path / "model.safetensors"))
    params = dict(model.named_parameters())
    missing = set(params) - set(tensors) - {n for n in params if n.startswith("mtp.") and ("embed" in n or "head" in n)}
    assert not missing, sorted(missing)
    with torch.no_grad():
        for name, p in params.items():
            if name not in tensors:
                continue
            t = tensors[name]
            if p.dtype == torch.float4_e2m1fn_x2:
                p.data = t.view(torch.float4_e2m1fn_x2)
            elif t.dtype == torch.float8_e4m3fn and p.dtype != t.dtype:  # wo_a: FP8 in the file, bf16 in model.py
                scale = tensors[name.removesuffix("weight") + "scale"].float()
                p.copy_(dequantize_fp8_block(t, scale).to(p.dtype))
            else:
                p.copy_(t.to(p.dtype))
            if p.dtype == torch.bfloat16:  # wo_a, weights_proj: their bf16 values, in the float32 run
                p.data = p.data.float()
    return model.eval()


def test_the_names_model_py_declares_are_the_published_checkpoints(model_py, checkpoint):
    """Every parameter of model.py's module tree is in the file (but the MTP block's shared embedding and
    head), and the file has no tensor model.py lacks but wo_a's scales (model.py keeps wo_a in bf16)."""
    model = build_transformer(model_py, checkpoint)
    names = {n for n, _ in model.named_parameters()}
    tensors = set(load_file(str(checkpoint / "model.safetensors")))
    extra = {n for n in tensors - names if not n.endswith("wo_a.scale")}
    assert not extra, sorted(extra)


@contextmanager
def stable_topk():
    """model.py's ``topk`` leaves the order of equal scores open (the indexer's relu'd scores tie at 0
    often, and which tied entry fills the last place changes what is attended): while it runs, ties go
    to the earlier index, the catalogue's rule."""
    original = torch.Tensor.topk

    def topk(self, k, dim=-1, largest=True, sorted=True):
        order = torch.sort(self, dim=dim, descending=largest, stable=True).indices.narrow(dim, 0, k)
        return torch.return_types.topk((self.gather(dim, order), order))

    torch.Tensor.topk = topk
    try:
        yield
    finally:
        torch.Tensor.topk = original


def test_engine_equals_deepseeks_model_py(model_py, checkpoint, record_property):
    """Greedy tokens equal at every step, the prefill's and every decode step's logits within 1e-5 of
    their scale (measured: 1.9e-7 at most; model.py rotates in complex64, the engine with float32 cos/sin
    tables, and sums in its own order). The steps cross window, compression and block boundaries."""
    ids = prompt(40, 384, seed=5)
    ref = build_transformer(model_py, checkpoint)
    with no_kernel_packs():
        engine = load_model(checkpoint, dtype=torch.float32, numerics="deepseek")
    runner = SimpleRunner(engine, 1, len(ids) + STEPS, block_size=16)
    assert runner.cache.kv_spec.layout == "fp8_ds"
    ours, theirs, tokens = [], [], []
    with torch.inference_mode(), stable_topk():
        theirs.append(ref(torch.tensor([ids]))[0])
        ours.append(runner.step({0: ids})[0][-1])
        pos = len(ids)
        for _ in range(STEPS):
            tok = int(theirs[-1].argmax())
            tokens.append((tok, int(ours[-1].argmax())))
            theirs.append(ref(torch.tensor([[tok]]), pos)[0])
            ours.append(runner.step({0: [tok]})[0][-1])
            pos += 1
    a, b = torch.stack(ours).double(), torch.stack(theirs).double()
    rel = (a - b).abs().max(-1).values / b.abs().max()
    record_property("engine_vs_model_py", {"max_rel": float(rel.max()), "median_rel": float(rel.median())})
    print(f"engine vs model.py: max rel {float(rel.max()):.3g}, median {float(rel.median()):.3g}")
    assert all(t == o for t, o in tokens), tokens
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert rel.max() <= 1e-5, rel


def _model_py_streams(ref, x: torch.Tensor, start_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """model.py's ``Transformer.forward`` split where the MTP block reads: (the last layer's streams
    [b, s, hc, d], the logits of the last position)."""
    h = ref.embed(x).unsqueeze(2).repeat(1, 1, ref.hc_mult, 1)
    for layer in ref.layers:
        h = layer(h, start_pos, x)
    return h, ref.head(h, ref.hc_head_fn, ref.hc_head_scale, ref.hc_head_base, ref.norm)


def test_mtp_equals_deepseeks_model_py(model_py, checkpoint, record_property):
    """The MTP block (``mtp.0.*``, its own window KV) reading the main model's streams at t and the token at
    t + 1: over the prompt, then after each greedy decode step, its draft logits for the last position
    equal model.py's ``MTPBlock.forward`` within 1e-5 of their scale, and so do its greedy drafts."""
    ids = prompt(40, 384, seed=11)
    ref = build_transformer(model_py, checkpoint)
    with no_kernel_packs():
        engine = load_model(checkpoint, dtype=torch.float32, numerics="deepseek")
    assert engine.has_mtp and len(ref.mtp) == 1
    runner = SimpleRunner(engine, 1, len(ids) + STEPS + 1, block_size=16)
    ours, theirs = [], []
    with torch.inference_mode(), stable_topk():
        chunk, pos = ids, 0
        for _ in range(STEPS):
            h, main_ref = _model_py_streams(ref, torch.tensor([chunk]), pos)
            logits, batch, streams = runner.forward({0: chunk}, all_logits=True)
            tok = int(main_ref[0].argmax())
            assert tok == int(logits[0][-1].argmax())
            nxt = chunk[1:] + [tok]  # the token after each position of the chunk
            theirs.append(ref.mtp[0](h, pos, torch.tensor([nxt]))[0])
            draft, _ = engine.drafter.forward(batch, runner.cache, streams, torch.tensor(nxt))
            ours.append(draft[-1])
            chunk, pos = [tok], pos + len(chunk)
    a, b = torch.stack(ours).double(), torch.stack(theirs).double()
    rel = (a - b).abs().max(-1).values / b.abs().max()
    record_property("mtp_vs_model_py", {"max_rel": float(rel.max()), "median_rel": float(rel.median())})
    print(f"MTP vs model.py: max rel {float(rel.max()):.3g}, median {float(rel.median()):.3g}")
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert rel.max() <= 1e-5, rel

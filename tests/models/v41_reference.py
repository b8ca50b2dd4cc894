"""DeepSeek's own reference code for DeepSeek-V4.1-Flash (``inference/model.py`` of the release), run on
the CPU: the oracle the engine's V4.1 model is tested against.

The release ships model.py, engram.py, vision.py and image_processor.py, but not ``kernel.py`` (its
TileLang kernels). This module supplies plain-torch stand-ins for the six functions model.py imports from
it, written from the attested kernel semantics (the reference folder's README, section 3.10, and the V4
release's ``kernel.py`` for the functions V4 already had):

* ``act_quant``: E4M3 per ``block`` values along the last dim; scale ``amax * (1/448)`` (amax floored at
  1e-4) rounded up to a power of two with ``scale_fmt`` (``"ue8m0"``, model.py's only choice); returns
  ``(q, s)``, or with ``inplace=True`` writes the quantised-dequantised values into ``x`` and returns it.
* ``fp4_act_quant``: e2m1 (nearest, ties to the even code) per ``block``; E8M0 scales: a power of two from
  amax floored at 6 * 2^-126; E4M3 scales: ``e4m3(amax / 6)`` with amax floored at 6 * 2^-9, the values
  ``e2m1(x / scale)`` clamped to +-6.
* ``fp8_gemm`` / ``fp4_gemm``: the dequantised operands multiplied (FP8 weights [out, in] with one E8M0
  scale per 32x32 block; FP4 weights ``float4_e2m1fn_x2`` [out, in/2], the even element in the low nibble
  as convert.py's ``FP4_TABLE`` unpacking reads it, one E8M0 scale per 32 along in).
* ``hc_split_sinkhorn``: pre = sigmoid(m*s0+b)+eps, post = 2*sigmoid(m*s1+b), comb = softmax(m*s2+b)+eps,
  then one column normalisation and (iters-1) x (row, column) normalisations, each dividing by sum + eps.
* ``sparse_attn``: per query, the kv rows its ``topk_idxs`` name (-1: skipped), a softmax whose denominator
  also holds the head's sink logit; the output in q's dtype. (The TileLang kernel rounds the unnormalised
  probabilities to bf16 before the PV product, its bf16 datapath; run in float32/float64 this does not.)

``quant=False`` turns every quantisation step off: ``act_quant``/``fp4_act_quant`` return their input
unchanged and every quantised weight is dequantised once at load, so model.py's ``linear()`` takes
``F.linear``: "the reference with the quantisation steps off".

model.py is imported afresh for every model (it keeps module globals: ``world_size``, ``default_dtype``,
the ``shared_attn`` runtime), its ``kernel`` and sibling files registered in ``sys.modules`` only for the
import, with exactly one textual patch (:data:`INDEX_K_PATCH`): in ``Indexer.forward`` an index-key owner
publishes ``shared_attn.index_k`` whenever it runs, not only when its latent is not None. Unpatched, when a
ratio-2 source produces no new compressed entry on a decode step, its indexer reads the keys the previous
publisher left in the shared runtime (the ratio-1 source's), so model.py's decode disagrees with its own
prefill; we follow the prefill's semantics.

The model runs under :class:`ReferenceMode`: CPU ``topk`` breaks ties lowest index first, as CUDA's does
(with the plain CPU ``topk`` the tiny test model's decode differs from its prefill by 0.3 of the logit
scale), and a float64 run stays float64 where model.py says ``.float()`` (else 3e-7 of rounding).

Public API: :data:`REFERENCE_DIR`, :func:`require_reference`, :func:`load_reference_module`,
:func:`import_model`, :func:`kernel_module`, :func:`load_reference`, :func:`teacher_forced_logits`,
:func:`release_inventory`, :func:`engram_table_rows`, and the stand-ins themselves.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import sys
import types
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

#: the release's ``inference/`` folder, in the shared reference tree beside this repository
REFERENCE_DIR = Path(__file__).resolve().parents[3] / "shared" / "reference" / "deepseek-v4.1-flash" / "inference"
#: the files model.py imports from its own folder (``kernel`` is ours)
SIBLINGS = ("engram", "image_processor", "vision")


def reference_present() -> bool:
    return (REFERENCE_DIR / "model.py").is_file() and all((REFERENCE_DIR / f"{n}.py").is_file() for n in SIBLINGS)


def require_reference() -> Path:
    """``REFERENCE_DIR``, or skip the calling test when the reference files are absent."""
    if not reference_present():
        import pytest

        pytest.skip(f"the DeepSeek-V4.1-Flash reference code is not present at {REFERENCE_DIR}")
    return REFERENCE_DIR


# --- kernel.py in torch ------------------------------------------------------------------------------

FP8_MAX = 448.0
FP4_MAX = 6.0
E8M0 = torch.float8_e8m0fnu
E4M3 = torch.float8_e4m3fn
FP4X2 = torch.float4_e2m1fn_x2
#: the 16 e2m1 codes (convert.py's FP4_TABLE): 0-7 positive, 8-15 the same magnitudes negative
E2M1_TABLE = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: midpoints between neighbouring e2m1 magnitudes, and whether a value exactly on one goes up (to the even
#: code above) rather than down (to the even code below): round to nearest, ties to even
_E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The kernels compute in float32; a float64 run keeps float64."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _f32(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


def pow2_ceil(v: torch.Tensor) -> torch.Tensor:
    """``2 ** ceil(log2(v))`` for v > 0, exactly (the kernels' ``fast_round_scale`` on the exponent bits)."""
    mantissa, exponent = torch.frexp(v)  # v = m * 2^e, m in [0.5, 1)
    return torch.ldexp(torch.ones_like(v), exponent - (mantissa == 0.5).to(exponent.dtype))


def e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """The e2m1 code (0..15, int64) nearest to each value, ties to the even code, saturating at +-6."""
    a = v.abs()
    code = torch.zeros(v.shape, dtype=torch.int64, device=v.device)
    for mid, tie_up in _E2M1_MIDPOINTS:
        code += (a >= mid if tie_up else a > mid).long()
    return code + 8 * (v < 0).long()


def e2m1_values(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor(E2M1_TABLE, dtype=dtype, device=codes.device)[codes.long()]


def unpack_fp4(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed e2m1 [..., K/2] (int8, uint8 or float4_e2m1fn_x2) -> values [..., K]; the low nibble is the
    even element (convert.py: ``stack([FP4_TABLE[low], FP4_TABLE[high]], -1).flatten``)."""
    b = packed.view(torch.uint8)
    return torch.stack([e2m1_values(b & 0x0F, dtype), e2m1_values(b >> 4, dtype)], dim=-1).flatten(-2)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes [..., K] -> float4_e2m1fn_x2 [..., K/2], the even element in the low nibble."""
    c = codes.to(torch.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).view(FP4X2)


def _expand_blocks(scale: torch.Tensor, rows: int, cols: int, block: int) -> torch.Tensor:
    return scale.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """E4M3 [out, in] with one E8M0 (or float) scale per block -> ``dtype``; the block (32 or 128, as
    convert.py accepts) is read off the shapes."""
    out_f, in_f = weight.shape
    for block in (32, 128):
        if tuple(scale.shape) == (-(-out_f // block), -(-in_f // block)):
            return weight.to(dtype) * _expand_blocks(scale.float().to(dtype), out_f, in_f, block)
    raise ValueError(f"scale {tuple(scale.shape)} fits no 32x32 or 128x128 blocking of {tuple(weight.shape)}")


def dequantize_fp4(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, block: int = 32) -> torch.Tensor:
    """Packed e2m1 [out, in/2] with E8M0 scales [out, in/block] -> ``dtype`` [out, in]."""
    return unpack_fp4(weight, dtype) * scale.float().to(dtype).repeat_interleave(block, -1)


def act_quant(x: torch.Tensor, block_size: int = 128, scale_fmt: str | None = None,
              scale_dtype: torch.dtype = torch.float32, inplace: bool = False):
    """kernel.act_quant: E4M3 per ``block_size`` values along the last dim."""
    n = x.size(-1)
    assert n % block_size == 0, (n, block_size)
    cd = _compute_dtype(x)
    g = x.to(cd).unflatten(-1, (-1, block_size))
    amax = g.abs().amax(-1, keepdim=True).float().clamp(min=1e-4)
    s = amax * _f32(1 / FP8_MAX)  # the kernel multiplies by the float32 reciprocal
    if scale_fmt is not None:
        s = pow2_ceil(s)
    else:
        assert scale_dtype != E8M0, "an E8M0 scale needs scale_fmt (a power-of-two scale)"
    s = s.to(cd)
    q = (g / s).clamp(-FP8_MAX, FP8_MAX).to(E4M3)
    if inplace:
        x.copy_((q.to(cd) * s).flatten(-2))
        return x
    return q.flatten(-2), s.squeeze(-1).to(scale_dtype)


def fp4_act_quant(x: torch.Tensor, block_size: int = 32, inplace: bool = False, scale_dtype: torch.dtype = E8M0):
    """kernel.fp4_act_quant: e2m1 per ``block_size`` values along the last dim, with E8M0 scales (a power of
    two, amax floored at 6 * 2^-126) or E4M3 ones (``e4m3(amax / 6)``, amax floored at 6 * 2^-9: "keep even
    an all-zero group's scale nonzero"; the values clamped to +-6 since the rounded scale may be smaller)."""
    n = x.size(-1)
    assert n % block_size == 0, (n, block_size)
    cd = _compute_dtype(x)
    g = x.to(cd).unflatten(-1, (-1, block_size))
    amax = g.abs().amax(-1, keepdim=True).float()
    if scale_dtype == E8M0:
        s = pow2_ceil(amax.clamp(min=6 * 2.0**-126) * _f32(1 / FP4_MAX))
    elif scale_dtype == E4M3:
        s = (amax.clamp(min=6 * 2.0**-9) / FP4_MAX).clamp(max=FP8_MAX).to(E4M3).float()
    else:
        raise ValueError(f"fp4_act_quant: unsupported scale dtype {scale_dtype}")
    s = s.to(cd)
    codes = e2m1_codes((g / s).clamp(-FP4_MAX, FP4_MAX))
    if inplace:
        x.copy_((e2m1_values(codes, cd) * s).flatten(-2))
        return x
    return pack_fp4(codes.flatten(-2)), s.squeeze(-1).to(scale_dtype)


def _dequantize_act(a: torch.Tensor, a_s: torch.Tensor | None, block: int, cd: torch.dtype) -> torch.Tensor:
    if a_s is None:  # quantisation off: the activation is already a float
        return a.to(cd)
    return a.to(cd) * a_s.float().to(cd).repeat_interleave(block, -1)[..., : a.size(-1)]


def fp8_gemm(a, a_s, b, b_s, scale_dtype=torch.float32, block_size: int = 128, out_dtype=None):
    """kernel.fp8_gemm: C = A @ B^T, A [..., K] E4M3 with a scale per ``block_size``, B [N, K] E4M3 with one
    scale per ``block_size`` x ``block_size`` block, both dequantised. ``out_dtype``: torch's default
    dtype, as the kernel."""
    out_dtype = out_dtype or torch.get_default_dtype()
    cd = torch.float64 if out_dtype == torch.float64 else torch.float32
    x = _dequantize_act(a, a_s, block_size, cd)
    w = b.to(cd) if b_s is None else b.to(cd) * _expand_blocks(b_s.float().to(cd), *b.shape, block_size)
    return F.linear(x, w).to(out_dtype)


def fp4_gemm(a, a_s, b, b_s, scale_dtype=torch.float32, act_block_size: int = 128, weight_block_size: int = 32,
             out_dtype=None):
    """kernel.fp4_gemm: C = A @ B^T, A [..., K] E4M3 with a scale per ``act_block_size``, B float4_e2m1fn_x2
    [N, K/2] with an E8M0 scale per ``weight_block_size`` along K, both dequantised."""
    out_dtype = out_dtype or torch.get_default_dtype()
    cd = torch.float64 if out_dtype == torch.float64 else torch.float32
    x = _dequantize_act(a, a_s, act_block_size, cd)
    w = dequantize_fp4(b, b_s, cd, weight_block_size)
    return F.linear(x, w).to(out_dtype)


def hc_split_sinkhorn(mixes: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor, hc_mult: int = 4,
                      sinkhorn_iters: int = 20, eps: float = 1e-6):
    """kernel.hc_split_sinkhorn: mixes [..., (2+hc)*hc] -> pre [..., hc], post [..., hc], comb [..., hc, hc]
    (comb[j, k] from mixes[2hc + j*hc + k]; softmax over k), in mixes' dtype (at least float32)."""
    n = hc_mult
    cd = _compute_dtype(mixes)
    m, s, b = mixes.to(cd), hc_scale.to(cd), hc_base.to(cd)
    pre = torch.sigmoid(m[..., :n] * s[0] + b[:n]) + eps
    post = 2 * torch.sigmoid(m[..., n : 2 * n] * s[1] + b[n : 2 * n])
    comb = (m[..., 2 * n :] * s[2] + b[2 * n :]).unflatten(-1, (n, n)).softmax(-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb


def sparse_attn(q: torch.Tensor, kv: torch.Tensor, attn_sink: torch.Tensor, topk_idxs: torch.Tensor,
                softmax_scale: float) -> torch.Tensor:
    """kernel.sparse_attn: q [b, m, h, d], kv [b, n, d] (one shared head: K and V alike), topk_idxs
    [b, m, k] (-1: nothing) -> [b, m, h, d] in q's dtype; softmax over the gathered rows with
    ``exp(attn_sink[h])`` added to the denominator only."""
    cd = _compute_dtype(q)
    idx = topk_idxs.long()
    batch = torch.arange(kv.size(0), device=kv.device).view(-1, 1, 1)
    rows = kv.to(cd)[batch, idx.clamp(min=0)]  # [b, m, k, d]
    logits = torch.einsum("bmhd,bmkd->bmhk", q.to(cd), rows) * softmax_scale
    logits = logits.masked_fill((idx < 0).unsqueeze(2), float("-inf"))
    sink = attn_sink.to(cd).view(1, 1, -1, 1).expand(*logits.shape[:3], 1)
    probs = torch.cat([logits, sink], dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("bmhk,bmkd->bmhd", probs, rows).to(q.dtype)


def kernel_module(quant: bool = True, dtype: torch.dtype | None = None) -> types.ModuleType:
    """A ``kernel`` module for model.py to import. ``quant=False``: the quantisation steps are off
    (``act_quant``/``fp4_act_quant`` hand their input back: in place as it is, otherwise ``(x, None)``;
    the GEMMs take such an unquantised activation). ``dtype``: what the GEMMs return (default: torch's
    default dtype at the call, as the kernels)."""
    k = types.ModuleType("kernel")
    k.__doc__ = f"torch stand-ins for the release's kernel.py (quant={quant})"
    k.quant = quant
    if quant:
        k.act_quant, k.fp4_act_quant = act_quant, fp4_act_quant
    else:

        def act_quant_off(x, block_size=128, scale_fmt=None, scale_dtype=torch.float32, inplace=False):
            return x if inplace else (x, None)

        def fp4_act_quant_off(x, block_size=32, inplace=False, scale_dtype=E8M0):
            return x if inplace else (x, None)

        k.act_quant, k.fp4_act_quant = act_quant_off, fp4_act_quant_off

    def fp8_gemm_(a, a_s, b, b_s, scale_dtype=torch.float32, block_size=128):
        return fp8_gemm(a, a_s, b, b_s, scale_dtype, block_size, out_dtype=dtype)

    def fp4_gemm_(a, a_s, b, b_s, scale_dtype=torch.float32, act_block_size=128):
        return fp4_gemm(a, a_s, b, b_s, scale_dtype, act_block_size, out_dtype=dtype)

    k.fp8_gemm, k.fp4_gemm = fp8_gemm_, fp4_gemm_
    k.hc_split_sinkhorn, k.sparse_attn = hc_split_sinkhorn, sparse_attn
    return k


# --- running model.py ----------------------------------------------------------------------------------


def stable_topk(input: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):
    """``torch.topk`` whose equal values come lowest index first, as the CUDA kernel returns them. CPU
    ``topk`` leaves the order of ties open, and model.py's top-k often sees ties: the indexer's scores
    are sums of relu'd products (often exactly 0), masked positions are all -inf, and whichever tied
    entry takes the last place is attended, so prefill and decode would otherwise pick differently."""
    order = torch.sort(input, dim=dim, descending=largest, stable=True).indices.narrow(dim, 0, k)
    return torch.return_types.topk((input.gather(dim, order), order))


class ReferenceMode(TorchFunctionMode):
    """What model.py runs under here (entered by the loaded model's ``forward``/``forward_spec``):

    * ``topk`` (function and method) is :func:`stable_topk`;
    * ``F.linear`` of a lower-precision float input by a higher-precision weight widens the input first
      (model.py's Engram hands its bf16 rows to ``wkv``: in the reference that weight is FP8 and the
      activation gets quantised; with the quantisation off it is a float weight, and bf16 -> float is exact);
    * ``widen`` (a float64 run): ``Tensor.float()`` leaves float64 as it is and ``dtype=torch.float32``
      arguments become float64, so model.py's "at least float32" steps (RMSNorm, RoPE, the MoE's float32
      accumulator, the hyper-connection mixes, the head) do not round a float64 run to float32.
    """

    def __init__(self, widen: bool = False):
        super().__init__()
        self.widen = widen

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.topk or func is torch.topk:
            return stable_topk(*args, **kwargs)
        if func is F.linear:
            x, w = args[0], args[1]
            if x.dtype != w.dtype and x.is_floating_point() and torch.promote_types(x.dtype, w.dtype) == w.dtype:
                args = (x.to(w.dtype), *args[1:])
        if self.widen:
            if func is torch.Tensor.float and args[0].dtype == torch.float64:
                return args[0]
            if kwargs.get("dtype") is torch.float32:
                kwargs = {**kwargs, "dtype": torch.float64}
        return func(*args, **kwargs)


#: The one textual change to model.py. In ``Indexer.forward`` the index-key owner publishes
#: ``shared_attn.index_k = self.k_cache`` only when its latent is not None. On a decode step where a
#: ratio-2 source completes no group (latent None), its indexer then reads the keys the previous publisher
#: left in the shared runtime -- the ratio-1 source's, from the previous token -- so model.py's decode
#: disagrees with its own prefill (where every source publishes before it reads). We follow the prefill's
#: semantics: an owner publishes its cache whenever it runs; the keys are still computed only from a latent.
INDEX_K_PATCH = (
    """\
        if self.owns_k and latent is not None:
            # a latent stands for the first token of its group, so group j takes position j * ratio
            freqs = (
                self.freqs_cis[: seqlen - seqlen % ratio : ratio]
                if start_pos == 0
                else self.freqs_cis[start_pos + 1 - ratio].unsqueeze(0)
            )
            k = self.k_norm(self.wk(latent))
            apply_rotary_emb(k[..., -rd:], freqs)
            fp4_act_quant(k, fp4_block_size, True)
            self.k_cache[:bsz, start_pos // ratio : start_pos // ratio + k.size(1)] = k
            shared_attn.index_k = self.k_cache
""",
    """\
        if self.owns_k:
            if latent is not None:
                # a latent stands for the first token of its group, so group j takes position j * ratio
                freqs = (
                    self.freqs_cis[: seqlen - seqlen % ratio : ratio]
                    if start_pos == 0
                    else self.freqs_cis[start_pos + 1 - ratio].unsqueeze(0)
                )
                k = self.k_norm(self.wk(latent))
                apply_rotary_emb(k[..., -rd:], freqs)
                fp4_act_quant(k, fp4_block_size, True)
                self.k_cache[:bsz, start_pos // ratio : start_pos // ratio + k.size(1)] = k
            shared_attn.index_k = self.k_cache
""",
)

_counter = itertools.count()


def _load_file_module(name: str, path: Path, source: str | None = None) -> types.ModuleType:
    """Execute ``path`` (or ``source`` in its name) as a new module called ``name``, registered in
    ``sys.modules`` only while it executes (dataclasses look their module up there)."""
    module = types.ModuleType(name)
    module.__file__ = str(path)
    code = compile(path.read_text() if source is None else source, str(path), "exec")
    saved = sys.modules.get(name)
    sys.modules[name] = module
    try:
        exec(code, module.__dict__)
    finally:
        if saved is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = saved
    return module


@contextmanager
def _modules_for_import(modules: Mapping[str, types.ModuleType]) -> Iterator[None]:
    saved = {name: sys.modules.get(name) for name in modules}
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old


def load_reference_module(name: str) -> types.ModuleType:
    """A fresh import of ``REFERENCE_DIR / f"{name}.py"`` for one of the folder's self-contained files
    (``engram``, ``vision``, ``image_processor``); for model.py use :func:`import_model`."""
    require_reference()
    if name not in SIBLINGS:
        raise ValueError(f"{name!r} is not one of {SIBLINGS}")
    return _load_file_module(f"deepseek_v41_{name}_{next(_counter)}", REFERENCE_DIR / f"{name}.py")


def import_model(quant: bool = True, dtype: torch.dtype | None = None, patch_index_k: bool = True
                 ) -> types.ModuleType:
    """A fresh module of model.py with :func:`kernel_module` ``(quant, dtype)`` as its ``kernel`` and fresh
    imports of its sibling files; ``patch_index_k``: apply :data:`INDEX_K_PATCH` (asserted to apply once)."""
    require_reference()
    path = REFERENCE_DIR / "model.py"
    source = path.read_text()
    if patch_index_k:
        old, new = INDEX_K_PATCH
        count = source.count(old)
        assert count == 1, f"the index_k patch should apply once to model.py, it matches {count} times"
        source = source.replace(old, new)
    n = next(_counter)
    siblings = {name: _load_file_module(f"deepseek_v41_{name}_{n}", REFERENCE_DIR / f"{name}.py") for name in SIBLINGS}
    with _modules_for_import({"kernel": kernel_module(quant, dtype), **siblings}):
        module = _load_file_module(f"deepseek_v41_model_{n}", path, source)
    module.index_k_patched = patch_index_k
    return module


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _model_args(m: types.ModuleType, args: Mapping, quant: bool, max_seq_len: int, max_batch_size: int):
    """model.py's ``ModelArgs`` from the flat ``inference/config.json`` naming (every key must be a field);
    the storage dtypes follow ``quant``: FP8 linears and FP4 experts, or bf16 ones to be replaced."""
    fields = {f.name: f for f in dataclasses.fields(m.ModelArgs)}
    unknown = sorted(set(args) - set(fields))
    if unknown:
        raise ValueError(f"not ModelArgs fields: {unknown}")
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in args.items()}
    values.update(max_seq_len=max_seq_len, max_batch_size=max_batch_size)
    if quant:
        values.update(dtype="fp8", expert_dtype="fp4")
    else:
        values.update(dtype="bf16", expert_dtype=None)
    return m.ModelArgs(**values)


def _install_mode(model: nn.Module, widen: bool) -> None:
    for name in ("forward", "forward_spec"):
        method = getattr(model, name)

        def run(*a, _method=method, **k):
            with ReferenceMode(widen):
                return _method(*a, **k)

        run.__doc__ = method.__doc__
        object.__setattr__(model, name, run)


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.contiguous(), requires_grad=False)


def _check_shape(name: str, t: torch.Tensor, shape) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: shape {tuple(t.shape)}, the model wants {tuple(shape)}")


def _load_tensors(m: types.ModuleType, model: nn.Module, tensors: Mapping[str, torch.Tensor], quant: bool,
                  dtype: torch.dtype) -> None:
    """Fill every parameter of ``model`` from the release-layout ``tensors``, strictly."""
    consumed: set[str] = set()
    missing: list[str] = []
    problems: list[str] = []

    def take(name: str) -> torch.Tensor | None:
        t = tensors.get(name)
        if t is None:
            missing.append(name)
        else:
            consumed.add(name)
        return t

    for mname, mod in model.named_modules():  # tied modules (mtp.N.embed / mtp.N.head) come once
        prefix = f"{mname}." if mname else ""
        own = dict(mod.named_parameters(recurse=False))
        if isinstance(mod, m.Linear):
            w = take(prefix + "weight")
            s = take(prefix + "scale") if w is not None and w.dtype in (E4M3, torch.int8) else None
            own.pop("scale", None)
            own.pop("weight")
            if w is None or (w.dtype in (E4M3, torch.int8) and s is None):
                continue
            model_w = mod.weight
            try:
                if model_w.dtype in (E4M3, FP4X2):  # kept quantised (quant=True)
                    want = E4M3 if model_w.dtype == E4M3 else torch.int8
                    if w.dtype != want or s is None or s.dtype != E8M0:
                        raise ValueError(f"{prefix}weight: {w.dtype} with {s.dtype if s is not None else None} "
                                         f"scales, the model holds {model_w.dtype} with E8M0 scales")
                    _check_shape(prefix + "weight", w, model_w.shape)
                    _check_shape(prefix + "scale", s, mod.scale.shape)
                    mod.weight = _param(w if want == E4M3 else w.view(FP4X2))
                    mod.scale = _param(s)
                    mod.weight.scale = mod.scale
                else:  # a float weight: dequantised (quant=False, or wo_a as convert.py does), or cast
                    if w.dtype == E4M3:
                        w = dequantize_fp8(w, s, dtype)
                    elif w.dtype == torch.int8:
                        w = dequantize_fp4(w, s, dtype)
                    _check_shape(prefix + "weight", w, model_w.shape)
                    mod.weight = _param(w.to(dtype))
            except ValueError as e:
                problems.append(str(e))
        elif isinstance(mod, m.ParallelEngramEmbedding):
            # the table stays as stored: model.py dequantises the rows it looks up (exactly) in either mode
            for pname, want in (("weight", E4M3), ("scale", E8M0)):
                t = take(prefix + pname)
                own.pop(pname)
                if t is None:
                    continue
                if t.dtype != want:
                    problems.append(f"{prefix}{pname}: {t.dtype}, expected {want}")
                    continue
                try:
                    _check_shape(prefix + pname, t, getattr(mod, pname).shape)
                except ValueError as e:
                    problems.append(str(e))
                    continue
                setattr(mod, pname, _param(t))
        for pname, p in own.items():
            t = take(prefix + pname)
            if t is None:
                continue
            if not t.is_floating_point() or t.dtype in (E4M3, E8M0):
                problems.append(f"{prefix}{pname}: {t.dtype} where the model wants a float")
                continue
            try:
                _check_shape(prefix + pname, t, p.shape)
            except ValueError as e:
                problems.append(str(e))
                continue
            setattr(mod, pname, _param(t.to(dtype)))

    unexpected = sorted(set(tensors) - consumed)
    if missing or unexpected or problems:
        raise ValueError(
            "the tensors do not fit model.py's model: "
            + "; ".join(
                f"{what} ({len(names)}): {names[:20]}"
                for what, names in (("missing", sorted(missing)), ("unexpected", unexpected), ("bad", problems))
                if names
            )
        )


def _check_dtypes(m: types.ModuleType, model: nn.Module, quant: bool, dtype: torch.dtype) -> None:
    wrong = []
    for mname, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            if p.requires_grad:
                wrong.append(f"{mname}.{pname}: not loaded")
            kept = (isinstance(mod, m.ParallelEngramEmbedding)
                    or (quant and isinstance(mod, m.Linear) and p.dtype in (E4M3, FP4X2, E8M0)))
            if p.dtype != dtype and not kept:
                wrong.append(f"{mname}.{pname}: {p.dtype}")
        if isinstance(mod, m.Linear) and mod.weight.dtype in (E4M3, FP4X2) and mod.weight.scale is not mod.scale:
            wrong.append(f"{mname}.weight: scale not attached")
    if wrong:
        raise AssertionError(f"parameters not in {dtype} after loading: {wrong[:20]}")


def load_reference(args: Mapping, tensors: Mapping[str, torch.Tensor], tokenizer, quant: bool,
                   dtype: torch.dtype = torch.float32, max_seq_len: int = 256, max_batch_size: int = 1,
                   patch_index_k: bool = True) -> nn.Module:
    """model.py's ``Transformer`` for ``args`` (the flat ``inference/config.json`` naming) holding
    ``tensors`` (the RELEASE layout: flat model.py names; FP8 E4M3 linears with E8M0 ``.scale`` per 32x32;
    routed experts int8 [out, in/2] packed e2m1 with E8M0 [out, in/32]; ``wo_a`` FP8 + scale; no
    ``mtp.N.embed`` / ``mtp.N.head``, which are tied to the backbone's), ready to run.

    ``quant=True``: the model holds the quantised weights as model.py expects (E4M3 with ``.scale``
    attached, experts ``float4_e2m1fn_x2``) and quantises activations and KV entries; ``wo_a`` is
    dequantised as convert.py does. ``quant=False``: every quantised weight is dequantised to ``dtype`` and
    every quantisation step is off. Every other parameter (and the float caches) is ``dtype``, whatever
    model.py declares (fp32 compressor / head / hc_*, bf16 indexer weights, ...); the Engram tables stay as
    stored (rows dequantised on lookup, exactly). Loading is strict: a tensor left over or a parameter not
    filled raises ``ValueError``. ``patch_index_k=False`` leaves model.py unpatched (see
    :data:`INDEX_K_PATCH`). The model's ``forward`` runs under :class:`ReferenceMode`.
    """
    m = import_model(quant=quant, dtype=dtype, patch_index_k=patch_index_k)
    margs = _model_args(m, args, quant, max_seq_len, max_batch_size)
    with _default_dtype(dtype):
        model = m.Transformer(margs, tokenizer)
    _load_tensors(m, model, tensors, quant, dtype)
    for mod in model.modules():
        for bname, buf in list(mod._buffers.items()):
            if buf is not None and buf.is_floating_point() and buf.dtype != dtype:
                mod._buffers[bname] = buf.to(dtype)
    _check_dtypes(m, model, quant, dtype)
    model.eval()
    _install_mode(model, widen=dtype == torch.float64)
    model.reference_module = m
    model.reference_args = margs
    return model


@contextmanager
def _all_positions(head: nn.Module) -> Iterator[None]:
    forward = head.forward

    def full(x, full_logits=False):
        return forward(x, full_logits=True)

    object.__setattr__(head, "forward", full)
    try:
        yield
    finally:
        object.__delattr__(head, "forward")


def teacher_forced_logits(model: nn.Module, ids: list[int], prefill: int) -> torch.Tensor:
    """[len(ids), vocab] float64: the logits of every position of ``ids`` when ``ids[:prefill]`` is
    prefilled (``start_pos=0``) and the rest fed one token at a time (``start_pos=i``).

    ``Transformer.forward`` keeps the last position's logits only (its head's default); for the prefill's
    every position the harness makes ``model.head`` return all of them (``full_logits=True``) for the
    duration, which is what the last two lines of ``Transformer.forward`` compute for each position. The
    token it samples is ignored (its RNG draw is isolated from torch's global generator)."""
    assert 0 < prefill <= len(ids), (prefill, len(ids))
    out = []
    with torch.random.fork_rng(devices=[]), _all_positions(model.head):
        _, logits, _ = model.forward(torch.tensor([ids[:prefill]]), 0)
        out.extend(logits[0].double())
        for i in range(prefill, len(ids)):
            _, logits, _ = model.forward(torch.tensor([[ids[i]]]), i)
            out.append(logits[0, -1].double())
    return torch.stack(out)


# --- the release's inventory ------------------------------------------------------------------------


class _NoHash(nn.Module):
    """Stands in for ``NgramHashState`` where there is no tokenizer (it has no parameters)."""

    def __init__(self, *args, **kwargs):
        super().__init__()


_TIED = re.compile(r"^mtp\.\d+\.(embed|head)\.")
BYTES = {E4M3: 1, E8M0: 1, torch.int8: 1, torch.bfloat16: 2, torch.float32: 4}


def release_inventory(args: Mapping, max_seq_len: int = 256, max_batch_size: int = 1
                      ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The tensors the release stores for ``args`` (name -> (shape, dtype)), from model.py's own module
    tree built on the meta device (bf16 default dtype, Engram modules kept, hashing skipped: no tokenizer):
    model.py's persistent state with

    * ``wo_a.weight`` FP8 E4M3 plus ``wo_a.scale`` E8M0 [out/32, in/32] (convert.py dequantises it);
    * routed experts int8 [out, in/2] (two e2m1 a byte) with their E8M0 [out, in/32] scales;
    * ``head.weight`` (and the Markov head's) bf16 where model.py keeps fp32;
    * compressor ``wkv`` / ``wgate`` bf16 (model.py promotes ratio-2 ones to fp32);
    * DSpark ``confidence_head.proj.weight`` bf16 (fp32 in model.py);
    * the vision tower bf16, its RMSNorm weights included (vision.py declares them fp32);
    * no ``mtp.N.embed`` / ``mtp.N.head`` (tied to the backbone's; convert.py skips them);

    and everything else as declared: FP8 linears E4M3 with E8M0 scales per 32x32, fp32 ``hc_*``,
    ``attn_sink``, ``gate.bias`` / ``gate.bias_vl``, bf16 for the rest.
    """
    m = import_model(quant=True)
    m.NgramHashState = _NoHash
    # One Expert per (shape, dtype), shared by every slot of every MoE's list: the names and shapes are
    # model.py's, and state_dict still lists each slot, but building ~47,000 Linear modules is skipped.
    expert_cls, experts = m.Expert, {}

    def shared_expert(dim, inter_dim, dtype=None, swiglu_limit=0.0):
        key = (dim, inter_dim, dtype, swiglu_limit)
        if key not in experts:
            experts[key] = expert_cls(dim, inter_dim, dtype=dtype, swiglu_limit=swiglu_limit)
        return experts[key]

    m.Expert = shared_expert
    margs = _model_args(m, args, True, max_seq_len, max_batch_size)
    # the RoPE tables are buffers, not stored: computing them on the CPU first (model.py caches them) only
    # keeps torch's meta-device arange (slow to set up) out of the build
    for original_seq_len, theta in ((margs.original_seq_len, margs.compress_rope_theta), (0, margs.rope_theta)):
        m.precompute_freqs_cis(margs.rope_head_dim, margs.max_seq_len, original_seq_len, theta, margs.rope_factor,
                               margs.beta_fast, margs.beta_slow)
    with torch.device("meta"), _default_dtype(torch.bfloat16):
        model = m.Transformer(margs, None)
    modules = dict(model.named_modules(remove_duplicate=False))
    inventory: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for name, p in model.state_dict(keep_vars=True).items():
        if _TIED.match(name):
            continue
        mname, _, pname = name.rpartition(".")
        mod = modules[mname]
        if not isinstance(p, nn.Parameter):
            raise AssertionError(f"{name}: a persistent buffer the release would store")
        dtype = p.dtype
        if p.dtype == FP4X2:
            dtype = torch.int8
        elif isinstance(mod, m.ParallelHead) or (mname.startswith("vision.") and p.dtype == torch.float32):
            dtype = torch.bfloat16
        elif isinstance(mod, m.Linear) and (".compressor." in name or ".confidence_head." in name):
            dtype = torch.bfloat16
        elif name.endswith(".attn.wo_a.weight"):
            out_f, in_f = p.shape
            dtype = E4M3
            inventory[f"{mname}.scale"] = ((-(-out_f // 32), -(-in_f // 32)), E8M0)
        inventory[name] = (tuple(p.shape), dtype)
    return inventory


def engram_table_rows(args: Mapping) -> tuple[int, ...]:
    """The Engram tables' row counts for ``args``: per layer, the sum of its (n-gram size, head) primes as
    the reference's ``EngramLayout`` draws them (what ``engram_num_embeddings`` must say)."""
    engram = load_reference_module("engram")
    ns = types.SimpleNamespace(**{**args, "engram_num_embeddings": ()})
    layout = engram.EngramLayout.from_args(ns)
    return () if layout is None else tuple(sum(p for per_n in layer for p in per_n) for layer in layout.primes)

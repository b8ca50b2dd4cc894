"""The op catalogue: every op the DeepSeek-V4 model and the sampler call, declared once.

Each entry states the signature and the reference semantics; :mod:`deepinfer_core.ops.native` writes
them out literally (one plain-torch body per op, which every backend may register below its kernels),
and ``deepinfer_cpu_ref`` serves those bodies as the ground truth that
``deepinfer_core.testing.conformance`` checks other backends against.

``batch_invariant`` is a promise every implementation of the op must keep: the result for one row
(token, window, sampled sequence) is bit-identical whatever the other rows of the call are, how many
there are, where the row sits among them, and how far shared index lists are padded with ``-1``.
Ops marked ``False`` may break that in the default mode (blocked GEMMs pick their kernel by the number
of rows; reductions change order with the padded width); an engine built with
``batch_invariant=True`` resolves each of them only to an implementation registered with
``batch_invariant=True`` (cpu_ref: ``deepinfer_cpu_ref.batch_invariant``), so a request's tokens and
logprobs do not depend on what it was batched with.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OpSpec:
    name: str
    signature: str
    semantics: str
    batch_invariant: bool = True


_SPECS = [
    OpSpec(
        "embedding",
        "(ids: Long[T], weight: [V, D]) -> [T, D]",
        "Row lookup weight[ids].",
    ),
    OpSpec(
        "rms_norm",
        "(x: [..., D], weight: [D] | None, eps: float) -> [..., D]",
        "x * rsqrt(mean(x^2) + eps) (* weight when given), computed in at least float32, "
        "returned in x.dtype.",
    ),
    OpSpec(
        "rotary_emb",
        "(x: [T, H, D], cos: [T, R/2], sin: [T, R/2], inverse: bool) -> [T, H, D]",
        "Interleaved-pair RoPE on the trailing R channels of each head (pairs (2i, 2i+1) rotated by "
        "angle i); inverse=True rotates by the negative angle. Leading D-R channels unchanged.",
    ),
    OpSpec(
        "linear",
        "(x: [..., K], weight: [N, K], bias: [N] | None) -> [..., N]",
        "x @ weight.T + bias.",
        batch_invariant=False,
    ),
    OpSpec(
        "grouped_linear",
        "(x: [T, G, K], weight: [G*N, K]) -> [T, G, N]",
        "Block-diagonal projection: group g uses weight rows g*N:(g+1)*N.",
        batch_invariant=False,
    ),
    OpSpec(
        "swiglu",
        "(gate_up: [T, 2I], limit: float) -> [T, I]",
        "silu(min(gate, limit)) * clamp(up, -limit, limit), gate = first half, up = second half.",
        batch_invariant=False,
    ),
    OpSpec(
        "sparse_attention",
        "(q: [T, H, D], kv: [N, D], indices: Long[T, K], sinks: [H], scale: float, "
        "extra_kv: [M, D] | None, extra_indices: Long[T, K2] | None) -> [T, H, D]",
        "Shared-KV MQA: for each query t the keys (= values) are kv[indices[t]] and "
        "extra_kv[extra_indices[t]] (index -1 = unused slot, never read). softmax over the logits "
        "q.k*scale plus a per-head sink logit that only enters the denominator; output = sum p*v.",
        batch_invariant=False,
    ),
    OpSpec(
        "compress_windows",
        "(kv: [W, L, D], gate: [W, L, D]) -> [W, D]",
        "Per window: sum over L of softmax_L(gate) * kv, softmax in float32 (gate -inf = empty slot).",
    ),
    OpSpec(
        "indexer_topk",
        "(q: [T, H, d], weights: [T, H], keys: [N, d], candidates: Long[T, C], topk: int, "
        "scale: float) -> Long[T, topk]",
        "Lightning indexer: score(t, c) = sum_h weights[t,h] * relu(q[t,h] . keys[candidates[t,c]]) * "
        "scale over the valid candidates (-1 = none); return the candidate key ids of the topk best "
        "scores, best first, ties broken towards the earlier candidate, padded with -1.",
    ),
    OpSpec(
        "hc_pre",
        "(streams: [T, n, D], fn: [(2+n)n, nD], base: [(2+n)n], scale: [3], sinkhorn_iters: int, "
        "hc_eps: float, norm_eps: float) -> (post: [T, n], comb: [T, n, n], collapsed: [T, D])",
        "mHC: mixes = fn . unweighted_rmsnorm(flatten(streams)); pre = sigmoid(m*s0+b)+eps, "
        "post = 2 sigmoid(m*s1+b), comb = softmax(m*s2+b)+eps then column, (row, column)*(iters-1) "
        "Sinkhorn normalisation; collapsed = sum_i pre_i streams_i. Computed in at least float32.",
        batch_invariant=False,
    ),
    OpSpec(
        "hc_post",
        "(block_out: [T, D], streams: [T, n, D], post: [T, n], comb: [T, n, n]) -> [T, n, D]",
        "new_streams[k] = post[k] * block_out + sum_j comb[j, k] * streams[j].",
    ),
    OpSpec(
        "hc_head",
        "(streams: [T, n, D], fn: [n, nD], base: [n], scale: [1], hc_eps: float, norm_eps: float) "
        "-> [T, D]",
        "Final collapse: pre = sigmoid(fn . unweighted_rmsnorm(flatten(streams)) * scale + base) + eps; "
        "sum_i pre_i streams_i.",
        batch_invariant=False,
    ),
    OpSpec(
        "moe_route",
        "(logits: [T, E], scoring_func: str, top_k: int, correction_bias: [E] | None, "
        "fixed_ids: Long[T, k] | None, routed_scaling_factor: float) -> (weights: [T, k], ids: Long[T, k])",
        "scores = sqrtsoftplus|sigmoid|softmax(logits); ids = fixed_ids (hash routing) or the top_k of "
        "scores + correction_bias (ties towards the lower expert id); weights = scores[ids] / sum * "
        "routed_scaling_factor.",
        batch_invariant=False,
    ),
    OpSpec(
        "moe_experts",
        "(x: [T, D], w13: [E, 2I, D], w2: [E, D, I], topk_ids: Long[T, k], topk_weights: [T, k], "
        "swiglu_limit: float) -> [T, D]",
        "sum_k topk_weights[t,k] * w2[e] . swiglu(w13[e] . x[t]) with e = topk_ids[t,k] (ids < 0 skipped).",
        batch_invariant=False,
    ),
    OpSpec(
        "linear_fp8",
        "(x: [..., K], weight: E4M3 [N, K], weight_scale: f32 [ceil(N/128), ceil(K/128)]) -> [..., N]",
        "DeepSeek's block FP8 (as DeepGEMM): each row of x is quantised per 128-channel group g (the last "
        "may be partial) from its float32 values: s_x = max(amax_g |x|, 1e-4) / 448, q_x = e4m3(x / s_x) "
        "(round to nearest even); weight_scale[i, j] scales the 128x128 weight tile (i, j). "
        "out = sum_g (q_x . q_w) * s_x * s_w over the K groups, accumulated in at least float32, "
        "returned in x.dtype.",
        batch_invariant=False,
    ),
    OpSpec(
        "moe_experts_fp8",
        "(x: [T, D], w13: E4M3 [E, 2I, D], w13_scale: f32 [E, ceil(2I/128), ceil(D/128)], "
        "w2: E4M3 [E, D, I], w2_scale: f32 [E, ceil(D/128), ceil(I/128)], topk_ids: Long[T, k], "
        "topk_weights: [T, k], swiglu_limit: float) -> [T, D]",
        "moe_experts with both projections as linear_fp8: gate_up = linear_fp8(x[t], w13[e], w13_scale[e]) "
        "and h = swiglu(gate_up) kept in float32 (not rounded to x.dtype), h quantised per 128 channels "
        "like x, out[t] = sum_k topk_weights[t,k] * linear_fp8(h, w2[e], w2_scale[e]) summed in at least float32 "
        "(ids < 0 skipped), returned in x.dtype.",
        batch_invariant=False,
    ),
    OpSpec(
        "apply_penalties",
        "(logits: [B, V], prompt_mask: Bool[B, V], output_counts: [B, V], repetition: [B], "
        "presence: [B], frequency: [B]) -> [B, V]",
        "Repetition penalty on tokens seen in prompt or output (divide positive, multiply negative "
        "logits), then logits -= frequency*count + presence*(count>0).",
    ),
    OpSpec(
        "top_k_top_p_min_p",
        "(logits: [B, V], top_k: Long[B], top_p: [B], min_p: [B]) -> [B, V]",
        "Set to -inf every logit outside the top_k (k<=0: off), outside the smallest set with "
        "probability mass >= top_p (ties at the boundary kept), or with probability < min_p * max prob.",
    ),
    OpSpec(
        "random_sample",
        "(probs: [B, V], noise: [B, V]) -> Long[B]",
        "Exponential race: argmax(probs / noise) with noise ~ Exp(1) supplied by the caller "
        "(per-request generators keep seeded requests reproducible in any batch).",
    ),
    OpSpec(
        "apply_token_bitmask",
        "(logits: [B, V], bitmask: Int32[B, ceil(V/32)]) -> [B, V]",
        "xgrammar layout: bit (v % 32) of word v // 32 set = token v allowed; disallowed -> -inf.",
    ),
]

CATALOGUE: dict[str, OpSpec] = {spec.name: spec for spec in _SPECS}

# --- FP4 routed experts (DeepSeek's published format) ----------------------------------------------

CATALOGUE["moe_experts_fp4"] = OpSpec(
    "moe_experts_fp4",
    "(x: [T, D], w13: U8 [E, 2I, D/2], w13_scale: E8M0|f32 [E, 2I, D/32], w2: U8 [E, D, I/2], "
    "w2_scale: E8M0|f32 [E, D, I/32], topk_ids: Long[T, k], topk_weights: [T, k], swiglu_limit: float, "
    "quant_act: bool) -> [T, D]",
    "Routed experts in FP4 e2m1, packed two a byte along the input dim (even element in the low nibble; "
    "codes 0-7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6, 8-15 their negatives), each row's 32 consecutive inputs "
    "scaled by one power of two (w = value * scale). quant_act=False: exactly moe_experts on the weights "
    "dequantised to x.dtype. quant_act=True (DeepSeek's inference/model.py): per expert e and its tokens, "
    "x quantised per 128 channels to E4M3 with power-of-two scales s = 2^ceil(log2(max(amax, 1e-4) / 448)) "
    "(quantise then dequantise), gate_up = xq . w13[e] accumulated in at least float32 and rounded to "
    "x.dtype, h = swiglu(gate_up) * topk_weights[t,k] in at least float32, rounded to x.dtype and quantised "
    "like x, y = hq . w2[e] rounded to x.dtype; out[t] = sum_k y summed in at least float32 (ids < 0 "
    "skipped), returned in x.dtype.",
    batch_invariant=False,
)

CATALOGUE["act_quant_sim"] = OpSpec(
    "act_quant_sim",
    "(x: [..., K], block: int, fmt: str, rotate: bool) -> [..., K]",
    "DeepSeek's simulated activation quantisation (quantise, then dequantise; inference/model.py's "
    "act_quant and fp4_act_quant with inplace=True). rotate=True first applies the Walsh-Hadamard "
    "transform x @ H * K^-0.5 (Sylvester order, H[i,j] = (-1)^popcount(i&j), K a power of two), rounded "
    "to x.dtype as DeepSeek's kernel returns it. Then per "
    "block consecutive values along K (the last group may be partial): s = 2^ceil(log2(max(amax, eps) / "
    "qmax)); fmt 'e4m3': qmax 448, eps 1e-4, x/s rounded to E4M3 (nearest even, saturating); 'e2m1': "
    "qmax 6, eps 6 * 2^-126, x/s rounded to the nearest of 0, 0.5, 1, 1.5, 2, 3, 4, 6 (ties to even, "
    "signed); out = q * s. Computed in at least float32, returned in x.dtype.",
)

# --- DeepSeek's FP8 KV entry (:mod:`deepinfer_core.quant.kv_fp8`) -------------------------------------

CATALOGUE["kv_fp8_pack"] = OpSpec(
    "kv_fp8_pack",
    "(kv: [N, D], rope_dim: int) -> U8 [N, B]",
    "DeepSeek's FP8 KV entry of each row: the first D - rope_dim values quantised per 64 (the last group "
    "may be partial) with s = 2^ceil(log2(max(amax, 1e-4) / 448)) (from float32; float64 stays float64), "
    "e4m3(x / s) round to nearest even; bytes [0, D-R) the E4M3 codes, then the rope_dim RoPE values in "
    "kv.dtype, then one byte per group, log2(s) + 127, then zeros to a multiple of 8 "
    "(D 512, R 64, bf16: 448 + 128 + 7 + 1 = 584 bytes).",
)

CATALOGUE["sparse_attention_fp8"] = OpSpec(
    "sparse_attention_fp8",
    "(q: [T, H, D], kv: U8 [N, B], indices: Long[T, K], sinks: [H], scale: float, rope_dim: int, "
    "rope_dtype: dtype, extra_kv: U8 [M, B] | None, extra_indices: Long[T, K2] | None) -> [T, H, D]",
    "sparse_attention over FP8 KV entries (kv_fp8_pack's layout, RoPE values in rope_dtype): each read "
    "row is first decoded to its values, E4M3 code * 2^(byte - 127) and the RoPE values, exactly, in "
    "q.dtype; -1 slots are never read.",
    batch_invariant=False,
)

CATALOGUE["linear_fp8_ue8m0"] = OpSpec(
    "linear_fp8_ue8m0",
    "(x: [..., K], weight: E4M3 [N, K], weight_scale: f32 [ceil(N/128), ceil(K/128)]) -> [..., N]",
    "DeepSeek's fp8_gemm after act_quant(x, 128, 'ue8m0'): linear_fp8 with power-of-two activation scales, "
    "s_x = 2^ceil(log2(max(amax_g |x|, 1e-4) / 448)) per 128-channel group of a row (from its float32 "
    "values; float64 stays float64), q_x = e4m3(x / s_x) (round to nearest even, saturating); "
    "out = sum_g (q_x . q_w) * s_x * s_w accumulated in at least float32, returned in x.dtype.",
    batch_invariant=False,
)

CATALOGUE["moe_experts_act_quant"] = OpSpec(
    "moe_experts_act_quant",
    "(x: [T, D], w13: [E, 2I, D], w2: [E, D, I], topk_ids: Long[T, k], topk_weights: [T, k], "
    "swiglu_limit: float) -> [T, D]",
    "Routed experts held in a float dtype under DeepSeek's numerics, where every expert is a quantised "
    "linear: moe_experts_fp4 with quant_act=True on these weights (x and the weighted SwiGLU output "
    "quantised per 128 channels to E4M3 with power-of-two scales before each projection).",
    batch_invariant=False,
)

"""Decode-step benchmark for DeepSeek-V4 on random weights: deepinfer vs transformers vs bandwidth floor.

Builds transformers' ``DeepseekV4ForCausalLM`` directly on the target device (no checkpoint on disk),
hands the *same* tensors to deepinfer (renamed to DeepSeek's layout in memory, storage shared), then:

 (a) deepinfer decode step time through ``LLMEngine`` (its ``load_model`` is patched to return the
     preloaded model; only config.json is written, to a temporary folder);
 (b) transformers ``generate`` (greedy, fixed length) on the same weights;
 (c) a per-step bandwidth floor from that step's real routing (ids recorded by wrapping
     ``ops.moe_route``) plus the KV bytes attended, over a measured device copy bandwidth.

GPU:  python benchmarks/bench_gpu_decode.py --backend nvidia_sm100 --device cuda
CPU smoke test:  python benchmarks/bench_gpu_decode.py --small --backend cpu_ref --device cpu \
                 --batch-sizes 1,2 --gen-len 4 --prompt-len 16
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

LAYER_TYPE_ALIASES = {
    "sliding": "sliding_attention", "swa": "sliding_attention",
    "csa": "compressed_sparse_attention", "hca": "heavily_compressed_attention",
}

SMALL = dict(layers=4, hidden=64, heads=4, head_dim=32, q_lora=48, experts=8, topk=2, moe_inter=32,
             o_groups=2, o_lora=16, index_heads=8, index_head_dim=16, index_topk=4, vocab=512,
             sliding_window=8, csa_rate=4, hca_rate=8, hc_mult=4)
FLASH = dict(layers=4, hidden=4096, heads=64, head_dim=512, q_lora=1024, experts=256, topk=6, moe_inter=2048,
             o_groups=8, o_lora=1024, index_heads=64, index_head_dim=128, index_topk=512, vocab=129280,
             sliding_window=128, csa_rate=4, hca_rate=128, hc_mult=4)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="tiny widths for a CPU smoke test (+ conversion check)")
    for key, val in FLASH.items():
        ap.add_argument("--" + key.replace("_", "-"), type=int, default=None, help=f"default {val}")
    ap.add_argument("--layer-types", default="sliding,csa,hca,csa", help="comma list, cycled to --layers")
    ap.add_argument("--mlp-layer-types", default="hash_moe,moe,moe,moe", help="comma list, cycled to --layers")
    ap.add_argument("--backend", default="nvidia_sm100")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="bfloat16 (default on cuda) or float32 (default on cpu)")
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--std", type=float, default=0.02, help="std of random matrices (scaled by 1/sqrt(fan_in) if 0)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--check-convert", action="store_true",
                    help="compare in-memory conversion with save_pretrained+load_model (on by default with --small)")
    ap.add_argument("--json-out", default="bench_results/gpu_decode.json")
    args = ap.parse_args(argv)
    base = SMALL if args.small else FLASH
    for key, val in base.items():
        if getattr(args, key) is None:
            setattr(args, key, val)
    if args.dtype is None:
        args.dtype = "float32" if args.device == "cpu" else "bfloat16"
    args.check_convert = args.check_convert or args.small
    return args


def make_config(a):
    from transformers import DeepseekV4Config

    def cycle(spec, n):
        items = [s.strip() for s in spec.split(",") if s.strip()]
        return [items[i % len(items)] for i in range(n)]

    layer_types = [LAYER_TYPE_ALIASES.get(t.lower(), t) for t in cycle(a.layer_types, a.layers)]
    return DeepseekV4Config(
        vocab_size=a.vocab, hidden_size=a.hidden, moe_intermediate_size=a.moe_inter, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, head_dim=a.head_dim, q_lora_rank=a.q_lora, num_experts_per_tok=a.topk,
        n_routed_experts=a.experts, sliding_window=a.sliding_window,
        compress_rates={"compressed_sparse_attention": a.csa_rate, "heavily_compressed_attention": a.hca_rate},
        o_groups=a.o_groups, o_lora_rank=a.o_lora, index_n_heads=a.index_heads, index_head_dim=a.index_head_dim,
        index_topk=a.index_topk, hc_mult=a.hc_mult, layer_types=layer_types,
        mlp_layer_types=cycle(a.mlp_layer_types, a.layers),
        max_position_embeddings=max(4096, a.prompt_len + a.gen_len + 8),
        bos_token_id=0, eos_token_id=1,
    )


@torch.no_grad()
def randomize(model, config, std: float, seed: int) -> None:
    """In-place, on the parameters' own device: small-std matrices, norms near 1, non-trivial HC terms."""
    torch.manual_seed(seed)
    for name, p in model.named_parameters():
        p.requires_grad_(False)
        leaf = name.rsplit(".", 1)[-1]
        if "norm" in name:
            p.normal_(1.0, 0.05)
        elif leaf == "sinks":
            p.normal_(0.0, 1.0)
        elif leaf == "position_bias" or leaf in ("base", "hc_base"):
            p.normal_(0.0, 0.5)
        elif leaf in ("scale", "hc_scale"):
            p.uniform_(0.5, 1.5)
        elif leaf in ("fn", "hc_fn"):
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))
        elif name.endswith("embed_tokens.weight"):
            p.normal_(0.0, 1.0)
        elif p.dim() >= 2:
            p.normal_(0.0, std if std > 0 else 1.0 / math.sqrt(p.shape[-1]))
        else:
            p.normal_(0.0, 0.1)
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.normal_(0.0, 0.1)
        elif name.endswith("tid2eid"):
            rows = torch.rand(buf.shape[0], config.n_routed_experts, device=buf.device).argsort(dim=1)
            buf.copy_(rows[:, : config.num_experts_per_tok])


def convert_params(hf_model, cfg, dtype) -> dict[str, torch.Tensor]:
    """HF state_dict -> deepinfer params (same storage wherever the dtype already matches)."""
    from deepinfer_core.model.loader import expected_shapes, parameter_dtype
    from deepinfer_core.models.deepseek_v4.manifest import canonical_name
    from deepinfer_core.models.deepseek_v4.weights import stack_shared_experts

    shapes = expected_shapes(cfg, with_mtp=False)

    def param_dtype(name: str) -> torch.dtype:
        return parameter_dtype(cfg, name, dtype)

    params = {}
    for name, t in hf_model.state_dict().items():
        ds = canonical_name(name)
        if ds not in shapes and not ds.endswith(("shared_experts.w1.weight", "shared_experts.w3.weight")):
            continue
        params[ds] = t.detach().to(param_dtype(ds))
    if "head.weight" not in params and cfg.tie_word_embeddings:
        params["head.weight"] = params["embed.weight"]
    missing = [n for n in shapes if n not in params]
    bad = [n for n in shapes if n in params and tuple(params[n].shape) != tuple(shapes[n])]
    if missing or bad:
        raise RuntimeError(f"conversion incomplete: missing {missing[:5]}, wrong shape {bad[:5]}")
    stack_shared_experts(cfg, params, param_dtype)
    return params


def build_deepinfer_model(cfg, params, backend, dtype, device):
    from deepinfer_core.models.deepseek_v4.model import DeepseekV4Model
    from deepinfer_core.models.deepseek_v4.weights import build_weights
    from deepinfer_core.plugins import build_op_table, load_backend

    ops = build_op_table(backend, dtype=dtype, device=device, model_config=cfg)
    return DeepseekV4Model(cfg, build_weights(cfg, params, load_backend(backend).hook), ops, dtype)


def check_conversion(hf_model, cfg_dir, cfg, a, dtype, device):
    """In-memory conversion vs save_pretrained + load_model: identical params and logits."""
    from deepinfer_core.models import load_model
    from deepinfer_core.testing.model_runner import SimpleRunner

    with tempfile.TemporaryDirectory() as tmp:
        hf_model.save_pretrained(tmp)
        ref = load_model(tmp, a.backend, dtype, device)
    mem = build_deepinfer_model(cfg, convert_params(hf_model, cfg, dtype), a.backend, dtype, device)
    ref_p, mem_p = dict(ref.named_parameters()), dict(mem.named_parameters())
    assert set(ref_p) == set(mem_p), (set(ref_p) ^ set(mem_p))
    for k in ref_p:
        assert ref_p[k].dtype == mem_p[k].dtype and torch.equal(ref_p[k], mem_p[k]), k
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(2, cfg.vocab_size, (min(24, a.prompt_len),), generator=gen).tolist()
    outs = []
    for m in (ref, mem):
        r = SimpleRunner(m, 1, len(ids) + 4, block_size=cfg_block_size(m.cfg))
        outs.append(r.step({0: ids}, all_logits=True)[0])
    assert torch.equal(outs[0], outs[1]), (outs[0] - outs[1]).abs().max()
    return {"params": len(ref_p), "logits_equal": True}


def cfg_block_size(cfg) -> int:
    rates = [cfg.compress_rate(i) for i in range(cfg.num_hidden_layers)]
    return max([16, cfg.sliding_window] + [r for r in rates if r])


class RandomModel:
    """transformers' model with random weights, its config saved to a temporary folder, and the deepinfer
    model sharing its tensors."""

    def __init__(self, a, device: torch.device, dtype: torch.dtype, mtp: bool = False):
        from transformers import DeepseekV4ForCausalLM

        from deepinfer_core.config import ModelConfig
        from deepinfer_core.testing.tiny_model import mtp_block_config

        t0 = time.perf_counter()
        self.hf_config = make_config(a)
        if mtp:  # one MTP block (``mtp.0.*``), random like the rest: what speculative decoding drafts with
            self.hf_config.num_nextn_predict_layers = 1
        prev_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # build directly in the target dtype on the target device (no fp32 copy)
        try:
            with torch.device(device):
                self.hf_model = DeepseekV4ForCausalLM(self.hf_config).to(dtype)
                self.mtp_block = DeepseekV4ForCausalLM(mtp_block_config(self.hf_config)).to(dtype) if mtp else None
        finally:
            torch.set_default_dtype(prev_dtype)
        randomize(self.hf_model, self.hf_config, a.std, a.seed)
        if mtp:
            randomize(self.mtp_block, self.mtp_block.config, a.std, a.seed + 1)
        self.hf_model.eval()
        sync(device)
        self.init_s = time.perf_counter() - t0
        self._tmp = tempfile.TemporaryDirectory()
        self.cfg_dir = self._tmp.name
        self.hf_config.save_pretrained(self.cfg_dir)
        self.cfg = ModelConfig.from_pretrained(Path(self.cfg_dir))
        self.a, self.device, self.dtype = a, device, dtype

    def deepinfer_model(self, quantize=None):
        """A deepinfer model on the same tensors; ``quantize(params, names)`` converts its params first."""
        params = convert_params(self.hf_model, self.cfg, self.dtype)
        if self.mtp_block is not None:
            params.update(self._mtp_params())
        if quantize is not None:
            from deepinfer_core.model.loader import fp8_weight_names

            quantize(params, fp8_weight_names(self.cfg))
        return build_deepinfer_model(self.cfg, params, self.a.backend, self.dtype, self.device)

    @torch.no_grad()
    def _mtp_params(self) -> dict[str, torch.Tensor]:
        """The MTP block's params in the engine's names: its transformers layer, hc head, e/h projections
        and norms (DeepSeek's ``mtp.0.*`` layout, as the tiny checkpoints write it)."""
        from deepinfer_core.model.loader import expected_shapes, parameter_dtype
        from deepinfer_core.models.deepseek_v4.manifest import canonical_name
        from deepinfer_core.models.deepseek_v4.weights import stack_shared_experts

        raw = {}
        for key, value in self.mtp_block.state_dict().items():
            if key.startswith("model.layers.0."):
                raw["mtp.0." + key[len("model.layers.0."):]] = value
            elif key.startswith("model.hc_head."):
                raw["mtp.0.hc_head_" + key.rsplit(".hc_", 1)[1]] = value
        d = self.cfg.hidden_size
        gen = torch.Generator(device=self.device).manual_seed(self.a.seed + 2)
        for proj in ("e_proj", "h_proj"):
            raw[f"mtp.0.{proj}.weight"] = torch.randn(d, d, generator=gen, device=self.device) / math.sqrt(d)
        for norm in ("enorm", "hnorm", "norm"):
            raw[f"mtp.0.{norm}.weight"] = 1.0 + 0.1 * torch.randn(d, generator=gen, device=self.device)
        shapes = {n: s for n, s in expected_shapes(self.cfg, with_mtp=True).items() if n.startswith("mtp.")}
        params = {}
        for key, value in raw.items():
            name = canonical_name(key)
            if name in shapes or name.endswith(("shared_experts.w1.weight", "shared_experts.w3.weight")):
                params[name] = value.to(parameter_dtype(self.cfg, name, self.dtype))
        missing = sorted(set(shapes) - set(params))
        if missing:
            raise RuntimeError(f"random MTP block incomplete: missing {missing[:5]}")
        stack_shared_experts(self.cfg, params, lambda n: parameter_dtype(self.cfg, n, self.dtype))
        return params

    def cleanup(self) -> None:
        self._tmp.cleanup()


def make_engine(model, cfg_dir, **engine_args):
    """An ``LLMEngine`` serving the preloaded ``model`` (only ``cfg_dir``'s config.json is read)."""
    import deepinfer_core.worker.worker as worker
    from deepinfer_core.engine.args import EngineArgs
    from deepinfer_core.engine.llm_engine import LLMEngine

    orig_load = worker.load_model
    worker.load_model = lambda *args, **kw: model
    try:
        defaults = dict(dtype=model.dtype, device=str(model.device), enable_prefix_caching=False,
                        block_size=cfg_block_size(model.cfg))
        return LLMEngine(EngineArgs(model=cfg_dir, **(defaults | engine_args)))
    finally:
        worker.load_model = orig_load


def host_pools(device: torch.device) -> dict:
    """On the CPU, KV pools of 256 MiB (the default 2 GiB take seconds to fill, for runs of a few steps)."""
    return {"kv_cache_bytes": 1 << 28} if device.type == "cpu" else {}


def decode_steps(engine, batch: int, a, vocab: int) -> list[float]:
    """Milliseconds of each of ``a.steps`` decode steps of ``engine`` (synchronous: a step returns once the
    device is done) over ``batch`` greedy sequences of ``a.prompt_len`` random tokens, timed after every
    sequence's first token and ``a.warmup`` steps (``a.seed``: the prompts')."""
    from deepinfer_core.sampling.params import SamplingParams

    gen = torch.Generator().manual_seed(a.seed + batch)
    n = a.warmup + a.steps + 1
    params = SamplingParams(temperature=0.0, max_tokens=n + 1, min_tokens=n + 1, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{batch}-{i}", torch.randint(5, vocab, (a.prompt_len,), generator=gen).tolist(), params)
    started: set[str] = set()
    while len(started) < batch:
        started |= {o.request_id for o in engine.step() if o.outputs[0].token_ids}
    times = []
    for i in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        engine.step()
        if i >= a.warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    while engine.has_unfinished_requests():
        engine.step()
    return times


@contextlib.contextmanager
def record_routing(model, on_route):
    """Calls ``on_route(ids)`` with a copy of every ``moe_route`` result (not while a CUDA graph is captured)."""
    orig_route = model.ops.moe_route

    def route(*args, **kw):
        weights, ids = orig_route(*args, **kw)
        if not (ids.is_cuda and torch.cuda.is_current_stream_capturing()):
            on_route(ids.detach().clone())
        return weights, ids

    model.ops.moe_route = route
    try:
        yield
    finally:
        model.ops.moe_route = orig_route


def environment(device) -> dict:
    """Device name and the versions that decide kernel choices."""
    import transformers

    env = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "transformers": transformers.__version__, "triton": None}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    return env


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_copy_bandwidth(device) -> float:
    """Bytes/s of a large device-to-device copy, counting read + write."""
    nbytes = (2 << 30) if device.type == "cuda" else (128 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    iters = 20 if device.type == "cuda" else 5
    t0 = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    sync(device)
    bw = 2 * nbytes * iters / (time.perf_counter() - t0)
    del src, dst
    return bw


_ROUTED = (".ffn.experts.w13", ".ffn.experts.w2", ".ffn.experts.w13_scale", ".ffn.experts.w2_scale")


def static_weight_bytes(params) -> tuple[int, dict[str, int]]:
    """Bytes read every decode step regardless of routing (routed experts, embeddings and tid2eid excluded),
    and the bytes of one routed expert (weights and any FP8 scales) per MoE layer prefix."""
    total = 0
    for k, t in params.items():
        if k.endswith(_ROUTED) or k.endswith("gate.tid2eid") or k == "embed.weight":
            continue
        total += t.numel() * t.element_size()
    per_expert: dict[str, int] = {}
    for k, t in params.items():
        if k.endswith(_ROUTED):
            prefix = k[: k.index(".experts.")]
            per_expert[prefix] = per_expert.get(prefix, 0) + t[0].numel() * t.element_size()
    return total, per_expert


def kv_bytes(cfg, ctx_lens, elt: int) -> int:
    """KV bytes one decode step attends (window + compressed entries, indexer keys scanned)."""
    total = 0
    for layer in range(cfg.num_hidden_layers):
        rate = cfg.compress_rate(layer)
        for L in ctx_lens:
            total += min(L, cfg.sliding_window) * cfg.head_dim * elt
            if rate:
                n = L // rate
                if cfg.is_csa(layer):
                    total += min(cfg.index_topk, n) * cfg.head_dim * elt + n * cfg.index_head_dim * elt
                else:
                    total += n * cfg.head_dim * elt
    return total


def run_deepinfer(model, cfg_dir, a, batch, prompts, device, bw, static_bytes, per_expert):
    from deepinfer_core.sampling.params import SamplingParams

    engine = make_engine(model, cfg_dir, backend=a.backend, max_model_len=a.prompt_len + a.gen_len + 8,
                         max_num_seqs=max(batch, 1), max_num_batched_tokens=max(2048, a.prompt_len), seed=a.seed)
    cfg = model.cfg
    routed: list[torch.Tensor] = []
    step_info: dict = {}
    orig_run = engine._run

    def run(scheduled, prev=None):
        step_info["n"] = [n for _, n in scheduled]
        step_info["ctx"] = [s.num_computed_tokens + n for s, n in scheduled]
        return orig_run(scheduled, prev)

    engine._run = run
    params = SamplingParams(temperature=0.0, max_tokens=a.gen_len, min_tokens=a.gen_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    cache = engine.cache
    elt = cache.window_kv[0].element_size() if hasattr(cache, "window_kv") else model.weights.embed.element_size()
    rows = []
    pbar = tqdm(total=batch * a.gen_len, desc=f"deepinfer b={batch}", unit="tok", leave=False)
    with record_routing(model, routed.append):
        try:
            while engine.has_unfinished_requests():
                routed.clear()
                step_info.clear()
                sync(device)
                t0 = time.perf_counter()
                outs = engine.step()
                sync(device)
                dt = time.perf_counter() - t0
                n = step_info.get("n", [])
                is_decode = len(n) == batch and all(x == 1 for x in n)
                if is_decode:
                    wbytes = static_bytes + batch * cfg.hidden_size * model.weights.embed.element_size()
                    n_exp = []
                    moe_layers = sorted(per_expert, key=lambda k: int(k.split('.')[1]))
                    for layer_prefix, ids in zip(moe_layers, routed):
                        u = int(torch.unique(ids).numel())
                        n_exp.append(u)
                        wbytes += u * per_expert[layer_prefix]
                    kb = kv_bytes(cfg, step_info["ctx"], elt)
                    rows.append(dict(step_s=dt, weight_bytes=wbytes, kv_bytes=kb, experts=n_exp,
                                     floor_s=(wbytes + kb) / bw))
                    pbar.update(batch)
                _ = outs
        finally:
            pbar.close()
            del engine
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if not rows:
        return {}
    rows_warm = rows[1:] if len(rows) > 2 else rows
    step = statistics.median(r["step_s"] for r in rows_warm)
    floor = statistics.median(r["floor_s"] for r in rows_warm)
    return dict(
        decode_steps=len(rows), step_ms_median=step * 1e3, tok_s=batch / step,
        floor_ms_median=floor * 1e3, step_over_floor=step / floor,
        weight_gb_median=statistics.median(r["weight_bytes"] for r in rows_warm) / 1e9,
        kv_mb_median=statistics.median(r["kv_bytes"] for r in rows_warm) / 1e6,
        unique_experts_per_layer_mean=(
            statistics.mean(statistics.mean(r["experts"]) for r in rows_warm) if rows_warm[0]["experts"] else 0
        ),
        step_ms_all=[r["step_s"] * 1e3 for r in rows],
    )


@torch.no_grad()
def run_hf(hf_model, a, batch, prompts, device):
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)

    def gen(n):
        sync(device)
        t0 = time.perf_counter()
        out = hf_model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=n,
                                min_new_tokens=n, pad_token_id=0)
        sync(device)
        assert out.shape[1] == ids.shape[1] + n
        return time.perf_counter() - t0

    gen(2)  # warm-up
    t1 = gen(1)
    tg = gen(a.gen_len)
    per_step = (tg - t1) / max(a.gen_len - 1, 1)
    return dict(generate_s=tg, tok_s_total=batch * a.gen_len / tg, prefill_plus_1_s=t1,
                decode_step_ms_est=per_step * 1e3, decode_tok_s_est=batch / per_step if per_step > 0 else None)


def model_summary(a, rm: RandomModel) -> dict:
    """The widths and options the random model was built with."""
    return {k: getattr(a, k) for k in FLASH} | dict(
        layer_types=rm.hf_config.layer_types, mlp_layer_types=rm.hf_config.mlp_layer_types, dtype=a.dtype,
        backend=a.backend, std=a.std, small=a.small)


def main(argv=None):
    a = parse_args(argv)
    device = torch.device(a.device)
    dtype = getattr(torch, a.dtype)
    batches = [int(b) for b in a.batch_sizes.split(",") if b.strip()]
    rm = RandomModel(a, device, dtype)
    hf_model, cfg, init_s = rm.hf_model, rm.cfg, rm.init_s
    result = dict(config=model_summary(a, rm) | dict(prompt_len=a.prompt_len, gen_len=a.gen_len),
                  **environment(device), init_s=init_s, rows=[])
    if a.check_convert:
        result["conversion_check"] = check_conversion(hf_model, rm.cfg_dir, cfg, a, dtype, device)
        print("conversion check: in-memory params and logits identical to save_pretrained+load_model")

    model = rm.deepinfer_model()
    params = dict(model.named_parameters())
    static_bytes, per_expert = static_weight_bytes(params)
    bw = measure_copy_bandwidth(device)
    result["copy_bandwidth_gb_s"] = bw / 1e9
    result["param_gb"] = sum(t.numel() * t.element_size() for t in params.values()) / 1e9
    gen = torch.Generator().manual_seed(a.seed)
    prompts = {b: torch.randint(2, cfg.vocab_size, (b, a.prompt_len), generator=gen).tolist() for b in batches}
    rows = {b: {"batch": b} for b in batches}
    for b in tqdm(batches, desc="deepinfer"):
        rows[b]["deepinfer"] = run_deepinfer(model, rm.cfg_dir, a, b, prompts[b], device, bw, static_bytes, per_expert)
    del model, params
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if not a.skip_hf:
        for b in tqdm(batches, desc="transformers"):
            rows[b]["hf"] = run_hf(hf_model, a, b, prompts[b], device)
    del hf_model, rm.hf_model
    if device.type == "cuda":
        torch.cuda.empty_cache()
        result["peak_mem_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    result["rows"] = [rows[b] for b in batches]
    rm.cleanup()

    print(f"\ndevice {result['device']}  torch {result['torch']}  triton {result['triton']}  "
          f"copy bw {bw / 1e9:.0f} GB/s  params {result['param_gb']:.2f} GB  init {init_s:.1f}s")
    hdr = f"{'batch':>5} {'di step ms':>10} {'di tok/s':>10} {'floor ms':>9} {'step/floor':>10} " \
          f"{'experts/L':>9} {'hf step ms':>10} {'hf tok/s':>9} {'hf e2e tok/s':>12}"
    print(hdr)
    print("-" * len(hdr))
    for r in result["rows"]:
        d, h = r.get("deepinfer", {}), r.get("hf", {})
        f = lambda v, fmt: format(v, fmt) if isinstance(v, (int, float)) else "-"  # noqa: E731
        print(f"{r['batch']:>5} {f(d.get('step_ms_median'), '10.3f')} {f(d.get('tok_s'), '10.1f')} "
              f"{f(d.get('floor_ms_median'), '9.3f')} {f(d.get('step_over_floor'), '10.2f')} "
              f"{f(d.get('unique_experts_per_layer_mean'), '9.1f')} {f(h.get('decode_step_ms_est'), '10.3f')} "
              f"{f(h.get('decode_tok_s_est'), '9.1f')} {f(h.get('tok_s_total'), '12.1f')}")
    out = Path(a.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()

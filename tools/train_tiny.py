"""Train the tiny DeepSeek-V4 that deepinfer embeds as its default model (issue 9).

Everything comes from transformers' own ``DeepseekV4ForCausalLM``; nothing is downloaded:

1. corpus: the Python standard library's ``.py`` sources, split by file (``tools/build_corpus.py``);
2. tokenizer: byte-level BPE trained on the train split only (bos/eos specials as in
   ``deepinfer_core.testing.tiny_model.build_tokenizer``);
3. main model: every V4 feature on (sliding, CSA and HCA attention, hash-MoE and MoE layers, mHC with
   ``hc_mult`` 2, CSA indexer), AdamW + cosine schedule, bf16 autocast on CUDA; MoE routers balanced
   without an aux loss (bias updates, as DeepSeek-V3); the CSA lightning indexers, which the LM loss
   cannot reach (top-k), are trained by KL to the main attention over compressed entries (V3.2's dense
   warm-up objective) on detached inputs;
4. MTP module (``mtp.0.*``, predicts token t+2): trained after the main model on its frozen final
   hyper-connection streams, embedding and LM head shared and frozen; the block is a one-layer
   ``DeepseekV4ForCausalLM`` whose layer 0 gets the MTP input through a forward pre-hook;
5. save: ``save_pretrained`` (bf16 matrices; hyper-connection, norm, sink and bias tensors fp32) plus the
   ``mtp.0.*`` tensors in DeepSeek's layout, tokenizer, ``training_info.json``; then deepinfer's engine
   (``load_model`` + ``forward`` + ``drafter.forward``, cpu_ref, float64) is checked against the training-time
   modules on the saved weights.

The main loop's length is the smallest of ``--steps``, ``--max-epochs`` over the train split and what
``--time-budget`` fits at the step time measured over the first ``--calibrate-steps`` steps; the cosine
schedule is sized to it. The validation split is evaluated every ``--eval-every`` steps and the best
state is kept. Logs (corpus manifest, per-step metrics, train-split token counts for the unigram
baseline) go to ``--logs``.

Micro run on CPU:  python tools/train_tiny.py --device cpu --steps 20 --mtp-steps 10 --batch-size 2 --out DIR
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

TOOLS = Path(__file__).resolve().parent
REPO = TOOLS.parent
sys.path.insert(0, str(TOOLS))
import build_corpus  # noqa: E402

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
CHECKPOINT_NAME = "deepseek-v4-tiny"
ENGINE_BLOCK_SIZE = 64  # the engine's cache blocks must be a multiple of every compression rate


def ensure_deepinfer() -> None:
    """Import deepinfer from this checkout and make sure its cpu_ref backend loads (used for verification).

    Without an installed ``deepinfer-cpu-ref`` distribution (no entry point), the in-tree backend is
    registered by hand, so a plain checkout on a machine without ``pip install -e`` works too.
    """
    if str(REPO) not in sys.path:
        sys.path.insert(1, str(REPO))
    from importlib.metadata import EntryPoint

    from deepinfer_core import plugins

    if "cpu_ref" not in plugins.installed_backends():
        sys.path.insert(1, str(REPO / "backends" / "cpu_ref"))
        entry = EntryPoint(name="cpu_ref", value="deepinfer_cpu_ref.plugin", group=plugins.BACKEND_GROUP)
        installed = plugins.installed_backends
        plugins.installed_backends = lambda: {**installed(), "cpu_ref": entry}
    plugins.load_backend("cpu_ref")


# --- configuration ---------------------------------------------------------------------------------


def model_config(vocab_size: int, seq_len: int, **overrides):
    """The tiny V4: ~4.3M parameters (+0.6M MTP); compress rates and top-k sized for ``seq_len``."""
    from transformers import DeepseekV4Config

    fields = dict(
        vocab_size=vocab_size,
        hidden_size=256,
        num_hidden_layers=4,
        layer_types=[
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention",
        ],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        num_attention_heads=4,
        head_dim=64,
        q_lora_rank=128,
        o_groups=2,
        o_lora_rank=64,
        n_routed_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        hc_mult=2,
        sliding_window=64,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 32},
        index_n_heads=4,
        index_head_dim=32,
        # CSA keeps seq_len / 4 entries (128 at 512); the indexer picks a quarter of them at most
        index_topk=max(2, min(32, seq_len // 16)),
        partial_rotary_factor=0.25,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
        num_nextn_predict_layers=1,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
    )
    fields.update(overrides)
    return DeepseekV4Config(**fields)


def mtp_block_config(config):
    """One sliding-window MoE layer with the main model's dimensions (as ``tiny_model._mtp_block_config``)."""
    from transformers import DeepseekV4Config

    fields = {k: v for k, v in config.to_dict().items() if k in DeepseekV4Config.__dataclass_fields__}
    fields.update(num_hidden_layers=1, layer_types=["sliding_attention"], mlp_layer_types=["moe"])
    return DeepseekV4Config(**fields)


def init_model(config, seed: int):
    """transformers' init, plus a hash-MoE table with distinct experts per token (zeros by default)."""
    from transformers import DeepseekV4ForCausalLM
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HashRouter

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(config)
    gen = torch.Generator().manual_seed(seed + 1)
    for module in model.modules():
        if isinstance(module, DeepseekV4HashRouter):
            rand = torch.rand(config.vocab_size, config.n_routed_experts, generator=gen)
            module.tid2eid.copy_(rand.argsort(-1)[:, : config.num_experts_per_tok])
    return model


# --- MTP module ------------------------------------------------------------------------------------


class MTPModule(nn.Module):
    """DeepSeek's MTP depth 0 built from transformers modules.

    logits(t+2) = head(norm(hc_head(block(e_proj(enorm(embed(t+1)))[:, :, None] + h_proj(hnorm(streams_t))))))

    ``block`` is a one-layer ``DeepseekV4ForCausalLM``; its layer 0 receives the MTP input through a
    forward pre-hook (its own embedding and LM head are unused: the main model's are shared).
    """

    def __init__(self, config, seed: int):
        super().__init__()
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RMSNorm

        torch.manual_seed(seed + 2)
        d = config.hidden_size
        self.block = init_model(mtp_block_config(config), seed + 2)
        self.e_proj = nn.Linear(d, d, bias=False)
        self.h_proj = nn.Linear(d, d, bias=False)
        nn.init.normal_(self.e_proj.weight, std=config.initializer_range)
        nn.init.normal_(self.h_proj.weight, std=config.initializer_range)
        self.enorm = DeepseekV4RMSNorm(d, eps=config.rms_norm_eps)
        self.hnorm = DeepseekV4RMSNorm(d, eps=config.rms_norm_eps)
        self._layer_input: torch.Tensor | None = None
        self.block.model.layers[0].register_forward_pre_hook(self._feed_layer, with_kwargs=True)

    def _feed_layer(self, module, args, kwargs):
        return (self._layer_input,) + tuple(args[1:]), kwargs

    def trainable_parameters(self):
        skip = {id(self.block.model.embed_tokens.weight), id(self.block.lm_head.weight)}
        return [(n, p) for n, p in self.named_parameters() if id(p) not in skip]

    def forward(self, streams: torch.Tensor, next_ids: torch.Tensor, embed: nn.Embedding,
                head: nn.Linear) -> torch.Tensor:
        """streams [B, S, hc, D] of the main model at t, next_ids [B, S] = tokens t+1 -> logits [B, S, V]."""
        e = self.enorm(embed(next_ids))
        h = self.hnorm(streams)
        self._layer_input = (self.e_proj(e).unsqueeze(2) + self.h_proj(h)).to(e.dtype)
        try:
            hidden = self.block.model(inputs_embeds=torch.zeros_like(e), use_cache=False).last_hidden_state
        finally:
            self._layer_input = None
        return head(hidden)


def capture_streams(model):
    """Forward hook on ``model.model.hc_head``: the final hyper-connection streams [B, S, hc, D]."""
    box: dict[str, torch.Tensor] = {}
    handle = model.model.hc_head.register_forward_hook(lambda mod, args, out: box.__setitem__("streams", args[0]))
    return box, handle


# --- MoE balancing and indexer training -----------------------------------------------------------


class RouterBalancer:
    """Aux-loss-free load balancing (DeepSeek-V3): nudge each top-k router's correction bias."""

    def __init__(self, modules, rate: float):
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4TopKRouter

        self.rate = rate
        self.routers = [m for m in modules if isinstance(m, DeepseekV4TopKRouter)]
        self.counts = {id(r): None for r in self.routers}
        self.enabled = True
        for r in self.routers:
            r.register_forward_hook(self._hook)

    def _hook(self, module, args, out):
        if not (self.enabled and module.training):
            return
        counts = torch.bincount(out[2].reshape(-1), minlength=module.num_experts).float()
        prev = self.counts[id(module)]
        self.counts[id(module)] = counts if prev is None else prev + counts

    @torch.no_grad()
    def update(self) -> torch.Tensor:
        """Apply one bias step; returns the largest max/mean expert load over routers (1 = balanced)."""
        ratios = []
        for r in self.routers:
            counts = self.counts[id(r)]
            if counts is None:
                continue
            mean = counts.mean()
            r.e_score_correction_bias.add_(self.rate * torch.sign(mean - counts))
            ratios.append(counts.max() / mean.clamp(min=1.0))
            self.counts[id(r)] = None
        return torch.stack(ratios).max() if ratios else torch.ones(())


class IndexerDistillation:
    """KL(main attention over compressed entries || lightning-indexer scores) for every CSA layer.

    The indexer only emits top-k indices, so the LM loss never reaches it. Its inputs are detached
    (forward pre-hook), so this loss trains the indexer alone and changes nothing else.
    """

    def __init__(self, model):
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4CSACompressor

        self.layers = []
        for layer in model.model.layers:
            attn = layer.self_attn
            if isinstance(attn.compressor, DeepseekV4CSACompressor):
                state: dict = {}
                self.layers.append((attn, state))
                attn.register_forward_pre_hook(self._attn_pre(state), with_kwargs=True)
                attn.q_b_norm.register_forward_hook(self._store(state, "q"))
                attn.compressor.register_forward_hook(self._store(state, "ckv", index=0))
                attn.compressor.indexer.register_forward_pre_hook(self._detach_inputs)
                attn.compressor.indexer.scorer.register_forward_hook(self._store(state, "scores"))
        self.enabled = False

    @staticmethod
    def _attn_pre(state):
        def hook(module, args, kwargs):
            state["rope"] = kwargs["position_embeddings"][module.rope_layer_type]
            state["positions"] = kwargs["position_ids"]
        return hook

    def _store(self, state, key, index=None):
        def hook(module, args, out):
            if self.enabled:
                state[key] = out[index] if index is not None else out
        return hook

    def _detach_inputs(self, module, args):
        if not self.enabled:
            return None
        return (args[0].detach(), args[1].detach()) + tuple(args[2:])

    def loss(self) -> torch.Tensor:
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

        total, n = 0.0, 0
        for attn, state in self.layers:
            if "scores" not in state:
                continue
            scores = state.pop("scores").float()  # [B, S, T]
            with torch.no_grad():
                cos, sin = state.pop("rope")
                q = apply_rotary_pos_emb(state.pop("q"), cos, sin).float()  # [B, H, S, hd]
                ckv = state.pop("ckv").float()  # [B, 1, T, hd]
                logits = torch.matmul(q, ckv.transpose(-1, -2)) * attn.scaling  # [B, H, S, T]
                rate = attn.compressor.compress_rate
                threshold = (state.pop("positions") + 1) // rate  # [B, S]
                entries = torch.arange(scores.shape[-1], device=scores.device)
                future = entries.view(1, 1, -1) >= threshold.unsqueeze(-1)  # [B, S, T]
                target = logits.masked_fill(future.unsqueeze(1), float("-inf")).softmax(-1).mean(1)
                rows = threshold > 0
                target = torch.where(future, 0.0, target)
            logq = scores.masked_fill(future, float("-inf")).log_softmax(-1)
            kl = torch.where(future, 0.0, target * (torch.log(target.clamp(min=1e-12)) - logq)).sum(-1)
            total = total + kl[rows.expand_as(kl)].mean()
            n += 1
        return total / max(n, 1) if n else torch.zeros(())


# --- data ------------------------------------------------------------------------------------------


def build_tokenizer(train_texts: list[str], vocab_size: int, out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(train_texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS)
    fast.save_pretrained(str(out))
    return tok


def encode_stream(tok, texts: list[str], eos_id: int) -> torch.Tensor:
    """Token ids of ``texts``, each document followed by eos, concatenated."""
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


class Windows:
    """Random windows of ``length`` tokens from one token stream (seeded, reproducible)."""

    def __init__(self, stream: torch.Tensor, length: int, batch: int, seed: int, device):
        if stream.numel() <= length:
            raise ValueError(f"token stream of {stream.numel()} tokens is shorter than a window of {length}")
        self.stream, self.length, self.batch = stream.to(device), length, batch
        self.gen = torch.Generator().manual_seed(seed)
        self.offsets = torch.arange(length, device=device)

    def next(self) -> torch.Tensor:
        starts = torch.randint(0, self.stream.numel() - self.length, (self.batch,), generator=self.gen)
        return self.stream[starts.to(self.offsets.device)[:, None] + self.offsets]


def fixed_windows(stream: torch.Tensor, length: int, limit: int) -> torch.Tensor:
    n = min(limit, stream.numel() // length)
    return stream[: n * length].view(n, length)


# --- training --------------------------------------------------------------------------------------


def param_groups(named_params, weight_decay: float):
    decay, no_decay = [], []
    for name, p in named_params:
        if not p.requires_grad:
            continue
        plain_matrix = p.dim() >= 2 and "embed_tokens" not in name and "_hc." not in name and "hc_head" not in name
        (decay if plain_matrix else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_at(step: int, total: int, peak: float, warmup: int, min_ratio: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def autocast(device: torch.device, amp: bool):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp)


def lm_loss(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


@torch.no_grad()
def eval_lm(model, windows: torch.Tensor, device, amp: bool, batch: int) -> float:
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        ids = windows[i : i + batch].to(device)
        with autocast(device, amp):
            loss = lm_loss(model, ids)
        total += loss.item() * ids.shape[0]
        count += ids.shape[0]
    model.train(was_training)
    return total / max(count, 1)


def choose_experts_impl(model, requested: str, device, amp: bool, sample: torch.Tensor, log) -> str:
    """Fastest experts implementation that runs a forward+backward and matches eager; eager on CPU."""
    if requested != "auto":
        model.set_experts_implementation(requested)
        return requested
    if device.type != "cuda":
        model.set_experts_implementation("eager")
        return "eager"
    results = {}
    for impl in ("eager", "grouped_mm", "batched_mm"):
        try:
            model.set_experts_implementation(impl)
            times = []
            for _ in range(4):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                with autocast(device, amp):
                    loss = lm_loss(model, sample)
                loss.backward()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
            results[impl] = (min(times[1:]), loss.item())
            log(f"  experts={impl}: {results[impl][0] * 1e3:.1f} ms/step (fwd+bwd), loss {results[impl][1]:.4f}")
        except Exception as exc:  # noqa: BLE001 - any failure means "not usable here"
            model.zero_grad(set_to_none=True)
            log(f"  experts={impl}: unusable ({type(exc).__name__}: {str(exc)[:120]})")
    ref = results["eager"][1]
    ok = {k: v for k, v in results.items() if abs(v[1] - ref) <= 2e-2 * max(1.0, abs(ref))}
    best = min(ok, key=lambda k: ok[k][0])
    model.set_experts_implementation(best)
    return best


class Clock:
    """Wall clock since start, for budgets and logs."""

    def __init__(self):
        self.t0 = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.t0


def train_main(model, args, train: torch.Tensor, val: torch.Tensor, device, amp, log, metrics) -> dict:
    from tqdm import tqdm

    windows = Windows(train, args.seq_len + 1, args.batch_size, args.seed, device)
    val_windows = fixed_windows(val, args.seq_len + 1, args.val_windows)
    balancer = RouterBalancer(model.modules(), args.bias_update_rate)
    distill = IndexerDistillation(model)
    opt = torch.optim.AdamW(param_groups(model.named_parameters(), args.weight_decay), lr=args.lr,
                            betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    tokens_per_step = args.batch_size * args.seq_len
    epoch_steps = int(args.max_epochs * train.numel() / tokens_per_step)
    planned = max(1, min(args.steps, epoch_steps))
    log(f"main: planned {planned} steps (--steps {args.steps}, --max-epochs {args.max_epochs} -> {epoch_steps}), "
        f"{tokens_per_step} tokens/step, train stream {train.numel()} tokens")
    clock = Clock()
    best = {"val_loss": float("inf"), "step": -1, "state": None}
    curve: list[dict] = []
    calibrated, t_calibrate = False, 0.0
    tokens_seen, step, t_rate, rate_tokens = 0, 0, time.perf_counter(), 0
    bar = tqdm(total=planned, desc="main", unit="step", mininterval=5.0, dynamic_ncols=True)
    model.train()
    while step < planned:
        lr = lr_at(step, planned, args.lr, args.warmup, args.min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr
        ids = windows.next()
        distill.enabled = args.indexer_loss_weight > 0
        with autocast(device, amp):
            loss = lm_loss(model, ids)
        idx_loss = distill.loss() if distill.enabled else torch.zeros((), device=device)
        distill.enabled = False
        (loss + args.indexer_loss_weight * idx_loss).backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        imbalance = balancer.update()
        step += 1
        tokens_seen += ids.shape[0] * (ids.shape[1] - 1)
        rate_tokens += ids.shape[0] * (ids.shape[1] - 1)
        if step == args.calibrate_steps // 3:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t_calibrate = clock()
        if not calibrated and step == args.calibrate_steps and planned > step:
            # size the schedule to the time budget from the measured step time (warmup does not depend on it)
            if device.type == "cuda":
                torch.cuda.synchronize()
            per_step = (clock() - t_calibrate) / (step - args.calibrate_steps // 3)
            evals = planned // args.eval_every + 1
            fit = int((args.time_budget - clock()) / (per_step * (1 + 0.05))) + step - evals
            if fit < planned:
                log(f"main: {per_step * 1e3:.0f} ms/step; time budget {args.time_budget:.0f}s fits {fit} steps "
                    f"of the planned {planned}")
                planned = max(step + 1, fit)
                bar.total = planned
            calibrated = True
        if step % args.log_every == 0 or step == planned:
            now = time.perf_counter()
            tps = rate_tokens / max(now - t_rate, 1e-9)
            t_rate, rate_tokens = now, 0
            rec = {"phase": "main", "step": step, "loss": loss.item(), "indexer_kl": idx_loss.item(), "lr": lr,
                   "grad_norm": float(gnorm), "moe_max_over_mean": float(imbalance), "tokens_per_s": tps,
                   "tokens": tokens_seen, "epochs": tokens_seen / train.numel(), "elapsed_s": clock()}
            metrics(rec)
            bar.set_postfix(loss=f"{rec['loss']:.3f}", kl=f"{rec['indexer_kl']:.3f}", lr=f"{lr:.1e}",
                            tok_s=f"{tps:,.0f}", refresh=False)
            if step % (args.log_every * 4) == 0:
                tqdm.write(f"  step {step}/{planned}: loss {rec['loss']:.4f}, indexer KL {rec['indexer_kl']:.4f}, "
                           f"lr {lr:.2e}, grad norm {rec['grad_norm']:.2f}, "
                           f"MoE max/mean load {rec['moe_max_over_mean']:.2f}, {tps:,.0f} tokens/s, {clock():.0f}s",
                           file=sys.stdout)
        bar.update(1)
        over = clock() > args.time_budget * 1.15
        if step % args.eval_every == 0 or step == planned or over:
            val_loss = eval_lm(model, val_windows, device, amp, args.batch_size)
            curve.append({"step": step, "train_loss": round(loss.item(), 5), "val_loss": round(val_loss, 5),
                          "epochs": round(tokens_seen / train.numel(), 3), "elapsed_s": round(clock(), 1)})
            metrics({"phase": "main", "step": step, "val_loss": val_loss, "val_ppl": math.exp(val_loss),
                     "elapsed_s": clock()})
            tqdm.write(f"  step {step}/{planned}: train loss {loss.item():.4f}, val loss {val_loss:.4f} "
                       f"(ppl {math.exp(val_loss):.2f}), {tokens_seen / train.numel():.2f} epochs, "
                       f"{clock():.0f}s", file=sys.stdout)
            if val_loss < best["val_loss"]:
                best = {"val_loss": val_loss, "step": step,
                        "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
        if over:
            log(f"main: stopping at step {step}: over the time budget ({clock():.0f}s)")
            break
    bar.close()
    final_val = curve[-1]["val_loss"] if curve and curve[-1]["step"] == step else None
    if best["state"] is not None and best["step"] != step:
        log(f"main: restoring the best validation checkpoint (step {best['step']}, val loss {best['val_loss']:.4f})")
        model.load_state_dict(best["state"])
    elapsed = clock()
    return {"steps": step, "planned_steps": planned, "tokens": tokens_seen, "epochs": tokens_seen / train.numel(),
            "seconds": elapsed, "tokens_per_s": tokens_seen / max(elapsed, 1e-9), "final_train_loss": loss.item(),
            "best_val_loss": best["val_loss"], "best_step": best["step"], "final_val_loss": final_val,
            "val_curve": curve}


def mtp_batch_loss(main, mtp, ids, box) -> torch.Tensor:
    """ids [B, S+2]: main runs on ids[:, :S]; MTP at t sees streams_t and token t+1, predicts t+2."""
    seq = ids.shape[1] - 2
    with torch.no_grad():
        main.model(input_ids=ids[:, :seq], use_cache=False)
    streams = box.pop("streams").detach()
    logits = mtp(streams, ids[:, 1 : seq + 1], main.model.embed_tokens, main.lm_head)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 2:].reshape(-1))


@torch.no_grad()
def eval_mtp(main, mtp, windows: torch.Tensor, device, amp, batch, box) -> tuple[float, float]:
    mtp.eval()
    total, hits, count = 0.0, 0, 0
    for i in range(0, windows.shape[0], batch):
        ids = windows[i : i + batch].to(device)
        seq = ids.shape[1] - 2
        with autocast(device, amp):
            main.model(input_ids=ids[:, :seq], use_cache=False)
            logits = mtp(box.pop("streams"), ids[:, 1 : seq + 1], main.model.embed_tokens, main.lm_head).float()
        target = ids[:, 2:]
        total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum"))
        hits += int((logits.argmax(-1) == target).sum())
        count += target.numel()
    mtp.train()
    return total / count, hits / count


def train_mtp(main, mtp, args, train, val, device, amp, log, metrics) -> dict:
    from tqdm import tqdm

    main.eval()
    for p in main.parameters():
        p.requires_grad_(False)
    box, handle = capture_streams(main)
    windows = Windows(train, args.seq_len + 2, args.batch_size, args.seed + 7, device)
    val_windows = fixed_windows(val, args.seq_len + 2, args.val_windows)
    balancer = RouterBalancer(mtp.modules(), args.bias_update_rate)
    opt = torch.optim.AdamW(param_groups(mtp.trainable_parameters(), args.weight_decay), lr=args.mtp_lr,
                            betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    planned = args.mtp_steps
    clock = Clock()
    mtp.train()
    bar = tqdm(total=planned, desc="mtp", unit="step", mininterval=5.0, dynamic_ncols=True)
    step, loss = 0, torch.zeros(())
    while step < planned:
        lr = lr_at(step, planned, args.mtp_lr, min(args.warmup, max(1, planned // 10)), args.min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr
        ids = windows.next()
        with autocast(device, amp):
            loss = mtp_batch_loss(main, mtp, ids, box)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in mtp.trainable_parameters()], args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        balancer.update()
        step += 1
        if step == args.calibrate_steps and planned > step:
            if device.type == "cuda":
                torch.cuda.synchronize()
            fit = int((args.mtp_time_budget - clock()) / (clock() / step * 1.05)) + step
            if fit < planned:
                log(f"mtp: time budget {args.mtp_time_budget:.0f}s fits {fit} of the planned {planned} steps")
                planned = max(step + 1, fit)
                bar.total = planned
        if step % args.log_every == 0 or step == planned:
            metrics({"phase": "mtp", "step": step, "loss": loss.item(), "lr": lr, "elapsed_s": clock()})
            bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{lr:.1e}", refresh=False)
            if step % (args.log_every * 4) == 0:
                tqdm.write(f"  mtp step {step}/{planned}: loss {loss.item():.4f}, lr {lr:.2e}, {clock():.0f}s",
                           file=sys.stdout)
        bar.update(1)
        if clock() > args.mtp_time_budget * 1.15:
            log(f"mtp: stopping at step {step}: over the time budget")
            break
    bar.close()
    val_loss, val_acc = eval_mtp(main, mtp, val_windows, device, amp, args.batch_size, box)
    handle.remove()
    metrics({"phase": "mtp", "step": step, "val_loss": val_loss, "val_top1": val_acc})
    log(f"mtp: {step} steps in {clock():.0f}s, train loss {loss.item():.4f}, val loss {val_loss:.4f}, "
        f"val top-1 (t+2) {val_acc:.3f}")
    return {"steps": step, "seconds": clock(), "final_train_loss": loss.item(), "val_loss": val_loss,
            "val_top1": val_acc}


# --- saving and verification -----------------------------------------------------------------------

_FP32_NAMES = ("_hc.", "hc_head.", "sinks", "position_bias", "e_score_correction_bias")


def stored_in_fp32(name: str) -> bool:
    """Small tensors kept in float32 (transformers' ``_keep_in_fp32_modules_strict``); the rest bf16."""
    leaf_module = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
    return any(k in name for k in _FP32_NAMES) or "norm" in leaf_module


def round_to_storage(module: nn.Module) -> None:
    """Round every floating parameter to the precision it is saved in (in place, dtype unchanged)."""
    with torch.no_grad():
        for name, t in module.named_parameters():
            if t.is_floating_point() and not stored_in_fp32(name):
                t.copy_(t.to(torch.bfloat16).to(t.dtype))


def to_storage_dtypes(module: nn.Module) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.is_floating_point():
                p.data = p.data.to(torch.float32 if stored_in_fp32(name) else torch.bfloat16)


def mtp_tensors(mtp: MTPModule) -> dict[str, torch.Tensor]:
    """The MTP module in DeepSeek's ``mtp.0.*`` names (the block's keys as transformers saves them)."""
    from safetensors.torch import load_file

    block = copy.deepcopy(mtp.block).cpu()
    to_storage_dtypes(block)
    with tempfile.TemporaryDirectory() as tmp:
        block.save_pretrained(tmp)
        saved = load_file(str(Path(tmp) / "model.safetensors"))
    out = {}
    for key, value in saved.items():
        if key.startswith("model.layers.0."):
            out["mtp.0." + key[len("model.layers.0."):]] = value
        elif key.startswith("model.hc_head.hc_"):
            out["mtp.0.hc_head_" + key.rsplit(".hc_", 1)[1]] = value
        elif key == "model.norm.weight":
            out["mtp.0.norm.weight"] = value
    for name in ("e_proj", "h_proj", "enorm", "hnorm"):
        w = getattr(mtp, name).weight.detach().cpu()
        out[f"mtp.0.{name}.weight"] = w.float() if name.endswith("norm") else w.to(torch.bfloat16)
    return {k: v.contiguous() for k, v in out.items()}


def save_checkpoint(main, mtp, out: Path) -> None:
    from safetensors.torch import load_file, save_file

    model = copy.deepcopy(main).cpu()
    to_storage_dtypes(model)
    model.config.dtype = torch.bfloat16
    model.config.num_nextn_predict_layers = 1
    model.save_pretrained(str(out))
    path = out / "model.safetensors"
    tensors = load_file(str(path))
    tensors.update(mtp_tensors(mtp))
    save_file(tensors, str(path), metadata={"format": "pt"})
    (out / "generation_config.json").unlink(missing_ok=True)  # defaults only; keeps the folder small
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("_experts_implementation", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _engine_run(engine, ids: torch.Tensor, with_mtp: bool):
    """Full forward (all logits + streams) of one sequence on a fresh cache; then the MTP drafts."""
    from deepinfer_core.model.metadata import SeqSpan, build_forward_batch
    from deepinfer_core.testing.model_runner import SimpleRunner

    length = ids.numel()
    runner = SimpleRunner(engine, 1, length, block_size=ENGINE_BLOCK_SIZE)
    spans = [SeqSpan(0, length, runner.table(0), runner.table(0), 0)]
    batch = build_forward_batch(ids.tolist(), spans, engine.compressor_specs(), runner.block_size,
                                engine.cfg.sliding_window, logits_indices=list(range(length)))
    logits, streams = engine.forward(batch, runner.cache)
    draft = None
    if with_mtp:
        n = length - 1
        mtp_spans = [SeqSpan(0, n, runner.table(0), runner.table(0), 0)]
        mtp_batch = build_forward_batch(ids[:n].tolist(), mtp_spans, engine.compressor_specs(), runner.block_size,
                                        engine.cfg.sliding_window, logits_indices=list(range(n)))
        draft, _ = engine.drafter.forward(mtp_batch, runner.cache, streams[:n], ids[1:])
    return logits, streams, draft


@torch.no_grad()
def verify_engine(out: Path, main, mtp, sample: torch.Tensor, log) -> dict:
    """deepinfer (cpu_ref, float64) against the training-time modules on the saved weights (float64).

    * strict (max relative difference < 1e-5: transformers applies RoPE in float32 even in a float64
      model, which leaves ~1e-7..1e-6), on a prefix short enough that every CSA query keeps all of
      its compressed entries (<= index_topk): main logits, and the MTP drafts both end to end and with
      the training-time ``MTPModule`` fed the engine's own streams;
    * on the whole sample: top-1 agreement only. transformers scores the CSA indexer in float32 and breaks
      top-k ties its own way, so a query whose pick sits on a (near-)tie may attend to other entries;
    * the folder reloads in transformers (``AutoModelForCausalLM`` / ``AutoTokenizer``).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from deepinfer_core.models import load_model

    ref_main = copy.deepcopy(main).cpu()
    ref_mtp = copy.deepcopy(mtp).cpu()
    for m in (ref_main, ref_mtp):
        round_to_storage(m)
        m.to(torch.float64).eval()
    ref_main.set_experts_implementation("eager")
    ref_mtp.block.set_experts_implementation("eager")
    embed, head = ref_main.model.embed_tokens, ref_main.lm_head
    engine = load_model(out, backend="cpu_ref", dtype=torch.float64)
    box, handle = capture_streams(ref_main)

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max())

    def compare(ids: torch.Tensor) -> dict:
        n = ids.numel() - 1
        ref_logits = ref_main(input_ids=ids[None], use_cache=False).logits[0]
        ref_streams = box.pop("streams")
        ref_draft = ref_mtp(ref_streams[:, :n], ids[None, 1:], embed, head)[0]
        logits, streams, draft = _engine_run(engine, ids, with_mtp=True)
        on_engine = ref_mtp(streams[None, :n], ids[None, 1:], embed, head)[0]
        return {
            "tokens": ids.numel(),
            "main_logits_max_rel": rel(logits, ref_logits),
            "main_top1_agreement": float((logits.argmax(-1) == ref_logits.argmax(-1)).double().mean()),
            "mtp_logits_max_rel_same_streams": rel(draft, on_engine),
            "mtp_logits_max_rel_end_to_end": rel(draft, ref_draft),
            "mtp_top1_agreement": float((draft.argmax(-1) == ref_draft.argmax(-1)).double().mean()),
        }

    sample = sample.cpu()
    strict_len = min(sample.numel(), 4 * main.config.index_topk + 3)
    result = {"strict": compare(sample[:strict_len]), "full": compare(sample)}
    handle.remove()
    hf = AutoModelForCausalLM.from_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(out))
    result["transformers_reload_dtype"] = str(hf.dtype)
    for key in ("strict", "full"):
        log(f"verify {key}: " + ", ".join(f"{k} {v:.3g}" for k, v in result[key].items()))
    strict, full = result["strict"], result["full"]
    bad = [k for k in ("main_logits_max_rel", "mtp_logits_max_rel_same_streams", "mtp_logits_max_rel_end_to_end")
           if strict[k] > 1e-5]
    bad += [f"full.{k}" for k in ("mtp_logits_max_rel_same_streams",) if full[k] > 1e-5]
    bad += [f"full.{k}" for k in ("main_top1_agreement", "mtp_top1_agreement") if full[k] < 0.9]
    if bad:
        raise RuntimeError(f"deepinfer's engine does not reproduce the trained model ({bad}): {result}")
    return result


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# --- main ------------------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("deepinfer_core/assets") / CHECKPOINT_NAME,
                    help="model folder to write (config, model.safetensors incl. mtp.0.*, tokenizer)")
    ap.add_argument("--logs", type=Path, help="folder for the corpus manifest, metrics and token counts "
                    "(default: <out>-logs beside the model folder)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3000, help="upper bound on main-model steps")
    ap.add_argument("--max-epochs", type=float, default=12.0, help="upper bound on passes over the train split")
    ap.add_argument("--time-budget", type=float, default=240.0, help="seconds for the main training loop")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--bias-update-rate", type=float, default=3e-3, help="MoE aux-loss-free balancing step")
    ap.add_argument("--indexer-loss-weight", type=float, default=1.0)
    ap.add_argument("--mtp-steps", type=int, default=800)
    ap.add_argument("--mtp-lr", type=float, default=2e-3)
    ap.add_argument("--mtp-time-budget", type=float, default=50.0)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--val-windows", type=int, default=96)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--calibrate-steps", type=int, default=30)
    ap.add_argument("--amp", choices=["auto", "bf16", "off"], default="auto", help="auto: bf16 on CUDA only")
    ap.add_argument("--experts-impl", default="auto", help="auto | eager | grouped_mm | batched_mm")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch default)")
    ap.add_argument("--skip-verify", action="store_true")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    clock = Clock()
    device = torch.device(args.device)
    amp = args.amp == "bf16" or (args.amp == "auto" and device.type == "cuda")
    if args.threads:
        torch.set_num_threads(args.threads)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for the few float32 matmuls left under autocast
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    out: Path = args.out
    logs: Path = args.logs or out.parent / f"{out.name}-logs"
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} exists and is not empty; choose another --out or remove it")
    out.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    metrics_file = open(logs / "train_metrics.jsonl", "w")

    def log(msg: str) -> None:
        print(f"[{clock():6.1f}s] {msg}", flush=True)

    def metrics(rec: dict) -> None:
        metrics_file.write(json.dumps(rec) + "\n")
        metrics_file.flush()

    from transformers import __version__ as tf_version

    if not args.skip_verify:
        ensure_deepinfer()  # fail now, not after training, if the engine cannot be loaded
    if tf_version != "5.23.0":
        log(f"WARNING: transformers {tf_version}; this script and deepinfer's golden tests target 5.23.0")
    log(f"python {platform.python_version()}, torch {torch.__version__}, transformers {tf_version}, "
        f"device {device}" + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
        + f", amp {'bf16' if amp else 'off'}")

    # 1. corpus
    files = build_corpus.collect()
    manifest = build_corpus.manifest(files)
    (logs / "corpus_manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    split_texts = {s: build_corpus.texts(files, s) for s in ("train", "val", "heldout")}
    log("corpus: " + ", ".join(f"{s} {len(t)} files / {sum(map(len, t)) / 1e6:.2f} MB" for s, t in split_texts.items()))

    # 2. tokenizer (train split only)
    tok = build_tokenizer(split_texts["train"], args.vocab_size, out)
    eos_id = tok.token_to_id(EOS)
    streams = {s: encode_stream(tok, split_texts[s], eos_id) for s in ("train", "val")}
    counts = torch.bincount(streams["train"], minlength=args.vocab_size)
    (logs / "train_token_counts.json").write_text(json.dumps(counts.tolist()) + "\n")
    log(f"tokenizer: vocab {tok.get_vocab_size()}, train {streams['train'].numel()} tokens "
        f"({sum(map(len, split_texts['train'])) / streams['train'].numel():.2f} chars/token), "
        f"val {streams['val'].numel()} tokens")

    # 3. main model
    config = model_config(tok.get_vocab_size(), args.seq_len)
    model = init_model(config, args.seed).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.2f}M parameters, layers {config.layer_types}, mlp {config.mlp_layer_types}, "
        f"hc_mult {config.hc_mult}, window {config.sliding_window}, compress {config.compress_rates}, "
        f"index_topk {config.index_topk}")
    probe = Windows(streams["train"], args.seq_len + 1, args.batch_size, args.seed + 99, device).next()
    impl = choose_experts_impl(model, args.experts_impl, device, amp, probe, log)
    torch.manual_seed(args.seed)
    log(f"experts implementation: {impl}")
    main_info = train_main(model, args, streams["train"], streams["val"], device, amp, log, metrics)
    log(f"main: {main_info['steps']} steps, {main_info['tokens'] / 1e6:.1f}M tokens ({main_info['epochs']:.1f} epochs) "
        f"in {main_info['seconds']:.0f}s = {main_info['tokens_per_s']:,.0f} tokens/s; best val loss "
        f"{main_info['best_val_loss']:.4f} at step {main_info['best_step']}")

    # 4. MTP
    mtp = MTPModule(config, args.seed).to(device)
    mtp.block.set_experts_implementation(impl)
    n_mtp = sum(p.numel() for _, p in mtp.trainable_parameters())
    log(f"mtp: {n_mtp / 1e6:.2f}M trainable parameters")
    mtp_info = train_mtp(model, mtp, args, streams["train"], streams["val"], device, amp, log, metrics)

    # 5. save + verify
    save_checkpoint(model, mtp, out)
    info = {
        "name": CHECKPOINT_NAME,
        "seq_len": args.seq_len,
        "seed": args.seed,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("out", "logs")},
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "transformers": tf_version},
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "experts_implementation": impl,
        "parameters": {"main": n_params, "mtp": n_mtp},
        "corpus": {"python_version": manifest["python_version"], "split_rule": manifest["split_rule"],
                   "totals": manifest["totals"],
                   "train_files_sha256": hashlib.sha256("\n".join(
                       f"{f['path']} {f['sha256']}" for f in manifest["files"] if f["split"] == "train").encode()
                   ).hexdigest(),
                   "train_tokens": int(streams["train"].numel()), "val_tokens": int(streams["val"].numel())},
        "main": main_info,
        "mtp": mtp_info,
    }
    if not args.skip_verify:
        sample = streams["val"][: min(args.seq_len, 256) + 1]
        info["verify"] = verify_engine(out, model, mtp, sample, log)
    (out / "training_info.json").write_text(json.dumps(info, indent=1) + "\n")
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    log(f"saved {out.name}/ ({size / 1e6:.2f} MB): " + ", ".join(sorted(f.name for f in out.iterdir())))
    log(f"model.safetensors sha256 {sha256_file(out / 'model.safetensors')}")
    metrics_file.close()
    log(f"done in {clock():.0f}s")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    sys.exit(main())

"""What a step must at least cost: the bytes it reads (weights it touches, KV it attends) and the FLOPs
it does, and the measured device rates (copy bandwidth, matmul) that turn them into time floors."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from benchmarks.bench_gpu_decode import kv_bytes, static_weight_bytes, sync

# not matrices applied to every token: looked up, per position, or counted elsewhere
_NOT_PER_TOKEN = (".ffn.experts.w13", ".ffn.experts.w2", "gate.tid2eid", ".ape", "_scale")


@dataclass
class StepShape:
    """What one forward computed: per sequence (tokens already cached, new tokens), and rows sampled."""

    spans: list[tuple[int, int]]
    logits_rows: int

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.spans)

    def is_decode(self, batch: int) -> bool:
        return len(self.spans) == batch and all(n == 1 for _, n in self.spans)


class ModelCost:
    """Bytes and FLOPs of a step of ``model`` (a DeepseekV4Model, any weight dtype)."""

    def __init__(self, model):
        cfg, p = model.cfg, dict(model.named_parameters())
        self.cfg = cfg
        self.static_bytes, self.per_expert_bytes = static_weight_bytes(p)
        self.moe_layers = sorted(self.per_expert_bytes, key=lambda k: int(k.split(".")[1]))
        self.embed_row_bytes = cfg.hidden_size * p["embed.weight"].element_size()
        self.kv_elt = torch.empty((), dtype=model.dtype).element_size()
        self.token_flops = 2 * sum(t.numel() for k, t in p.items()
                                   if t.dim() >= 2 and k not in ("embed.weight", "head.weight")
                                   and not k.endswith(_NOT_PER_TOKEN))
        self.expert_flops = 2 * cfg.num_experts_per_tok * sum(
            p[f"{m}.experts.w13"][0].numel() + p[f"{m}.experts.w2"][0].numel() for m in self.moe_layers)
        self.head_flops = 2 * p["head.weight"].numel()

    def flops(self, shape: StepShape) -> float:
        """Matmul and attention FLOPs (2 per multiply-add); norms, rotary and compression left out."""
        cfg = self.cfg
        total = shape.num_tokens * (self.token_flops + self.expert_flops) + shape.logits_rows * self.head_flops
        per_key = 4 * cfg.num_attention_heads * cfg.head_dim  # q.k and p.v
        per_index_key = 2 * cfg.index_n_heads * cfg.index_head_dim
        for ctx, n in shape.spans:
            seen = torch.arange(ctx + 1, ctx + n + 1, dtype=torch.float64)  # keys visible to each new token
            for layer in range(cfg.num_hidden_layers):
                keys = seen.clamp(max=cfg.sliding_window)
                rate = cfg.compress_rate(layer)
                if rate:
                    entries = torch.div(seen, rate, rounding_mode="floor")
                    if cfg.is_csa(layer):
                        keys = keys + entries.clamp(max=cfg.index_topk)
                        total += per_index_key * float(entries.sum())
                    else:
                        keys = keys + entries
                total += per_key * float(keys.sum())
        return total

    def kv_bytes(self, shape: StepShape) -> int:
        """KV the step attends, each sequence's cache read once."""
        return kv_bytes(self.cfg, [ctx + n for ctx, n in shape.spans], self.kv_elt)

    def weight_bytes(self, num_tokens: int, unique_experts: list[int]) -> int:
        """Weights read: everything but the routed experts, the embedding rows, and each expert picked."""
        routed = sum(u * self.per_expert_bytes[m] for m, u in zip(self.moe_layers, unique_experts))
        return self.static_bytes + num_tokens * self.embed_row_bytes + routed

    def expected_unique_experts(self, num_tokens: int) -> list[int]:
        """Distinct experts ``num_tokens`` tokens pick per MoE layer if routing were uniform."""
        e, k = self.cfg.n_routed_experts, self.cfg.num_experts_per_tok
        return [round(e * (1 - (1 - k / e) ** num_tokens))] * len(self.moe_layers)


def floors(weight_bytes: int, kv: int, flops: float, bandwidth: float, matmul_flops: float) -> dict[str, float]:
    """Bandwidth floor (bytes over copy bandwidth), compute floor (FLOPs over matmul rate), the larger."""
    bw_s, compute_s = (weight_bytes + kv) / bandwidth, flops / matmul_flops
    return {"floor_bw_s": bw_s, "floor_compute_s": compute_s, "floor_s": max(bw_s, compute_s)}


def measure_matmul_flops(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a large square matmul in ``dtype``."""
    n, iters = (8192, 20) if device.type == "cuda" else (512, 4)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    for _ in range(3):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    sync(device)
    rate = 2 * n**3 * iters / (time.perf_counter() - t0)
    del a, b
    return rate

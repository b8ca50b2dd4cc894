"""Deterministic tiny DeepSeek-V4 checkpoints, written by transformers' own ``DeepseekV4ForCausalLM``.

Every parameter is made non-trivial (sinks, position biases, hyper-connection bases and scales,
correction biases, a ``tid2eid`` with distinct experts per row) so that a missed term shows in the
logits. The tokenizer is a byte-level BPE trained locally on an embedded corpus: nothing is downloaded.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

_CORPUS = """\
def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

class Node:
    def __init__(self, value, children=None):
        self.value = value
        self.children = children or []

    def walk(self):
        yield self.value
        for child in self.children:
            yield from child.walk()

The quick brown fox jumps over the lazy dog. DeepSeek-V4 compresses its attention cache:
sliding windows keep recent tokens, compressed sparse attention keeps one entry per four tokens,
and heavily compressed attention keeps one entry per hundred and twenty-eight tokens.
import os, sys, json
print("hello, world")
for i in range(10):
    if i % 2 == 0:
        print(i, "is even")
    else:
        print(i, "is odd")
"""

# Attention/MoE layout of each named tiny config (the rest comes from ``_BASE``).
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        num_hidden_layers=4,
        layer_types=[
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention",
        ],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        hc_mult=2,
    ),
    "tiny_hc4": dict(
        num_hidden_layers=3,
        layer_types=["compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"],
        mlp_layer_types=["hash_moe", "hash_moe", "moe"],
        hc_mult=4,
        scoring_func="sigmoid",
    ),
    "tiny_hc1": dict(
        num_hidden_layers=3,
        layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention"],
        mlp_layer_types=["moe", "moe", "hash_moe"],
        hc_mult=1,
        sliding_window=6,
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
        index_topk=3,
    ),
}

_BASE: dict[str, Any] = dict(
    vocab_size=384,
    hidden_size=64,
    moe_intermediate_size=32,
    num_attention_heads=4,
    head_dim=32,
    q_lora_rank=48,
    num_experts_per_tok=2,
    n_routed_experts=6,
    sliding_window=8,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    o_groups=2,
    o_lora_rank=16,
    index_n_heads=8,
    index_head_dim=16,
    index_topk=4,
    partial_rotary_factor=0.25,
    hc_sinkhorn_iters=20,
    max_position_embeddings=4096,
    bos_token_id=0,
    eos_token_id=1,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
)


def tiny_config(name: str = "tiny", **overrides: Any):
    from transformers import DeepseekV4Config

    if name not in TINY_CONFIGS:
        raise KeyError(f"unknown tiny config {name!r}; choose one of {sorted(TINY_CONFIGS)}")
    return DeepseekV4Config(**{**_BASE, **TINY_CONFIGS[name], **overrides})


@torch.no_grad()
def _randomize(model: torch.nn.Module, config, gen: torch.Generator) -> None:
    def normal(shape, std):
        return torch.randn(shape, generator=gen) * std

    for name, param in model.named_parameters():
        shape, leaf = param.shape, name.rsplit(".", 1)[-1]
        if "norm" in name:
            value = 1.0 + normal(shape, 0.1)
        elif leaf == "sinks":
            value = normal(shape, 1.0)
        elif leaf == "position_bias":
            value = normal(shape, 0.5)
        elif leaf in ("base", "hc_base"):
            value = normal(shape, 0.5)
        elif leaf in ("scale", "hc_scale"):
            value = 0.5 + torch.rand(shape, generator=gen)
        elif leaf in ("fn", "hc_fn"):
            value = normal(shape, 1.0 / math.sqrt(shape[-1]))
        elif name.endswith("embed_tokens.weight"):
            value = normal(shape, 1.0)
        elif param.dim() >= 2:
            value = normal(shape, 1.0 / math.sqrt(shape[-1]))
        else:
            value = normal(shape, 0.1)
        param.copy_(value)
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(normal(buf.shape, 0.1))
        elif name.endswith("tid2eid"):
            rows = [torch.randperm(config.n_routed_experts, generator=gen)[: config.num_experts_per_tok]
                    for _ in range(buf.shape[0])]
            buf.copy_(torch.stack(rows))


def build_tokenizer(path: Path, vocab_size: int) -> None:
    """Train a byte-level BPE of exactly ``vocab_size`` tokens on the embedded corpus and save it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<｜begin▁of▁sentence｜>", eos_token="<｜end▁of▁sentence｜>"
    )
    fast.save_pretrained(str(path))


def build_tiny_checkpoint(path: str | Path, name: str = "tiny", seed: int = 0, with_mtp: bool = True,
                          **overrides: Any) -> Path:
    """Write a random tiny DeepSeek-V4 (weights, config, tokenizer) into ``path``; deterministic per seed.

    With ``with_mtp`` the file also carries one MTP module (``mtp.0.*``, DeepSeek's layout), which
    transformers ignores when loading.
    """
    from transformers import DeepseekV4ForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = tiny_config(name, **overrides)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(config)
    _randomize(model, config, gen)
    model.save_pretrained(str(path))
    if with_mtp:
        _add_mtp(path, config, gen)
    build_tokenizer(path, config.vocab_size)
    (path / "deepinfer_tiny.json").write_text(json.dumps({"name": name, "seed": seed}))
    return path


def mtp_block_config(config):
    """A one-layer transformers config whose layer has the shapes of ``config``'s MTP block."""
    from transformers import DeepseekV4Config

    fields = {k: v for k, v in config.to_dict().items() if k in DeepseekV4Config.__dataclass_fields__}
    fields.update(num_hidden_layers=1, layer_types=["sliding_attention"], mlp_layer_types=["moe"])
    return DeepseekV4Config(**fields)


def _add_mtp(path: Path, config, gen: torch.Generator) -> None:
    """Append random ``mtp.0.*`` tensors: a sliding-window block plus e/h projections, norms, hc head."""
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV4ForCausalLM

    block = DeepseekV4ForCausalLM(mtp_block_config(config))
    _randomize(block, block.config, gen)
    with __import__("tempfile").TemporaryDirectory() as tmp:
        block.save_pretrained(tmp)
        block_tensors = load_file(str(Path(tmp) / "model.safetensors"))
    tensors = load_file(str(path / "model.safetensors"))
    d = config.hidden_size
    for key, value in block_tensors.items():
        if key.startswith("model.layers.0."):
            tensors["mtp.0." + key[len("model.layers.0."):]] = value
        elif key.startswith("model.hc_head."):
            tensors["mtp.0.hc_head_" + key.rsplit(".hc_", 1)[1]] = value
    tensors["mtp.0.e_proj.weight"] = torch.randn(d, d, generator=gen) / math.sqrt(d)
    tensors["mtp.0.h_proj.weight"] = torch.randn(d, d, generator=gen) / math.sqrt(d)
    for norm in ("enorm", "hnorm", "norm"):
        tensors[f"mtp.0.{norm}.weight"] = 1.0 + 0.1 * torch.randn(d, generator=gen)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def load_hf_mtp_reference(path: str | Path, dtype: torch.dtype = torch.float64):
    """A one-layer transformers model whose block, hc head and norm are the checkpoint's ``mtp.0``.

    Returns (model, e_proj, h_proj, enorm, hnorm) so a test can compute MTP logits independently.
    """
    import tempfile

    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, DeepseekV4ForCausalLM

    path = Path(path)
    tensors = load_file(str(path / "model.safetensors"))
    config = mtp_block_config(AutoConfig.from_pretrained(str(path)))
    config._experts_implementation = "eager"
    ref = {"model.embed_tokens.weight": tensors["model.embed_tokens.weight"], "head.weight": tensors["head.weight"]}
    for key, value in tensors.items():
        if key.startswith("mtp.0.hc_head_"):
            ref["model.hc_head.hc_" + key.rsplit("_", 1)[1]] = value
        elif key == "mtp.0.norm.weight":
            ref["model.norm.weight"] = value
        elif key.startswith("mtp.0.") and key.split(".")[2] not in ("e_proj", "h_proj", "enorm", "hnorm"):
            ref["model.layers.0." + key[len("mtp.0."):]] = value
    with tempfile.TemporaryDirectory() as tmp:
        config.save_pretrained(tmp)
        save_file(ref, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
        model = DeepseekV4ForCausalLM.from_pretrained(tmp, config=config, dtype=torch.float32).to(dtype).eval()
    extra = [tensors[f"mtp.0.{n}.weight"].to(dtype) for n in ("e_proj", "h_proj", "enorm", "hnorm")]
    return (model, *extra)


def load_hf_model(path: str | Path, dtype: torch.dtype = torch.float64):
    """The transformers reference model for ``path`` in ``dtype`` (eager experts so float64 works)."""
    from transformers import AutoConfig, DeepseekV4ForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    config._experts_implementation = "eager"
    model = DeepseekV4ForCausalLM.from_pretrained(str(path), config=config, dtype=torch.float32)
    return model.to(dtype).eval()

"""DeepSeek-V4.1's vision path against DeepSeek's own reference code: ``inference/image_processor.py`` and
``inference/vision.py`` of the release folder beside the repository (:mod:`v41_reference`).

The image processor's resize plan is compared over a sweep of sizes at the release's settings and at a
small token budget (whose thin-image branches the release's budget rarely reaches), its patches bit for
bit on real images. The tower (ViT + aligner) runs on random weights in float32 and float64 against
vision.py's modules holding the same weights.
"""

from __future__ import annotations

import functools
import io
import types

import engine_fixtures
import pytest
import torch
import v41_reference as ref
from PIL import Image

from deepinfer_core.models.deepseek_v41.image_processor import (
    ImageError,
    VisionConfig,
    plan_grid,
    preprocess,
    span_types,
)
from deepinfer_core.models.deepseek_v41.vision import VisionTower
from deepinfer_core.plugins import build_op_table

pytestmark = pytest.mark.skipif(not ref.reference_present(), reason=f"{ref.REFERENCE_DIR} not present")

#: the release's vision_config
RELEASE = VisionConfig(num_hidden_layers=32, hidden_size=1024, num_heads=16, intermediate_size=2816, patch_size=14,
                       rope_theta=10000.0, downsample_ratio=3, max_image_tokens=1024, min_pixels=295936)
#: a tower small enough for the CPU: head_dim 16 (4 rotation frequencies per axis), 2 blocks
TINY = VisionConfig(num_hidden_layers=2, hidden_size=64, num_heads=4, intermediate_size=96, patch_size=14,
                    rope_theta=10000.0, downsample_ratio=3, max_image_tokens=40, min_pixels=42 * 42)
MODEL_DIM = 128


one_torch_thread = engine_fixtures.one_torch_thread  # one intra-op thread: the tiny model's ops are faster


def reference_args(vc: VisionConfig, dim: int = MODEL_DIM) -> types.SimpleNamespace:
    """model.py's ModelArgs vision fields (flat names) for ``vc``."""
    return types.SimpleNamespace(
        vision_n_layers=vc.num_hidden_layers, vision_dim=vc.hidden_size, vision_n_heads=vc.num_heads,
        vision_inter_dim=vc.intermediate_size, vision_patch_size=vc.patch_size, vision_rope_theta=vc.rope_theta,
        vision_downsample_ratio=vc.downsample_ratio, vision_max_n_token=vc.max_image_tokens,
        vision_min_pixels=vc.min_pixels, vision_max_wh_ratio=vc.max_wh_ratio, dim=dim)


def image_bytes(width: int, height: int, seed: int = 0, fmt: str = "PNG") -> bytes:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()


# --- the image processor ---------------------------------------------------------------------------


SIZES = [(w, h) for w in (1, 7, 14, 41, 100, 543, 544, 545, 1000, 1920, 4000, 12000)
         for h in (1, 3, 14, 42, 99, 544, 768, 1080, 3000, 20000)]


@pytest.mark.parametrize("vc", [RELEASE, TINY, VisionConfig(**{**vars(TINY), "max_wh_ratio": 4})],
                         ids=["release", "tiny", "tiny_wh4"])
def test_the_resize_plan_is_image_processor_py_s(vc):
    ip = ref.load_reference_module("image_processor")
    args = reference_args(vc)
    for width, height in SIZES:
        n_llm_h, n_llm_w, best_h, best_w = ip.plan_image_grid(width, height, args)
        grid = plan_grid(width, height, vc)
        assert (grid.n_llm_h, grid.n_llm_w, grid.height, grid.width) == (n_llm_h, n_llm_w, best_h, best_w), \
            (width, height)
        assert grid.num_tokens == ip.num_image_tokens(n_llm_h, n_llm_w) <= vc.max_image_tokens
        assert torch.equal(span_types(grid.n_llm_h, grid.n_llm_w), ip.image_token_types(n_llm_h, n_llm_w))


@pytest.mark.parametrize("size", [(640, 480), (200, 90), (30, 700), (1500, 1499)])
@pytest.mark.parametrize("vc", [RELEASE, TINY], ids=["release", "tiny"])
def test_patches_are_image_processor_py_s_bit_for_bit(size, vc):
    ip = ref.load_reference_module("image_processor")
    data = image_bytes(*size, seed=size[0])
    patches, n_vit_h, n_vit_w, n_llm_h, n_llm_w = ip.load_image({"data": data}, reference_args(vc))
    for source in (data, Image.open(io.BytesIO(data))):
        image = preprocess(source, vc)
        g = image.grid
        assert (g.n_vit_h, g.n_vit_w, g.n_llm_h, g.n_llm_w) == (n_vit_h, n_vit_w, n_llm_h, n_llm_w)
        assert image.patches.dtype == patches.dtype == torch.bfloat16
        assert torch.equal(image.patches, patches)


def test_the_hash_follows_the_pixels():
    a, b = image_bytes(300, 200, seed=1), image_bytes(300, 200, seed=2)
    assert preprocess(a, TINY).mm_hash == preprocess(Image.open(io.BytesIO(a)), TINY).mm_hash
    assert preprocess(a, TINY).mm_hash != preprocess(b, TINY).mm_hash
    assert preprocess(image_bytes(300, 200, seed=1, fmt="BMP"), TINY).mm_hash == preprocess(a, TINY).mm_hash


def test_unreadable_and_oversized_images_are_image_errors(monkeypatch):
    with pytest.raises(ImageError, match="not an image"):
        preprocess(b"definitely not a png", TINY)
    with pytest.raises(ImageError, match="could not be decoded"):
        preprocess(image_bytes(50, 50)[:60], TINY)  # truncated
    with pytest.raises(ImageError, match="PIL.Image.Image or encoded bytes"):
        preprocess("picture.png", TINY)
    import deepinfer_core.models.deepseek_v41.image_processor as ipm

    monkeypatch.setattr(ipm, "MAX_SOURCE_PIXELS", 100 * 100)
    with pytest.raises(ImageError, match="101x100 pixels"):
        preprocess(image_bytes(101, 100), TINY)


# --- the tower -------------------------------------------------------------------------------------


def reference_tower(vc: VisionConfig, dtype: torch.dtype, seed: int = 0):
    """vision.py's ViT and Aligner for ``vc`` with random weights (norm weights off one too), in ``dtype``,
    and the same tensors by checkpoint name (with random span delimiters)."""
    vision = ref.load_reference_module("vision")
    args = reference_args(vc)
    torch.manual_seed(seed)
    vit, aligner = vision.ViT(args), vision.Aligner(args)
    tensors = {}
    for prefix, module in (("vision.", vit), ("aligner.", aligner)):
        for name, p in module.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight") or ".norm" in name:
                    p.copy_(1 + 0.2 * torch.randn_like(p))
                elif name.endswith("bias"):
                    p.copy_(0.1 * torch.randn_like(p))
            tensors[prefix + name] = p.detach()
        module.to(dtype)
    for name in ("image_start", "image_end", "image_newline"):
        tensors[name] = torch.randn(MODEL_DIM)
    return vit, aligner, {k: v.to(dtype) for k, v in tensors.items()}


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.float64, 1e-12)], ids=["float32", "float64"])
@pytest.mark.parametrize("size", [(120, 80), (50, 300), (90, 90)])
def test_tower_equals_vision_py(size, dtype, tol):
    """Random weights: the aligner's rows to ``tol`` of their largest magnitude (measured: at most 4.7e-7 in
    float32, 8.6e-16 in float64), for patch grids of 6x9, 22x4 and 7x7 (none a
    multiple of the 3x3 cell: the aligner pads)."""
    vit, aligner, tensors = reference_tower(TINY, dtype)
    ops = build_op_table("cpu_ref", dtype=dtype)
    tower = VisionTower(TINY, tensors, ops, dtype)
    image = preprocess(image_bytes(*size, seed=3), TINY)
    g = image.grid
    # float64: vision.py's ".float()" steps (RoPE, RMSNorm) kept in float64, as the model harness does
    with torch.inference_mode(), ref.ReferenceMode(widen=dtype == torch.float64):
        theirs = aligner(vit(image.patches.to(dtype), g.n_vit_h, g.n_vit_w), g.n_vit_h, g.n_vit_w)
    ours = tower.encode(image)
    assert ours.shape == (g.n_llm_h * g.n_llm_w, MODEL_DIM) == theirs.shape
    diff = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    assert diff <= tol, f"{size} grid {g}: max rel diff {diff:.2e}"


def test_span_embeddings_put_the_delimiters_around_the_rows():
    """[START] (rows of one grid line, NEWLINE) per line [END], as model.py's merge_image_embeddings."""
    _, _, tensors = reference_tower(TINY, torch.float32)
    tower = VisionTower(TINY, tensors, build_op_table("cpu_ref", dtype=torch.float32), torch.float32)
    image = preprocess(image_bytes(120, 80, seed=4), TINY)
    g = image.grid
    span = tower.span_embeddings(image)
    rows = tower.encode(image)
    assert span.shape == (g.num_tokens, MODEL_DIM)
    assert torch.equal(span[0], tensors["image_start"]) and torch.equal(span[-1], tensors["image_end"])
    lines = span[1:-1].view(g.n_llm_h, g.n_llm_w + 1, MODEL_DIM)
    assert torch.equal(lines[:, -1], tensors["image_newline"].expand(g.n_llm_h, -1))
    assert torch.equal(lines[:, :-1].reshape(-1, MODEL_DIM), rows)


# --- the model with images -------------------------------------------------------------------------

#: a prompt of text, two image spans and text, then text fed one token at a time: (kind, length or size)
LAYOUT = [("text", 5), ("image", (150, 100)), ("text", 6), ("image", (80, 200)), ("text", 4)]
DECODE = 6


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    from deepinfer_core.testing.tiny_v41 import build_tiny_v41

    return build_tiny_v41(tmp_path_factory.mktemp("v41vl") / "tiny", seed=2, vision=True)


def vl_prompt(image_token_id: int):
    """(token ids, token types, [(offset, encoded image bytes)]) of :data:`LAYOUT` plus the decoded tokens,
    with the spans' lengths as the tiny tower's processor plans them."""
    from deepinfer_core.testing.tiny_v41 import TINY_V41_VISION

    vc = VisionConfig.of(TINY_V41_VISION)
    g = torch.Generator().manual_seed(11)
    ids, token_types, images = [], [], []
    for kind, what in LAYOUT + [("text", DECODE)]:
        if kind == "text":
            ids += torch.randint(5, 3900, (what,), generator=g).tolist()
            token_types += [-1] * what
        else:
            data = image_bytes(*what, seed=what[0])
            grid = plan_grid(*what, vc)
            images.append((len(ids), data))
            ids += [image_token_id] * grid.num_tokens
            token_types += span_types(grid.n_llm_h, grid.n_llm_w).tolist()
    return ids, torch.tensor(token_types), images


@functools.lru_cache(maxsize=2)
def reference_vl_logits(path, quant: bool) -> tuple[torch.Tensor, int]:
    """model.py's logits of every position of the prompt (one prefill with both images, as model.py requires)
    and of the decoded tokens; and the prefill's length."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, PretrainedConfig

    from deepinfer_core.config import ModelConfig

    cfg = ModelConfig.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(str(path), config=PretrainedConfig())
    model = ref.load_reference(cfg.to_flat(), load_file(str(path / "model.safetensors")), tokenizer, quant,
                               torch.float32, max_seq_len=64)
    ip = ref.load_reference_module("image_processor")
    ids, token_types, images = vl_prompt(cfg.image_token_id)
    prefill = len(ids) - DECODE
    inputs = []
    for offset, data in images:
        patches, n_vit_h, n_vit_w, n_llm_h, n_llm_w = ip.load_image({"data": data}, model.reference_args)
        inputs.append(types.SimpleNamespace(start=offset, patches=patches, n_vit_h=n_vit_h, n_vit_w=n_vit_w,
                                            types=ip.image_token_types(n_llm_h, n_llm_w)))
    out = []
    with torch.random.fork_rng(devices=[]), ref._all_positions(model.head):
        _, logits, _ = model.forward(torch.tensor([ids[:prefill]]), 0, images=[inputs],
                                     token_types=token_types[None, :prefill])
        out.extend(logits[0].double())
        for i in range(prefill, len(ids)):
            _, logits, _ = model.forward(torch.tensor([[ids[i]]]), i)
            out.append(logits[0, -1].double())
    return torch.stack(out), prefill


def engine_vl_logits(model, schedule: list[int]) -> torch.Tensor:
    """Every position's logits, the prompt fed in steps of ``schedule`` tokens (cutting image spans where a
    step ends inside one), then one at a time; each step carries the image rows of its positions and each
    span's n-gram history marks image positions DEAD."""
    from deepinfer_core.model.metadata import DEAD, MultiModalEmbeds, SeqSpan, build_forward_batch
    from deepinfer_core.testing.model_runner import SimpleRunner

    ids, token_types, images = vl_prompt(model.cfg.image_token_id)
    vc = VisionConfig.of(model.cfg.vision_config)
    spans = [(offset, model.embed_image(preprocess(data, vc))) for offset, data in images]
    dead = token_types >= 0
    runner = SimpleRunner(model, 1, 64, block_size=8)
    n, out, pos = model.ngram_size, [], 0
    for step in schedule + [1] * len(ids):
        if pos >= len(ids):
            break
        end = min(pos + step, len(ids))
        first = max(0, pos - n + 1)
        history = [DEAD if dead[p] else ids[p] for p in range(first, pos)]
        span = SeqSpan(pos, end - pos, runner.table(0), runner.table(0), 0, history=history)
        batch = build_forward_batch(ids[pos:end], [span], model.compressor_specs(), 8, model.cfg.sliding_window,
                                    logits_indices=list(range(end - pos)), ngram=n)
        rows, embeds = [], []
        for offset, emb in spans:
            lo, hi = max(pos, offset), min(end, offset + emb.shape[0])
            if lo < hi:
                rows.append(torch.arange(lo, hi) - pos)
                embeds.append(emb[lo - offset:hi - offset])
        if rows:
            batch.mm = MultiModalEmbeds(torch.cat(rows), torch.cat(embeds))
        logits, _ = model.forward(batch, runner.cache)
        out.append(logits)
        pos = end
    return torch.cat(out).double()


VL_SCHEDULES = {"whole": [10_000], "chunks_7": [7] * 20, "chunks_5": [5] * 20}


@pytest.mark.parametrize("schedule", sorted(VL_SCHEDULES))
def test_a_prompt_with_two_images_gives_model_py_s_logits(tiny_vl, schedule):
    """Float32, quantisation off on both sides: two image spans (17 positions each) among text, the tower's
    rows and delimiters at their positions, ``bias_vl`` routing them, Engram treating them as dead; every
    position's logits to 1e-5 of the reference's largest (measured: max 1.8e-6, median 9.4e-7). model.py
    prefills the prompt whole; here the prompt is also cut in chunks of 7 and 5, which split both images."""
    from deepinfer_core.models import load_model

    theirs, _ = reference_vl_logits(tiny_vl, quant=False)
    model = load_model(tiny_vl, dtype=torch.float32, numerics="unquantised")
    assert model.vision is not None and model.weights.layers[0].moe.gate.bias_vl is not None
    ours = engine_vl_logits(model, VL_SCHEDULES[schedule])
    diff = (ours - theirs).abs().max(-1).values / theirs.abs().max()
    assert diff.max() <= 1e-5, f"max rel diff {diff.max():.2e} at position {int(diff.argmax())}"
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


DELTAS = {
    "text_bias_for_images": lambda m: setattr(m, "route", lambda g, x, k, mask, f=m.route: f(g, x, k, None)),
    "engram_gate_on_images": lambda m: setattr(m, "engram", lambda e, s, r, mask=None, f=m.engram: f(e, s, r)),
    "images_alive_in_ngrams": lambda m: setattr(m, "engram_rows", lambda b, mask=None, f=m.engram_rows: f(b)),
}


@pytest.mark.parametrize("delta", sorted(DELTAS))
def test_the_oracle_catches_each_image_rule_undone(tiny_vl, delta):
    """Each of the three image rules undone moves the logits by far more than the tolerance (measured: 0.97,
    1.2 and 0.77 of the logit scale)."""
    from deepinfer_core.models import load_model

    theirs, _ = reference_vl_logits(tiny_vl, quant=False)
    model = load_model(tiny_vl, dtype=torch.float32, numerics="unquantised")
    DELTAS[delta](model)
    diff = (engine_vl_logits(model, [10_000]) - theirs).abs().max(-1).values / theirs.abs().max()
    assert diff.max() > 0.1, f"{delta}: max rel diff only {diff.max():.2e}"

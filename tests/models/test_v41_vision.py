"""DeepSeek-V4.1's vision path against DeepSeek's own reference code: ``inference/image_processor.py`` and
``inference/vision.py`` of the release folder beside the repository (:mod:`v41_reference`).

The image processor's resize plan is compared over a sweep of sizes at the release's settings and at a
small token budget (whose thin-image branches the release's budget rarely reaches), its patches bit for
bit on real images. The tower (ViT + aligner) runs on random weights in float32 and float64 against
vision.py's modules holding the same weights.
"""

from __future__ import annotations

import io
import types

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

"""DeepSeek-V4.1's vision tower over resolved ops: the ViT, the aligner, and the embeddings of a whole image
span (the learned delimiters around the aligner's rows).

The ViT (``vision.*``): a linear patch embedding, blocks of RMSNorm -> attention -> RMSNorm -> SwiGLU MLP
with residuals, a final RMSNorm. Attention is bidirectional over one image's patches (``encoder_attention``)
with a 2D RoPE: of each head's ``head_dim / 2`` rotation angles the first half turn with the patch's row,
the second half with its column. The aligner (``aligner.*``) concatenates each ``downsample_ratio``-square
of patch features (the grid zero-padded at its bottom and right edges), then Linear -> GELU -> Linear to
the model width. Same semantics as the release's ``inference/vision.py``.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

from deepinfer_core.models.deepseek_v41.image_processor import (
    IMAGE,
    IMAGE_END,
    IMAGE_NEW_LINE,
    IMAGE_START,
    VISION_NORM_EPS,
    ImageSpan,
    VisionConfig,
    span_types,
)
from deepinfer_core.ops import OpTable
from deepinfer_core.ops.native import acc_dtype

#: the checkpoint's learned span delimiters, by the token type they fill
DELIMITERS = {IMAGE_START: "image_start", IMAGE_NEW_LINE: "image_newline", IMAGE_END: "image_end"}


@lru_cache(8)
def _pair_order(head_dim: int) -> torch.Tensor:
    """The channel order that makes the release's rotate-half pairs (i, i + head_dim/2) adjacent, as the
    catalogue's interleaved ``rotary_emb`` pairs them. Queries and keys are reordered alike, so their dot
    products, and with them the attention, are unchanged; values are not reordered."""
    half = head_dim // 2
    return torch.stack([torch.arange(half), torch.arange(half) + half], dim=-1).flatten()


def rope_angles(n_h: int, n_w: int, head_dim: int, theta: float, dtype: torch.dtype = torch.float32
                ) -> torch.Tensor:
    """[n_h * n_w, head_dim / 2] angles in reading order: ``head_dim / 4`` frequencies
    ``theta^(-4i / head_dim)``, times the row, then times the column."""
    quarter = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, quarter, 2, dtype=dtype) / quarter))
    rows = torch.arange(n_h, dtype=dtype).repeat_interleave(n_w)
    cols = torch.arange(n_w, dtype=dtype).repeat(n_h)
    return torch.cat([rows[:, None] * inv_freq, cols[:, None] * inv_freq], dim=-1)


class VisionTower:
    """The ViT and aligner of ``tensors`` (checkpoint names, the model's dtype) run through ``ops``."""

    def __init__(self, vc: VisionConfig, tensors: dict[str, torch.Tensor], ops: OpTable, dtype: torch.dtype):
        self.vc, self.ops, self.dtype = vc, ops, dtype
        self.t = tensors
        self.device = tensors["vision.patch_embed.proj.weight"].device

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return self.ops.linear(x, self.t[f"{name}.weight"], self.t.get(f"{name}.bias"))

    def vit(self, patches: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        """[n_h * n_w, hidden] patch features of one image's patches [n_h * n_w, 3, p, p]."""
        ops, vc, n = self.ops, self.vc, patches.shape[0]
        heads, hd = vc.num_heads, vc.head_dim
        x = self.linear(patches.reshape(n, -1).to(self.device, self.dtype), "vision.patch_embed.proj")
        angles = rope_angles(n_h, n_w, hd, vc.rope_theta, acc_dtype(self.dtype)).to(self.device)
        cos, sin = angles.cos().to(self.dtype), angles.sin().to(self.dtype)
        order = _pair_order(hd).to(self.device)
        for b in range(vc.num_hidden_layers):
            p = f"vision.blocks.{b}."
            h = ops.rms_norm(x, self.t[p + "norm1.weight"], VISION_NORM_EPS)
            q, k, v = self.linear(h, p + "attn.wqkv").view(n, 3, heads, hd).unbind(1)
            q = ops.rotary_emb(q[..., order], cos, sin, False)
            k = ops.rotary_emb(k[..., order], cos, sin, False)
            o = ops.encoder_attention(q[None], k[None], v[None], hd**-0.5)[0]
            x = x + self.linear(o.reshape(n, -1), p + "attn.wo")
            h = ops.rms_norm(x, self.t[p + "norm2.weight"], VISION_NORM_EPS)
            gate_up = ops.linear(h, self.t[p + "mlp.w1.weight"])
            x = x + ops.linear(ops.swiglu(gate_up, float("inf")), self.t[p + "mlp.w2.weight"])
        return ops.rms_norm(x, self.t["vision.norm.weight"], VISION_NORM_EPS)

    def align(self, features: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        """[ceil(n_h / r) * ceil(n_w / r), D] token rows in reading order: each r x r cell's features
        concatenated channel-major (channel, row in the cell, column in the cell)."""
        r = self.vc.downsample_ratio
        grid = features.view(n_h, n_w, -1)
        grid = F.pad(grid, (0, 0, 0, -n_w % r, 0, -n_h % r))
        rows, cols, c = grid.shape[0] // r, grid.shape[1] // r, grid.shape[2]
        cells = grid.view(rows, r, cols, r, c).permute(0, 2, 4, 1, 3).reshape(rows * cols, c * r * r)
        h = self.linear(cells, "aligner.w1")
        # exact (erf) GELU, in at least float32; an elementwise step with no op of its own
        h = F.gelu(h.to(acc_dtype(h.dtype))).to(h.dtype)
        return self.linear(h, "aligner.w2")

    @torch.inference_mode()
    def encode(self, image: ImageSpan) -> torch.Tensor:
        """The aligner's rows of one preprocessed image: [n_llm_h * n_llm_w, D]."""
        g = image.grid
        return self.align(self.vit(image.patches, g.n_vit_h, g.n_vit_w), g.n_vit_h, g.n_vit_w)

    @torch.inference_mode()
    def span_embeddings(self, image: ImageSpan) -> torch.Tensor:
        """[image.num_tokens, D]: what the language model reads at the image's span, every position in
        order (the delimiters' learned vectors, the aligner's rows at the IMAGE positions)."""
        rows = self.encode(image)
        types = span_types(image.grid.n_llm_h, image.grid.n_llm_w).to(self.device)
        out = torch.empty(types.numel(), rows.shape[-1], dtype=self.dtype, device=self.device)
        out[types == IMAGE] = rows.to(self.dtype)
        for kind, name in DELIMITERS.items():
            out[types == kind] = self.t[name].to(self.dtype)
        return out


__all__ = ["DELIMITERS", "VisionTower", "rope_angles"]

"""FP4 (e2m1) unpacking: the CPU's byte-pair table gives, for every byte, the values of its two nibbles
that the per-nibble lookup (the path other devices take) gives, in every dtype."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.quant.fp4 import (
    E2M1_VALUES,
    _build_e2m1_table,
    dequantize_fp4_block,
    quantize_fp4_block,
    unpack_fp4,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
def test_every_byte_unpacks_to_its_two_nibbles_values(dtype):
    packed = torch.arange(256, dtype=torch.uint8).reshape(4, 8, 8)
    table = _build_e2m1_table("cpu", dtype)
    want = torch.stack([table[(packed & 0x0F).long()], table[(packed >> 4).long()]], dim=-1).flatten(-2)
    got = unpack_fp4(packed, dtype)
    assert got.dtype == dtype and got.shape == (4, 8, 16) and torch.equal(got, want)
    assert torch.equal(unpack_fp4(packed.view(torch.int8), dtype), want)  # int8 storage reads as bytes
    assert table.tolist() == [float(v) for v in E2M1_VALUES]


def test_fp4_expert_keeps_each_dequantised_expert_until_the_stack_changes(monkeypatch):
    """The reference ops' dequantised experts are kept per stack, and dropped when the stack or its scales
    change in place (an EPLB move), or never kept for a stack past the size limit."""
    from deepinfer_core.quant import fp4

    packed, scale = quantize_fp4_block(torch.randn(3, 8, 64, generator=torch.Generator().manual_seed(0)))
    get = fp4.fp4_expert(packed, scale)
    first = get(1, torch.float64)
    assert get(1, torch.float64) is first and fp4.fp4_expert(packed, scale)(1, torch.float64) is first
    assert torch.equal(first, dequantize_fp4_block(packed[1], scale[1], torch.float64))
    packed[1].copy_(packed[2])
    scale[1].copy_(scale[2])  # expert 2's weights moved into slot 1
    moved = fp4.fp4_expert(packed, scale)(1, torch.float64)
    assert torch.equal(moved, dequantize_fp4_block(packed[2], scale[2], torch.float64))
    assert not torch.equal(moved, first)
    monkeypatch.setattr(fp4, "EXPERT_CACHE_BYTES", 0)
    big = fp4.fp4_expert(packed, scale)
    assert big(0, torch.float32) is not big(0, torch.float32)

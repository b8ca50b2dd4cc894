"""FP4 (e2m1) unpacking: the CPU's byte-pair table gives, for every byte, the values of its two nibbles
that the per-nibble lookup (the path other devices take) gives, in every dtype."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.quant.fp4 import E2M1_VALUES, _build_e2m1_table, unpack_fp4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
def test_every_byte_unpacks_to_its_two_nibbles_values(dtype):
    packed = torch.arange(256, dtype=torch.uint8).reshape(4, 8, 8)
    table = _build_e2m1_table("cpu", dtype)
    want = torch.stack([table[(packed & 0x0F).long()], table[(packed >> 4).long()]], dim=-1).flatten(-2)
    got = unpack_fp4(packed, dtype)
    assert got.dtype == dtype and got.shape == (4, 8, 16) and torch.equal(got, want)
    assert torch.equal(unpack_fp4(packed.view(torch.int8), dtype), want)  # int8 storage reads as bytes
    assert table.tolist() == [float(v) for v in E2M1_VALUES]

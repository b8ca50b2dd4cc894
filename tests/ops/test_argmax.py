"""The two-pass argmax gives ``torch.argmax``'s index: the first of equal maxima, within and across slices."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.sampling.argmax import GROUPS, argmax


@pytest.mark.parametrize("shape", [(1, 129280), (3, 4, 2048), (16, GROUPS)])
def test_two_pass_argmax_is_torch_argmax(shape):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g)
    assert torch.equal(argmax(x, two_pass=True), x.argmax(dim=-1))
    ties = torch.zeros(shape)  # every element a maximum: index 0
    assert torch.equal(argmax(ties, two_pass=True), ties.argmax(dim=-1))
    width = shape[-1]
    slice_ = width // GROUPS
    spread = torch.randint(0, 3, shape, generator=g).float()  # many maxima in many slices
    spread.view(-1, width)[:, slice_ * (GROUPS - 1)] = 2.0  # one in the last slice too
    want = spread.argmax(dim=-1)
    assert torch.equal(argmax(spread, two_pass=True), want)
    late = torch.zeros(shape)
    late[..., -1] = 1.0  # the last element of the last slice
    assert (argmax(late, two_pass=True) == width - 1).all()


def test_argmax_picks_its_path():
    x = torch.randn(2, 129280)
    assert torch.equal(argmax(x), x.argmax(dim=-1))  # on the CPU: one pass
    assert torch.equal(argmax(x.double(), two_pass=False), x.argmax(dim=-1))

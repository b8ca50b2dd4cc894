"""The ``engram_lookup`` Triton kernel (:mod:`deepinfer_nvidia_sm100.engram_ops`) against the core's native body,
with the table on the device, in pinned host memory read in place over unified addressing, in a registered
``/dev/shm`` mapping (one copy per node), and as a view of a safetensors file's mapping (gathered on the host);
a sharded table (``row_start``); capture in a CUDA graph with a host table; and the tiny V4.1 loaded with
each placement on the GPU: bit-identical logits, host tables pinned and never on the device.

Not run where it was written (no GPU there): it skips without CUDA.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gpu_support import BACKEND, gpu_marks

from deepinfer_core.model.mapped import file_view, residence, shared_host_tensor
from deepinfer_core.ops.native import engram_lookup as native

pytestmark = gpu_marks()

ROWS, D, COLS, TOKENS = 50_000, 256, 24, 64


def _table(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.randint(0, 0x7F, (ROWS, D), dtype=torch.uint8, generator=gen)
    codes |= torch.randint(0, 2, (ROWS, D), dtype=torch.uint8, generator=gen) << 7
    scale = torch.randint(100, 140, (ROWS, D // 32), dtype=torch.uint8, generator=gen)
    return codes.view(torch.float8_e4m3fn), scale.view(torch.float8_e8m0fnu)


@pytest.fixture(scope="module")
def table():
    return _table(torch.Generator().manual_seed(0))


def _ids(gen_seed: int = 1) -> torch.Tensor:
    ids = torch.randint(0, ROWS, (TOKENS, COLS), generator=torch.Generator().manual_seed(gen_seed))
    ids[0, :2] = torch.tensor([0, ROWS - 1])
    return ids


def _kernel():
    from deepinfer_nvidia_sm100.engram_ops import engram_lookup

    return engram_lookup


@pytest.mark.parametrize("where", ["device", "pinned", "shm"])
def test_the_kernel_reads_each_placement_bit_for_bit(table, where):
    weight, scale = table
    expected = native(_ids(), weight, scale, 0)
    if where == "device":
        weight, scale = weight.cuda(), scale.cuda()
    elif where == "pinned":
        weight, scale = weight.pin_memory(), scale.pin_memory()
    else:
        w = shared_host_tensor("deepinfer-engram-gpu-test", tuple(weight.shape), weight.dtype, create=True)
        s = shared_host_tensor("deepinfer-engram-gpu-test-scale", tuple(scale.shape), scale.dtype, create=True)
        w.copy_(weight), s.copy_(scale)
        weight, scale = w, s
    out = _kernel()(_ids().cuda(), weight, scale, 0)
    assert out.is_cuda and torch.equal(out.cpu(), expected)
    if where != "device":
        assert weight.device.type == "cpu"  # read in place: never copied to the device


def test_a_shard_gives_zero_rows_for_the_other_ranks_ids(table):
    weight, scale = table
    start, stop = ROWS // 3, 2 * ROWS // 3
    shard_w, shard_s = weight[start:stop].clone().pin_memory(), scale[start:stop].clone().pin_memory()
    out = _kernel()(_ids().cuda(), shard_w, shard_s, start)
    assert torch.equal(out.cpu(), native(_ids(), weight[start:stop], scale[start:stop], start))


def test_a_file_view_is_gathered_on_the_host(table, tmp_path):
    from safetensors.torch import save_file

    weight, scale = table
    save_file({"w": weight, "s": scale}, str(tmp_path / "t.safetensors"))
    w, s = file_view(tmp_path / "t.safetensors", "w"), file_view(tmp_path / "t.safetensors", "s")
    out = _kernel()(_ids().cuda(), w, s, 0)
    assert out.is_cuda and torch.equal(out.cpu(), native(_ids(), weight, scale, 0))
    assert residence(w) == str((tmp_path / "t.safetensors").resolve())


def test_the_host_lookup_is_captured_in_a_cuda_graph(table):
    weight, scale = (t.pin_memory() for t in table)
    ids = _ids().cuda()
    fn = _kernel()
    fn(ids, weight, scale, 0)  # the alias is made outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(ids, weight, scale, 0)
    ids.copy_(_ids(2).cuda())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), native(_ids(2), *table, 0))


def test_the_tiny_v41_gives_the_same_logits_with_each_placement_on_the_gpu(tmp_path):
    from deepinfer_core.models import load_model
    from deepinfer_core.testing.model_runner import SimpleRunner
    from deepinfer_core.testing.tiny_v41 import build_tiny_v41

    path = build_tiny_v41(tmp_path / "v41", seed=2, with_drafter=False)
    ids = list(range(5, 25))
    runs, tables = {}, {}
    for placement in ("device", "host", "file"):
        model = load_model(path, backend=BACKEND, dtype=torch.float32, device="cuda", engram_placement=placement)
        runs[placement] = SimpleRunner(model, 1, 64, block_size=8).step({0: ids}, all_logits=True)[0].cpu()
        tables[placement] = [b.engram.table.weight for b in model.weights.layers if b.engram is not None]
    assert torch.equal(runs["host"], runs["device"]) and torch.equal(runs["file"], runs["device"])
    assert all(t.is_cuda for t in tables["device"])
    assert all(t.device.type == "cpu" and t.is_pinned() for t in tables["host"])
    assert all(residence(t) == str((Path(path) / "model.safetensors").resolve()) for t in tables["file"])

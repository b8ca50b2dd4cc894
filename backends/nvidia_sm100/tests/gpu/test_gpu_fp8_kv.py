"""The Triton ``sparse_attention_fp8`` (``triton_ops.sparse_attention_fp8``;
``DEEPINFER_NVIDIA_FP8_KV_TRITON=0`` turns it off) called directly on the GPU at DeepSeek-V4-Flash decode shapes (64
heads x 512, rope 64, 584-byte bf16 entries; batch 1, 16 and 64, each token a window list of 128 and 512
compressed indices), against the core's native body on the same GPU, and its capture in a CUDA graph.

Pools: every sequence owns 128 window rows and 2048 compressed rows (an 8k context at rate 4); rows no
list points at hold 0xFF bytes (NaN codes and scales) and must never be read. Every seventh compressed
slot is -1; with more than one sequence the first is short: half its window slots and all its compressed
slots are -1. KV values: randn with a power-of-two
size per 64-value group (2^-6 .. 2^2: the entries' scales differ), so outputs stay O(1).

Errors, per element, relative to the largest |reference| of the (token, head) row, against the native
body in float64 on the same entries: :data:`TOL`, which the native body in the queries' dtype must meet as
well. Measured on the CPU under Triton's interpreter with 600 compressed rows per sequence (batch 1 and 3):
float32 1.9e-6 (the native body in float32 2.6e-6: 640 keys of logits up to ~10), bfloat16 9.3e-3 (the
native body 3.5e-3; the interpreter truncates float32-to-bfloat16 casts, a compiled kernel rounds to
nearest); bfloat16 against the dense Triton kernel on the decoded rows 2.8e-3, up to 0.7% of the elements
differing (a bfloat16 probability rounding the other way).
"""

from __future__ import annotations

import pytest
import torch
from gpu_support import gpu_marks, run_without_host_sync

from deepinfer_core.ops import native
from deepinfer_core.quant.kv_fp8 import pack_kv_fp8, unpack_kv_fp8

pytestmark = gpu_marks()

HEADS, HEAD_DIM, ROPE_DIM = 64, 512, 64
WINDOW, TOPK, COMPRESSED_PER_SEQ = 128, 512, 2048
TOL = {torch.float32: 1e-5, torch.bfloat16: 2.5e-2}
MIN_COSINE = {torch.float32: 1 - 1e-12, torch.bfloat16: 1 - 2e-5}


def _pool(g: torch.Generator, rows: int, used: torch.Tensor, device) -> torch.Tensor:
    kv = torch.randn(used.numel(), HEAD_DIM, generator=g, device=device)
    size = torch.exp2(torch.randint(-6, 3, (used.numel(), 7), generator=g, device=device).float())
    kv[:, :448] *= size.repeat_interleave(64, dim=1)
    pool = torch.full((rows, 584), 0xFF, dtype=torch.uint8, device=device)
    pool[used] = pack_kv_fp8(kv.bfloat16(), ROPE_DIM)
    return pool


def decode_case(batch: int, seed: int, device, dtype: torch.dtype = torch.bfloat16) -> tuple:
    """``sparse_attention_fp8``'s arguments for one decode step of ``batch`` sequences."""
    g = torch.Generator(device=device).manual_seed(seed)
    seq = torch.arange(batch, device=device)
    windices = seq[:, None] * WINDOW + torch.arange(WINDOW, device=device)
    cindices = seq[:, None] * COMPRESSED_PER_SEQ + torch.stack(
        [torch.randperm(COMPRESSED_PER_SEQ, generator=g, device=device)[:TOPK] for _ in range(batch)])
    cindices[:, 1::7] = -1  # ragged lists
    if batch > 1:  # the first sequence is short: half a window, nothing compressed yet
        windices[0, WINDOW // 2:] = -1
        cindices[0] = -1
    wpool = _pool(g, batch * WINDOW, windices[windices >= 0], device)
    cpool = _pool(g, batch * COMPRESSED_PER_SEQ, cindices[cindices >= 0].unique(), device)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=g, device=device).to(dtype)
    sinks = torch.randn(HEADS, generator=g, device=device)
    return q, wpool, windices, sinks, HEAD_DIM**-0.5, ROPE_DIM, torch.bfloat16, cpool, cindices


def _float64(args: tuple) -> tuple:
    q, kv, idx, sinks, *rest = args
    return (q.double(), kv, idx, sinks.double(), *rest)


def _row_error(got: torch.Tensor, want: torch.Tensor) -> float:
    row = want.double().abs().amax(dim=-1, keepdim=True)
    err = (got.double() - want.double()).abs() / torch.where(row > 0, row, torch.ones_like(row))
    return err.max().item()


def _cosine(got: torch.Tensor, want: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(got.double().flatten(), want.double().flatten(), dim=0).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
@pytest.mark.parametrize("batch", [1, 16, 64])
def test_fp8_attention_at_v4_flash_decode_shapes(batch, dtype, device):
    from deepinfer_nvidia_sm100 import triton_ops

    args = decode_case(batch, batch, device, dtype)
    name = f"sparse_attention_fp8 batch {batch} {dtype}"
    got = triton_ops.sparse_attention_fp8(*args)
    assert got.dtype == dtype and got.shape == args[0].shape, name
    assert not torch.isnan(got).any(), f"{name}: NaN (an unused 0xFF row was read?)"
    want = native.sparse_attention_fp8(*_float64(args))
    assert 0.05 < want.abs().max().item() < 20  # outputs O(1): the tolerances mean what they say
    err, cosine = _row_error(got, want), _cosine(got, want)
    assert err <= TOL[dtype], f"{name}: {err:.3g} > {TOL[dtype]}"
    assert cosine >= MIN_COSINE[dtype], f"{name}: cosine {cosine}"
    same = native.sparse_attention_fp8(*args)  # the native body in the queries' dtype
    assert _row_error(same, want) <= TOL[dtype], name
    # the dense Triton kernel on the decoded rows: what is left is the attention's own rounding
    q, wpool, widx, sinks, scale, rope, rope_dtype, cpool, cidx = args
    dense = triton_ops.sparse_attention(q, unpack_kv_fp8(wpool, HEAD_DIM, rope, rope_dtype, dtype), widx, sinks, scale,
                                        unpack_kv_fp8(cpool, HEAD_DIM, rope, rope_dtype, dtype), cidx)
    assert _row_error(got, dense) <= TOL[dtype], name
    print(f"\n{name}: {err:.3g} from float64 (the native body in {dtype}: {_row_error(same, want):.3g}), "
          f"{_row_error(got, dense):.3g} from the dense kernel, {(got != dense).double().mean().item():.2%} differ")


def test_fp8_attention_captures_in_a_cuda_graph(device):
    """Captured and replayed on new queries, new indices and new entries (written in place): the same bits
    as an eager call; and no call waits for the device."""
    from deepinfer_nvidia_sm100 import triton_ops

    args = decode_case(64, 1, device)
    q, wpool, widx, sinks, scale, rope, rope_dtype, cpool, cidx = args

    def step():
        return triton_ops.sparse_attention_fp8(q, wpool, widx, sinks, scale, rope, rope_dtype, cpool, cidx)

    eager = step()  # compiles outside the capture
    run_without_host_sync(step)
    captured = _capture_then_replay_on(step, args, decode_case(64, 2, device))
    again = step()
    assert torch.equal(captured, again)
    assert not torch.equal(captured, eager)


def _capture_then_replay_on(step, args, new):
    """``step`` captured in a CUDA graph over the tensors of the decode case ``args``, then replayed after
    the case ``new`` is copied into them; returns the graph's output."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for buf, value in zip(args, new):
        if isinstance(buf, torch.Tensor):
            buf.copy_(value)
    graph.replay()
    torch.cuda.synchronize()
    return captured


def _flash_mla_fp8(device):
    """The FlashMLA adapter of ``sparse_attention_fp8`` where it passes its build-time check, else skip."""
    from types import SimpleNamespace

    from deepinfer_nvidia_sm100 import external

    widths = SimpleNamespace(num_attention_heads=HEADS, head_dim=HEAD_DIM)
    ok, reason = external._flash_mla_fp8_usable(device, torch.bfloat16, widths, True)
    if not ok:
        pytest.skip(f"FlashMLA does not serve sparse_attention_fp8 here: {reason}")
    return external.flash_mla_sparse_attention_fp8


@pytest.mark.parametrize("batch", [1, 16, 64])
def test_flash_mla_fp8_decode_at_v4_flash_decode_shapes(batch, device):
    """The same cases as the Triton kernel's, through FlashMLA's sparse decode (rows gathered into 16-byte
    aligned pages); the 0xFF rows no list points at are gathered too and must not be read."""
    attend = _flash_mla_fp8(device)
    args = decode_case(batch, batch, device)
    got = attend(*args)
    name = f"flash_mla sparse_attention_fp8 batch {batch}"
    assert got.dtype == torch.bfloat16 and got.shape == args[0].shape and not torch.isnan(got).any(), name
    want = native.sparse_attention_fp8(*_float64(args))
    err, cosine = _row_error(got, want), _cosine(got, want)
    assert err <= TOL[torch.bfloat16], f"{name}: {err:.3g} > {TOL[torch.bfloat16]}"
    assert cosine >= 1 - 1e-4, f"{name}: cosine {cosine}"


def test_flash_mla_fp8_decode_captures_in_a_cuda_graph(device):
    attend = _flash_mla_fp8(device)
    args = decode_case(16, 3, device)
    q, wpool, widx, sinks, scale, rope, rope_dtype, cpool, cidx = args
    step = lambda: attend(q, wpool, widx, sinks, scale, rope, rope_dtype, cpool, cidx)  # noqa: E731
    step()
    torch.cuda.synchronize()
    new = decode_case(16, 4, device)
    captured = _capture_then_replay_on(step, args, new)
    assert _row_error(captured, attend(*new)) <= 1e-3  # the new step's attention, from the same buffers

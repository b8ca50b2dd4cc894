"""The ascend_950 backend's TileLang kernels lower to AscendC on this machine (no CANN, no NPU).

Each kernel goes through TileLang's ``ascend`` pass pipeline and AscendC code generation at a tiny shape
and at DeepSeek-V4-Flash's (hc_mult 4 with 20 Sinkhorn iterations; 64 heads of 512 in bf16, the rows per
token dynamic). The tests check the lowered program's structure (the cores and pipes the code runs on, the
synchronisation TileLang inserted, the buffers in their scopes) and its on-chip footprint against the
Ascend 950 capacities; and that ``tilelang.compile`` hands exactly this source to the
``bisheng`` compiler for ``dav-3510``. Whether bisheng accepts it and the chip computes the right numbers
is not checkable here.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("tilelang", reason="TileLang (with its Ascend backend) is not installed")

from deepinfer_ascend_950 import limits, lowering  # noqa: E402
from deepinfer_ascend_950.kernels.hc_sinkhorn import hc_split_sinkhorn  # noqa: E402
from deepinfer_ascend_950.kernels.sparse_attention import sparse_attention_sinks  # noqa: E402

SINKHORN_SHAPES = {"tiny": dict(hc=2, sinkhorn_iters=3, eps=1e-6, token_block=4),
                   "v4_flash": dict(hc=4, sinkhorn_iters=20, eps=1e-6, token_block=8)}
ATTENTION_SHAPES = {"tiny": dict(heads=16, head_dim=64, scale=64**-0.5),
                    "v4_flash": dict(heads=64, head_dim=512, scale=512**-0.5)}


# v4_flash (slow): the release's shape (more heads, iterations and tiles) through the same passes as tiny
SHAPE_PARAMS = [pytest.param(s, marks=[pytest.mark.slow] if s == "v4_flash" else []) for s in ("tiny", "v4_flash")]


def _lazily_lowered(build, shapes: dict):
    """shape -> the kernel lowered at it, each shape lowered on first use (a module's cache)."""
    cache = {}

    def get(shape):
        if shape not in cache:
            cache[shape] = lowering.lower(build(**shapes[shape]))
        return cache[shape]

    return get


@pytest.fixture(scope="module")
def sinkhorn():
    return _lazily_lowered(hc_split_sinkhorn, SINKHORN_SHAPES)


@pytest.fixture(scope="module")
def attention():
    return _lazily_lowered(sparse_attention_sinks, ATTENTION_SHAPES)


def _allocs(lowered) -> dict[str, str]:
    """buffer name -> scope of every allocation in the lowered device program."""
    return dict(re.findall(r'(\w+) = T\.alloc_buffer\([^\n]*?scope="([\w.]+)"', lowered.script))


@pytest.mark.parametrize("shape", SHAPE_PARAMS)
def test_sinkhorn_lowers_to_a_vector_kernel(sinkhorn, shape):
    lo, kw = sinkhorn(shape), SINKHORN_SHAPES[shape]
    src = lo.source
    assert re.search(r'extern "C" __global__ __vector__ void hc_split_sinkhorn_kernel_kernel\(', src)
    assert "ASC_IS_AIC" not in src and "ascend_gemm" not in src  # Vector cores only
    # GM -> UB (MTE2), the SIMT function on the vector pipe, UB -> GM (MTE3), each handed over by a flag
    vf = re.search(r"__simt_vf__ __launch_bounds__\(64\) inline void (\w+)\(", src).group(1)
    order = [src.index("asc_copy_gm2ub_align"), src.index("asc_sync_wait(PIPE_MTE2, PIPE_V"),
             src.index(f"asc_vf_call<{vf}>"), src.index("asc_sync_wait(PIPE_V, PIPE_MTE3"),
             src.index("asc_copy_ub2gm_align")]
    assert order == sorted(order)
    # the Sinkhorn loop runs inside the SIMT function: iters - 1 (row, column) rounds with warp reductions
    simt = src[src.index(vf): src.index("__global__")]
    assert re.search(rf"for \(int32_t \w+ = 0; \w+ < {kw['sinkhorn_iters'] - 1}; \+\+\w+\)", simt)
    assert "tl::AscendAllReduce<tl::MaxOp" in simt and "tl::AscendAllReduce<tl::SumOp" in simt
    assert "expf(" in simt
    # every on-chip buffer is in the Unified Buffer, merged into one dynamic allocation
    assert set(_allocs(lo).values()) <= {"shared.dyn", "local", "local.var"}
    assert set(lo.buffers) == {"UB"} and lo.simt_vf


@pytest.mark.parametrize("shape", SHAPE_PARAMS)
def test_sparse_attention_lowers_to_a_cube_vector_kernel(attention, shape):
    lo, kw = attention(shape), ATTENTION_SHAPES[shape]
    src, h, d, bk = lo.source, kw["heads"], kw["head_dim"], 64
    assert re.search(r'extern "C" __global__ __mix__\(1, 2\) void sparse_attention_sinks_kernel_kernel\(', src)
    aic, aiv = src.index("if ASC_IS_AIC"), src.index("if ASC_IS_AIV")
    cube, vector = src[aic:aiv], src[aiv:]
    # Cube: Q and the gathered rows GM -> L1 (the second copy transposed, dn2nz), both GEMMs, L0C -> UB to
    # both vector cores; S = Q K^T is [H, BK] over D, O = P V^T is [H, D] over BK
    assert "asc_copy_gm2l1_nd2nz" in cube and "asc_copy_gm2l1_dn2nz" in cube
    shapes = {(g.m, g.k, g.n) for g in lo.gemms}
    assert shapes == {(h, d, bk), (h, bk, d)}
    assert cube.count("ascend_gemm_l1<") == 2 and "asc_copy_l0c2ub" in cube
    assert "static_cast<asc_dual_dst_mode>(1)" in cube
    # Vector: the indices GM -> UB, the softmax and rescale in SIMT functions, P UB -> L1 for the Cube
    assert "asc_copy_gm2ub_align" in vector and "asc_copy_ub2l1" in vector and "asc_vf_call<" in vector
    assert "asc_copy_ub2gm_align" in vector
    # cross-core handshakes both ways (FIX pipe -> vector, vector MTE3 -> Cube MTE1), pipe flags inside
    assert "asc_sync_intra_arrive(PIPE_FIX" in cube and "asc_sync_intra_wait(PIPE_V" in vector
    assert "asc_sync_intra_arrive(PIPE_MTE3" in vector and "asc_sync_intra_wait(PIPE_MTE1" in cube
    assert "asc_sync_wait(PIPE_M, PIPE_FIX" in cube and "asc_sync_wait(PIPE_MTE2, PIPE_MTE1" in cube
    # the block loop over the (dynamic) rows per token runs on both sides: ceil(topk / 64) blocks
    loops = re.findall(r"for \(int32_t \w+ = 0; \w+ < \(\(topk \+ 63\)", src)
    assert len(loops) == 2 and "int32_t topk" in src
    assert set(_allocs(lo).values()) >= {"shared.l1.dyn", "shared.l0c.dyn", "shared.dyn"}
    assert {"UB", "L1", "L0C"} <= set(lo.buffers)


@pytest.mark.parametrize("kernel,shape", [pytest.param(k, *p.values, marks=p.marks)
                                          for k in ("sinkhorn", "attention") for p in SHAPE_PARAMS])
def test_footprint_fits_the_ascend_950(sinkhorn, attention, kernel, shape):
    lo = (sinkhorn if kernel == "sinkhorn" else attention)(shape)
    assert lo.over_limits() == {}, lo.usage()
    usage = lo.usage()
    assert usage["UB"] <= limits.UB_PHYSICAL - limits.SIMT_VF_RESERVED  # both kernels have SIMT regions
    if kernel == "attention":
        assert usage["L1"] <= limits.L1 and usage["L0C"] <= limits.L0C
        assert usage["L0A"] <= limits.L0A and usage["L0B"] <= limits.L0B


@pytest.mark.slow
def test_v4_flash_attention_footprint_figures(attention):
    """The V4-Flash shape's figures, pinned so a change of tiling or TileLang is noticed: L1 holds Q [64, 512],
    the rows twice (K and V^T, [64, 512] each), P [64, 64], partly double-buffered by TileLang's schedule;
    L0C the two accumulators; the UB each vector core's half of S, P, O and the running state."""
    usage = attention("v4_flash").usage()
    q, rows, p = 64 * 512 * 2, 64 * 512 * 2, 64 * 64 * 2
    assert usage["L1"] >= q + 2 * rows + p
    assert usage["L0C"] >= (64 * 64 + 64 * 512) * 4
    assert usage["L0A"] == limits.L0A and usage["L0B"] == limits.L0B  # TileLang sizes the K chunk to fill L0
    assert usage == {"L1": 200 * 1024, "L0C": 144 * 1024, "UB": 181248, "L0A": 64 * 1024, "L0B": 64 * 1024}


def test_over_limits_reports_a_buffer_beyond_capacity():
    lo = lowering.Lowered(source="", device_mod=None, buffers={"UB": limits.UB_PHYSICAL - 1024, "L1": 1024},
                          simt_vf=True)
    assert lo.over_limits() == {"UB": (limits.UB_PHYSICAL - 1024, limits.UB_PHYSICAL - limits.SIMT_VF_RESERVED)}
    lo.simt_vf = False
    assert lo.over_limits() == {}


def test_tilelang_refuses_a_tiling_beyond_the_unified_buffer():
    """128 heads put 2 x 64 rows of [512] float32 state per vector core: TileLang's scheduler, planning with
    the same UB figure, refuses it (the limits are enforced when lowering, not only checked here)."""
    with pytest.raises(Exception, match="capacity"):
        lowering.lower(sparse_attention_sinks(heads=128, head_dim=512, scale=512**-0.5))


@pytest.mark.parametrize("build", [
    pytest.param(lambda: hc_split_sinkhorn(**SINKHORN_SHAPES["tiny"]), id="sinkhorn"),
    pytest.param(lambda: sparse_attention_sinks(**ATTENTION_SHAPES["tiny"]), id="attention", marks=pytest.mark.slow),
])
def test_compile_hands_this_source_to_bisheng_for_dav_3510(build):
    code, kwargs = lowering.capture_compile(build())
    assert code == lowering.lower(build()).source
    assert kwargs["npu_arch"] == "dav-3510" and kwargs["target_format"] == "aibin"


def test_kernels_check_their_parameters():
    with pytest.raises(ValueError, match="multiples of 16"):
        sparse_attention_sinks(heads=8, head_dim=64, scale=1.0)
    with pytest.raises(ValueError, match=">= 1"):
        hc_split_sinkhorn(hc=4, sinkhorn_iters=0, eps=1e-6)

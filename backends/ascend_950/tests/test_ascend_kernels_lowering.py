"""The ascend_950 backend's newer TileLang kernels lower to AscendC for ``dav-3510`` (no CANN, no NPU).

Each kernel goes through TileLang's ``ascend`` pass pipeline and AscendC code generation at a tiny shape
and at DeepSeek-V4-Flash's; the tests check the lowered program's structure (the cores it runs on, the
copies between GM, L1, L0C and the Unified Buffer, the cross-core handshakes and pipe flags TileLang
inserted, the Cube GEMM shapes) and its on-chip footprint against the Ascend 950 capacities of
``deepinfer_ascend_950.limits``. Whether bisheng accepts the source and the chip computes the right
numbers is not checkable here (the numbers are checked through the emulator, ``test_ascend_emulated``).
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("tilelang", reason="TileLang (with its Ascend backend) is not installed")

from deepinfer_ascend_950 import lowering  # noqa: E402
from deepinfer_ascend_950.kernels import builder  # noqa: E402

#: (kernel, shape name) -> builder parameters; V4-Flash: CSA windows of 8 and HCA of 128 over head_dim
#: 512, the indexer's own compressor at 128; the indexer 64 heads x 128
SHAPES = {
    ("compress_windows", "tiny"): dict(window=8, dim=32, kv_dtype="bfloat16", gate_dtype="float32"),
    ("compress_windows", "v4_flash_csa"): dict(window=8, dim=512, kv_dtype="bfloat16", gate_dtype="float32"),
    ("compress_windows", "v4_flash_hca"): dict(window=128, dim=512, kv_dtype="bfloat16", gate_dtype="float32"),
    ("compress_windows", "v4_flash_index"): dict(window=8, dim=128, kv_dtype="bfloat16", gate_dtype="float32"),
    ("indexer_scores", "tiny"): dict(heads=16, dim=16),
    ("indexer_scores", "v4_flash"): dict(heads=64, dim=128),
    ("hc_post", "tiny"): dict(hc=2, dim=64),
    ("hc_post", "v4_flash"): dict(hc=4, dim=4096, block_d=256),
    ("hc_head_collapse", "tiny"): dict(hc=2, dim=64, eps=1e-6),
    ("hc_head_collapse", "v4_flash"): dict(hc=4, dim=4096, eps=1e-6, block_d=256),
    ("act_quant_fp8", "tiny"): dict(dim=128),
    ("act_quant_fp8", "v4_flash"): dict(dim=4096),
    ("fp8_gemm", "tiny"): dict(n=128, k=128),
    ("fp8_gemm", "v4_flash"): dict(n=4096, k=4096),
    ("fp8_gemm", "v4_flash_expert_f32"): dict(n=4096, k=2048, out_dtype="float32"),
    ("fp4_expert_gemm", "tiny"): dict(n=64, k=64),
    ("fp4_expert_gemm", "v4_flash_w13"): dict(n=4096, k=4096),
    ("fp4_expert_gemm", "v4_flash_w2"): dict(n=4096, k=2048),
    ("act_quant_sim", "tiny"): dict(dim=128, block=128, fmt="e4m3"),
    ("act_quant_sim", "tiny_e2m1"): dict(dim=32, block=32, fmt="e2m1"),
    ("act_quant_sim", "v4_flash_act"): dict(dim=4096, block=128, fmt="e4m3"),
    ("act_quant_sim", "v4_flash_kv"): dict(dim=448, block=64, fmt="e4m3"),
    ("act_quant_sim", "v4_flash_index_q"): dict(dim=128, block=32, fmt="e2m1"),
    ("sqrt_softplus", "tiny"): dict(experts=16),
    ("sqrt_softplus", "v4_flash"): dict(experts=256),
    ("sqrt_softplus", "v4_flash_f32"): dict(experts=256, dtype="float32"),
    ("fp8_expert_gemm", "tiny"): dict(n=64, k=128),
    ("fp8_expert_gemm", "v4_flash_w13"): dict(n=4096, k=4096),
    ("kv_fp8_quant", "tiny"): dict(head_dim=32, rope_dim=16),
    ("kv_fp8_quant", "tiny_f32"): dict(head_dim=32, rope_dim=16, dtype="float32"),
    ("kv_fp8_quant", "v4_flash"): dict(head_dim=512, rope_dim=64),
    ("kv_fp8_dequant", "tiny"): dict(head_dim=32, rope_dim=16),
    ("kv_fp8_dequant", "tiny_f16"): dict(head_dim=32, rope_dim=16, rope_dtype="float16", dtype="float16"),
    ("kv_fp8_dequant", "tiny_f32_rope"): dict(head_dim=32, rope_dim=16, rope_dtype="float32"),
    ("kv_fp8_dequant", "v4_flash"): dict(head_dim=512, rope_dim=64),
}
#: kernel -> the Cube GEMMs (M, K, N) it runs, as a function of its parameters (None: a vector kernel)
GEMMS = {
    "compress_windows": None,
    "indexer_scores": lambda kw: {(kw["heads"], kw["dim"], 64)},
    "hc_post": None,
    "hc_head_collapse": None,
    "act_quant_fp8": None,
    "fp8_gemm": lambda kw: {(64, 128, 128)},
    "fp4_expert_gemm": lambda kw: {(64, min(128, kw["k"]), min(128, kw["n"]))},
    "fp8_expert_gemm": lambda kw: {(64, 128, 128)},
    "act_quant_sim": None,
    "sqrt_softplus": None,
    "kv_fp8_quant": None,
    "kv_fp8_dequant": None,
}


@pytest.fixture(scope="module")
def lowered():
    cache = {}

    def get(kernel, shape):
        if (kernel, shape) not in cache:
            cache[(kernel, shape)] = lowering.lower(builder(kernel)(**SHAPES[(kernel, shape)]))
        return cache[(kernel, shape)]

    return get


#: the V4-Flash-shaped Cube GEMM kernels take about 15 s each to lower: their cases are in the slow suite
SLOW = {("fp8_gemm", "v4_flash"), ("fp8_gemm", "v4_flash_expert_f32"), ("fp4_expert_gemm", "v4_flash_w13"),
        ("fp4_expert_gemm", "v4_flash_w2"), ("fp8_expert_gemm", "v4_flash_w13")}
CASES = [pytest.param(k, s, id=f"{k}-{s}", marks=[pytest.mark.slow] if (k, s) in SLOW else []) for k, s in SHAPES]


@pytest.mark.parametrize("kernel,shape", CASES)
def test_kernel_lowers_with_the_expected_structure(lowered, kernel, shape):
    lo, kw = lowered(kernel, shape), SHAPES[(kernel, shape)]
    src = lo.source
    gemms = GEMMS[kernel]
    assert re.search(rf'extern "C" __global__ (__vector__|__mix__\(1, 2\)) void {kernel}_kernel_kernel\(', src)
    assert "asc_copy_gm2ub_align" in src and "asc_copy_ub2gm_align" in src and "asc_vf_call<" in src
    assert "asc_sync_wait(PIPE_MTE2, PIPE_V" in src and "asc_sync_wait(PIPE_V, PIPE_MTE3" in src
    if gemms is None:
        assert "__vector__" in src and "ASC_IS_AIC" not in src and "ascend_gemm" not in src
        assert set(lo.buffers) == {"UB"}
        return
    assert "__mix__(1, 2)" in src
    aic, aiv = src.index("if ASC_IS_AIC"), src.index("if ASC_IS_AIV")
    cube, vector = src[aic:aiv], src[aiv:]
    assert {(g.m, g.k, g.n) for g in lo.gemms} == gemms(kw)
    assert "asc_copy_gm2l1_nd2nz" in cube and "asc_copy_l0c2ub" in cube
    assert "asc_sync_intra_arrive(PIPE_FIX" in cube and "asc_sync_intra_wait(PIPE_V" in vector
    assert "asc_sync_wait(PIPE_M, PIPE_FIX" in cube and "asc_sync_wait(PIPE_MTE2, PIPE_MTE1" in cube
    assert {"UB", "L1", "L0C"} <= set(lo.buffers)


def test_compressor_reduces_over_the_window_in_one_simt_function(lowered):
    src = lowered("compress_windows", "v4_flash_hca").source
    simt = src[: src.index("__global__")]
    assert simt.count("__simt_vf__") == 1  # softmax and weighted sum in one region, no UB round trips
    assert "tl::AscendAllReduce<tl::MaxOp" in simt and simt.count("tl::AscendAllReduce<tl::SumOp") == 2
    assert "expf(" in simt


def test_indexer_splits_the_scores_by_candidates_between_the_vector_cores(lowered):
    src = lowered("indexer_scores", "v4_flash").source
    assert "static_cast<asc_dual_dst_mode>(2)" in src  # N-split: each AIV all heads, half the candidates
    loops = re.findall(r"for \(int32_t \w+ = 0; \w+ < \(\(width \+ 63\)", src)
    assert len(loops) == 2 and "int32_t width" in src  # the candidate blocks on both sides, width dynamic


@pytest.mark.parametrize("kernel,shape", CASES)
def test_footprint_fits_the_ascend_950(lowered, kernel, shape):
    lo = lowered(kernel, shape)
    assert lo.over_limits() == {}, lo.usage()


@pytest.mark.slow
def test_fp8_gemm_runs_e4m3_tiles_on_the_cube_and_rescales_per_k_group(lowered):
    lo = lowered("fp8_gemm", "v4_flash")
    assert [g.elem_bytes for g in lo.gemms] == [1]  # E4M3 operands, one byte each
    assert re.search(r"ascend_gemm_l1<\s*64,\s*128,\s*128,\s*128,\s*true,\s*float8_e4m3_t", lo.source)
    assert "static_cast<asc_dual_dst_mode>(1)" in lo.source  # M-split: each AIV half the rows
    assert re.search(r"for \(int32_t \w+ = 0; \w+ < 32; \+\+\w+\)", lo.source)  # 4096 / 128 K groups


@pytest.mark.slow
def test_fp4_experts_dequantise_on_the_vector_cores_and_multiply_on_the_cube(lowered):
    src = lowered("fp4_expert_gemm", "v4_flash_w13").source
    aic, aiv = src.index("if ASC_IS_AIC"), src.index("if ASC_IS_AIV")
    cube, vector = src[aic:aiv], src[aiv:]
    simt = src[: src.index("__global__")]
    assert re.search(r"ascend_gemm_l1<\s*64,\s*128,\s*128,\s*128,\s*true,\s*bfloat16_t>\(.*\(kb == 0\)", cube)
    assert re.search(r"for \(int32_t kb = 0; kb < 32; \+\+kb\)", cube)  # 4096 / 128, one L0C accumulator
    assert "= tile_expert[" in cube and "= tile_expert[" in vector  # each side reads the tile's expert
    assert "if (0 <= e)" in cube and "if (0 <= e_1)" in vector  # unused tiles skipped on both
    assert "asc_copy_ub2l1(" in vector and "asc_sync_intra_arrive(PIPE_MTE3" in vector  # dequantised tile
    assert "asc_sync_intra_wait(PIPE_MTE1" in cube  # the Cube waits for it
    assert "(uint8_t)15" in simt and ">> (uint8_t)4" in simt  # low nibble, then high
    assert "<< (uint32_t)23" in simt  # e8m0 byte into a float32's exponent
    assert "uint8_t" in src and "float8" not in src


@pytest.mark.slow
def test_fp8_experts_pick_each_tiles_expert_on_both_cores(lowered):
    lo = lowered("fp8_expert_gemm", "v4_flash_w13")
    src = lo.source
    aic, aiv = src.index("if ASC_IS_AIC"), src.index("if ASC_IS_AIV")
    cube, vector = src[aic:aiv], src[aiv:]
    assert [g.elem_bytes for g in lo.gemms] == [1]  # E4M3 operands
    assert "= tile_expert[" in cube and "= tile_expert[" in vector
    assert "if (0 <= e)" in cube and "if (0 <= e_1)" in vector
    assert re.search(r"for \(int32_t \w+ = 0; \w+ < 32; \+\+\w+\)", cube)  # 4096 / 128 K groups
    assert "static_cast<asc_dual_dst_mode>(1)" in src  # M-split: each AIV half the rows


def test_act_quant_sim_takes_its_scale_from_the_float_bits_and_rounds_as_deepseek(lowered):
    e4m3 = lowered("act_quant_sim", "v4_flash_act").source
    assert "tl::AscendAllReduce<tl::MaxOp" in e4m3  # amax per row of the group
    assert "& (uint32_t)8388607) != (uint32_t)0" in e4m3  # a mantissa bit set: round the exponent up
    assert re.search(r">> \(uint32_t\)23\) & \(uint32_t\)255\)\) \+ condval\)\) << \(uint32_t\)23", e4m3)
    assert "__asc_cvt_float2_to_fp8x2(" in e4m3 and "__ASC_E4M3" in e4m3  # the E4M3 cast, then back
    e2m1 = lowered("act_quant_sim", "v4_flash_index_q").source
    assert "float8" not in e2m1 and "fp8" not in e2m1
    assert re.search(r"float\(0x1p-2f/\*2.500000e-01\*/\) < fabsf", e2m1)  # 0.25: ties down to 0
    assert re.search(r"float\(0x1.8p-1f/\*7.500000e-01\*/\) <= fabsf", e2m1)  # 0.75: ties up to 1


def test_sqrt_softplus_keeps_u_minus_1_unsimplified(lowered):
    src = lowered("sqrt_softplus", "v4_flash").source
    simt = src[: src.index("__global__")]
    assert re.search(r"logf\(u\[\w+\]\) \* \(expf\(x\) / \(u\[\w+\] - float\(0x1p\+0f", simt)  # log1p
    assert "0x1.4p+4f" in simt and "sqrtf(" in simt  # the threshold 20, then the square root


@pytest.mark.slow
def test_v4_flash_footprint_figures(lowered):
    """Pinned so that a change of tiling or of TileLang is noticed."""
    assert lowered("compress_windows", "v4_flash_hca").usage() == {"UB": 50048}
    assert lowered("indexer_scores", "v4_flash").usage() == {
        "L1": 32768, "UB": 8960, "L0C": 16384, "L0A": 32768, "L0B": 32768}
    assert lowered("fp4_expert_gemm", "v4_flash_w13").usage() == {
        "L1": 49152, "UB": 69888, "L0C": 32768, "L0A": 32768, "L0B": 65536}
    assert lowered("fp4_expert_gemm", "v4_flash_w2").usage() == {
        "L1": 49152, "UB": 65792, "L0C": 32768, "L0A": 32768, "L0B": 65536}
    assert lowered("fp8_expert_gemm", "v4_flash_w13").usage() == {
        "L1": 24576, "UB": 49408, "L0C": 32768, "L0A": 16384, "L0B": 32768}
    assert lowered("kv_fp8_quant", "v4_flash").usage() == {"UB": 43264}  # 32 rows: 448 bf16 + 448 E4M3 + 8
    assert lowered("kv_fp8_dequant", "v4_flash").usage() == {"UB": 51456}  # 32 rows: 584-byte entries + 512 bf16


# indexer_scores (slow): its second lowering takes 8 s; its structure is checked at tiny and V4-Flash shapes above
@pytest.mark.parametrize("kernel", [
    pytest.param(k, marks=[pytest.mark.slow] if k in {g for g, _ in SLOW} | {"indexer_scores"} else [])
    for k in sorted({k for k, _ in SHAPES})])
def test_compile_hands_the_source_to_bisheng_for_dav_3510(lowered, kernel):
    kw = SHAPES[(kernel, "tiny")]
    code, kwargs = lowering.capture_compile(builder(kernel)(**kw))
    assert code == lowered(kernel, "tiny").source  # lowering.lower's, made once in the module
    assert kwargs["npu_arch"] == "dav-3510"


def test_kernels_check_their_parameters():
    with pytest.raises(ValueError, match="multiple of block_d"):
        builder("compress_windows")(window=8, dim=100)
    with pytest.raises(ValueError, match="multiples of 16"):
        builder("indexer_scores")(heads=8, dim=128)
    with pytest.raises(ValueError, match="multiple of 32"):
        builder("fp4_expert_gemm")(n=64, k=48)
    with pytest.raises(ValueError, match="unknown fmt"):
        builder("act_quant_sim")(dim=128, block=32, fmt="e5m2")
    with pytest.raises(ValueError, match="hc=9"):
        builder("hc_post")(hc=9, dim=64)
    with pytest.raises(ValueError, match="nope=100"):
        builder("kv_fp8_quant")(head_dim=164, rope_dim=64)


def test_hc_post_sums_the_streams_in_order_inside_one_simt_function(lowered):
    src = lowered("hc_post", "v4_flash").source
    simt = src[: src.index("__global__")]
    assert simt.count("__simt_vf__") == 1
    assert re.search(r"for \(int32_t \w+ = 0; \w+ < 4; \+\+\w+\)", simt)  # the j sum over hc_mult streams


def test_kv_fp8_quant_writes_deepseeks_entry_bytes(lowered):
    src = lowered("kv_fp8_quant", "v4_flash").source
    simt, host = src[: src.index("__global__")], src[src.index("__global__"):]
    assert re.search(r"for \(int32_t g = 0; g < 7; \+\+g\)", simt)  # 448 codes: 7 scale groups of 64
    assert "tl::AscendAllReduce<tl::MaxOp" in simt  # amax per row of a group
    assert re.search(r">> \(uint32_t\)23\) & \(uint32_t\)255\)\) \+ condval\)\) << \(uint32_t\)23", simt)
    assert "((uint8_t)(((*(uint32_t *)(&(" in simt  # the scale's biased exponent is its byte
    assert "__asc_cvt_float2_to_fp8x2(" in simt and "__ASC_SATFINITE, __ASC_E4M3" in simt
    assert "__gm__ fp8_e4_t* codes" in host and "__gm__ uint8_t* tail" in host
    assert ", 896, 0, 0, 0, static_cast<asc_load_l2_cache_mode>(0), 1024, 896)" in host  # nope of each row


def test_kv_fp8_dequant_decodes_whole_entries_exactly(lowered):
    src = lowered("kv_fp8_dequant", "v4_flash").source
    simt, host = src[: src.index("__global__")], src[src.index("__global__"):]
    assert "__gm__ uint8_t* entries" in host and "* 584)" in host  # whole 584-byte entries into the UB
    assert "float8" not in src and "fp8_e4" not in src and "__asc_cvt" not in src  # E4M3 decoded from its bits
    assert ">> (uint32_t)3) & (uint32_t)15)" in simt and "& (uint32_t)7)" in simt  # exponent, mantissa
    assert "(uint32_t)2143289344" in simt  # S.1111.111: NaN
    assert re.search(r"\(\(uint32_t\)buf_dyn_shmem\[.*\+ 33344\)\]\) << \(uint32_t\)23", simt)  # scale byte at 576
    assert "<< (uint32_t)8)) << (uint32_t)16" in simt  # the bf16 RoPE value: two bytes, a float32's top half
    f16 = lowered("kv_fp8_dequant", "tiny_f16").source
    assert "& (uint32_t)1023)" in f16 and "(uint32_t)13)" in f16  # float16 fields moved into a float32

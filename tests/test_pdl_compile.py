"""CPU CI: the batch-1 decode chain's ``DEEPINFER_PDL=1`` builds (programmatic dependent launch,
``kernels_cuda/_tl.py``) lower for sm_90a (three also go through nvcc), and in each generated kernel the
wait for the kernel before it (``cudaGridDependencySynchronize``) comes after only loads that do not depend
on that kernel (weights) and before the first read of anything it wrote (activations, expert ids, the split
partials). A read above the wait would be a race that no CPU test could see; this one reads the CUDA source.
On the GPU, ``test_decode_fusion_gpu.py::test_programmatic_dependent_launch_gives_the_same_bits`` runs the
chain."""

from __future__ import annotations

import pytest
from test_kernels_cuda_compile import ARCH, pytestmark  # noqa: F401  (nvcc and tilelang, or skipped)

SYNC, TRIGGER = "cudaGridDependencySynchronize", "cudaTriggerProgrammaticLaunchCompletion"


def _cases() -> dict:
    """name -> (thunk building the PDL kernel at V2-Lite's shape, loads before the wait, reads after it)."""
    from kernels_cuda import fp8_gemv, gemv, gemv_rows, mla_decode, mla_decode_uv, moe_down_slots, moe_gate, moe_gemv
    from kernels_cuda import moe_gemv_fp8 as mf
    from kernels_cuda import moe_up_fp8_mma as mfm
    from kernels_cuda import norm_gemv as ng
    from kernels_cuda.sampling import build_greedy

    C, E, I = 2048, 66, 1408
    c = mla_decode.config(16, 576, 512, 64, False, True)
    rows = gemv_rows.rows_config(16, 512, 128, 1, 132)
    return {
        "gemv (o_proj)": (lambda: gemv.build_gemv(C, C, 1, *gemv.tile_config(C, C, 132, 8), "bfloat16", "bfloat16",
                                                  "bfloat16", True), ["(W + ("], ["(X + ("]),
        "norm_gemv (input norm + q + kv_a)": (
            lambda: ng.build_norm_gemv(3648, C, *gemv.tile_config(3648, C, 132), True, "bfloat16", True),
            ["(W + ("], ["(X + (", "(Res + (", "(ResOut + ("]),
        "norm_gate (post-attention norm + router)": (
            lambda: moe_gate.build_gate_route(64, C, 6, 1, 1, True, False, False, False, 2, "bfloat16", "bfloat16",
                                              "float32", True, True), ["(Gate + ("], ["(X + (", "Ids["]),
        "mla_q_absorb_kv_write": (
            lambda: gemv_rows.build_gemv_rows(16, 512, 128, 1, rows, (3072, 192), (576 * 16, 576), "bfloat16",
                                              "bfloat16", 64, "float32", True, (512, 64, 3648)),
            ["(W + ("], ["XR[", "Cache["]),
        "mla_decode (attention, key splits)": (
            lambda: mla_decode.build_decode(16, 512, 64, 64, c["BH"], c["BN"], c["stages"], c["threads"], True, False,
                                            "bfloat16", 0, c.get("mma"), True),
            [], ["CuQ[", "SeqLens[", "tma_load(Q_desc"]),
        "mla_decode_uv (merge + W_UV)": (lambda: mla_decode_uv.build_combine_uv(16, 16, 512, 128, "bfloat16", True),
                                         ["(W + ("], ["LsePart[", "(OPart + ("]),
        "moe_up": (lambda: moe_gemv.build_up(E, C, I, 8, 1, *moe_gemv.split(C, moe_gemv.THREADS), "bfloat16", "int64",
                                             None, True), [], ["Ids[", "(X + ("]),
        "moe_down_slots": (lambda: moe_down_slots.build_down_slots(E, C, I, 8, 1, 1, "bfloat16", "int64", "bfloat16",
                                                                   3, True), [], ["Ids[", "(H + ("]),
        # the FP8 weights' chain (V2-Lite with FP8 projections and experts)
        "fp8_gemv (q + kv_a, o_proj)": (
            lambda: fp8_gemv.build_fp8_gemv(3648, C, 1, fp8_gemv.gemv_config(3648, C, 1, 132), "bfloat16", True),
            ["(W + (", "WS["], ["(X + ("]),
        "moe_up_fp8_mma": (lambda: mfm.build_up_fp8_mma(E, C, I, 8, 1, "bfloat16", "int64", 2, True), [],
                           ["Ids[", "(X + ("]),
        "moe_down_fp8": (lambda: mf.build_down_fp8(E, C, I, 8, 4, "bfloat16", "int64", "bfloat16", 2, True), [],
                         ["Ids[", "(H + ("]),
        # after the logits' GEMV: greedy decoding's draw (it reads the logits and the counters only after the wait)
        "greedy_sample": (lambda: build_greedy(True), [], ["X[", "Count["]),
    }


@pytest.fixture(scope="module")
def sources() -> dict[str, str]:
    """Each PDL build's generated CUDA (TileLang's lowering: what nvcc would compile)."""
    from kernels_cuda import _tl

    return {name: _tl.kernel_source(thunk(), arch=ARCH) for name, (thunk, _, _) in _cases().items()}


#: PDL builds nvcc compiles here (the rest share their griddepcontrol code; lowering reads every one's source)
NVCC = ("gemv (o_proj)", "mla_decode_uv (merge + W_UV)", "greedy_sample")


@pytest.mark.parametrize("name", NVCC)
def test_pdl_builds_compile_for_sm90a(name, tmp_path, monkeypatch):
    from kernels_cuda import _tl

    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "tl-pdl"))
    src = _tl.compile_kernel(_cases()[name][0](), arch=ARCH).get_kernel_source()  # nvcc runs
    assert SYNC in src and TRIGGER in src


@pytest.mark.parametrize("name", list(_cases()))
def test_pdl_kernels_wait_before_reading_what_the_kernel_before_wrote(name, sources):
    src = sources[name]
    _, before, after = _cases()[name]
    body = src[src.index("{", src.index("__global__ void __launch_bounds__")):]  # past the parameter list
    assert SYNC in body and TRIGGER in body, f"{name}: no programmatic dependent launch in the PDL build"
    wait = body.index(SYNC)
    for marker in before:  # the independent loads are issued first, so they are in flight during the wait
        assert marker in body and body.index(marker) < wait, f"{name}: {marker!r} is not loaded before the wait"
    for marker in after:
        assert marker in body and body.index(marker) > wait, f"{name}: {marker!r} is read before the wait"
    if name == "mla_q_absorb_kv_write":  # the GEMV, the rope and the cache-write CTAs each wait in their branch
        assert body.count(SYNC) == 3, body.count(SYNC)
        syncs = [i for i in range(len(body)) if body.startswith(SYNC, i)]
        assert body.index("XR[") > syncs[1] and body.index("Cache[") > syncs[2]

"""CPU CI: every TileLang kernel of ``kernels_cuda`` lowers and compiles for Hopper (sm_90a) with the
local nvcc, without a GPU (nothing runs). One representative real-model configuration per kernel,
compiled into a fresh cache directory (so nvcc really runs), two at a time. ``-k moe_gemv`` compiles the
weight-streaming MoE's modules alone (``test_module_compiles_for_sm90a``; after the whole test, from its cache)."""

import concurrent.futures as cf
import importlib
import multiprocessing
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ARCH = "sm_90a"


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    path = os.path.join(home, "bin", "nvcc")
    return path if os.path.exists(path) else None


def _tilelang_missing() -> str | None:
    try:
        import tilelang  # noqa: F401
    except Exception as exc:  # not installed, or a broken install
        return f"tilelang is not importable ({type(exc).__name__}: {exc}); pip install '.[cuda]'"
    return None


pytestmark = [
    pytest.mark.skipif(_nvcc() is None, reason="nvcc not found (PATH or $CUDA_HOME/bin)"),
    pytest.mark.skipif(_tilelang_missing() is not None, reason=str(_tilelang_missing())),
]


def _kernel_names() -> list[tuple[str, int]]:
    from kernels_cuda import KERNEL_MODULES

    out = []
    for mod in KERNEL_MODULES:
        m = importlib.import_module(f"kernels_cuda.{mod}")
        out.extend((mod, i) for i in range(len(m.representative_kernels())))
    return out


def _compile_one(mod: str, index: int, cache_dir: str) -> dict:
    os.environ["TILELANG_CACHE_DIR"] = cache_dir
    from kernels_cuda import _tl

    m = importlib.import_module(f"kernels_cuda.{mod}")
    name, thunk = m.representative_kernels()[index]
    t0 = time.time()
    kernel = _tl.compile_kernel(thunk(), arch=ARCH)
    src = kernel.get_kernel_source()
    return {"name": name, "seconds": round(time.time() - t0, 1), "wgmma": "wgmma" in src,
            "mma": "mma_sync" in src, "tma": "tma_load(" in src, "cp_async": "cp_async_gs" in src,
            "fp8_mma": "kFloat8_e4m3, tl::DataType::kFloat8_e4m3, tl::DataType::kFloat32, 16, 8, 32" in src,
            "vec16": "uint4" in src,
            "chars": len(src)}


def test_import_is_light():
    code = "import sys, kernels_cuda; print('tilelang' in sys.modules, 'tvm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


@pytest.fixture(scope="module")
def tl_cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("tl") / "tl-cache")


def _check_vec16(r: dict) -> None:
    if r["name"].startswith(("moe_up", "moe_down")):  # the weight-streaming MoE reads 16-byte vectors
        assert r["vec16"], f"{r['name']}: expected 16-byte vector loads, got {r}"


def test_every_kernel_compiles_for_sm90a(tl_cache):
    jobs = _kernel_names()
    assert len(jobs) >= 14
    results, failures = [], []
    workers = max(1, min(2, os.cpu_count() or 1))
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that imported torch
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        futs = {pool.submit(_compile_one, mod, i, tl_cache): (mod, i) for mod, i in jobs}
        for fut in cf.as_completed(futs):
            try:
                results.append(fut.result())
            except Exception as exc:
                failures.append(f"{futs[fut]}: {type(exc).__name__}: {str(exc)[-2000:]}")
    assert not failures, "\n".join(failures)
    by_name = {r["name"]: r for r in results}
    # the matrix kernels must use Hopper's tensor-core and copy-engine paths
    for name, r in by_name.items():
        if name.startswith(("mla_prefill", "moe_gemm", "moe_sgemm")):
            assert r["wgmma"] and r["tma"], f"{name}: expected wgmma + TMA, got {r}"
        if name.startswith("mla_decode H128"):
            assert r["wgmma"] and r["cp_async"], f"{name}: expected wgmma + cp.async, got {r}"
        _check_vec16(r)
        if name.startswith(("add_rms_norm + gemv", "rms_norm + gemv", "mla_q_absorb_kv_write")):  # decode fusion
            assert r["vec16"], f"{name}: expected 16-byte vector loads, got {r}"
    assert by_name["mla_decode H16 bs16 split ragged"]["mma"]
    for name, r in by_name.items():  # the FP8 MoE's tensor-core up kernel: e4m3 x e4m3 -> f32 mma.sync m16n8k32
        if name.startswith("moe_up_fp8_mma"):
            assert r["fp8_mma"], f"{name}: expected the e4m3 m16n8k32 mma, got {r}"
    cubins = [p for ext in ("*.cubin", "*.so") for p in Path(tl_cache).rglob(ext)]
    assert cubins, "nvcc produced no binaries"
    print("\n".join(f"{r['name']}: {r['seconds']} s" for r in sorted(results, key=lambda r: r["name"])))


@pytest.mark.parametrize("mod", ["moe_gemv", "moe_gemv_fp8"])
def test_module_compiles_for_sm90a(mod, tl_cache):
    """One module's kernels in a fresh process (``-k moe_gemv``: the weight-streaming MoE's, bf16 and FP8)."""
    m = importlib.import_module(f"kernels_cuda.{mod}")
    ctx = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=max(1, min(2, os.cpu_count() or 1)), mp_context=ctx) as pool:
        results = list(pool.map(_compile_one, [mod] * len(m.representative_kernels()),
                                range(len(m.representative_kernels())), [tl_cache] * len(m.representative_kernels())))
    for r in results:
        _check_vec16(r)
    print("\n".join(f"{r['name']}: {r['seconds']} s" for r in results))

"""CPU CI: every TileLang kernel of ``kernels_cuda`` lowers and compiles for Hopper (sm_90a) with the
local nvcc, without a GPU (nothing runs). One representative real-model configuration per kernel.

Each kernel is lowered by TileLang (the CUDA source its compile hands to nvcc), then nvcc compiles the sources
to a cubin with TileLang's own device flags, many kernels to a translation unit, each in its own namespace: the
headers (TileLang's templates, CUTLASS/CuTe) cost about 3 s of every nvcc run, so one run per kernel spent most of
its time parsing them again. ``tests/test_pdl_compile.py`` compiles through TileLang's whole path (host wrapper
and library included). ``-k moe_gemv`` compiles the weight-streaming MoE's modules alone
(``test_module_compiles_for_sm90a``)."""

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
#: translation units per nvcc batch (two compile at a time on CI's two cores)
UNITS = 4


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


def _kernel_names(modules: list[str] | None = None) -> list[tuple[str, int]]:
    from kernels_cuda import KERNEL_MODULES

    out = []
    for mod in modules or KERNEL_MODULES:
        m = importlib.import_module(f"kernels_cuda.{mod}")
        out.extend((mod, i) for i in range(len(m.representative_kernels())))
    return out


def _lower_one(mod: str, index: int) -> dict:
    """The CUDA source of one representative kernel (TileLang's lowering: no nvcc) and what it uses."""
    from kernels_cuda import _tl

    m = importlib.import_module(f"kernels_cuda.{mod}")
    name, thunk = m.representative_kernels()[index]
    t0 = time.time()
    src = _tl.kernel_source(thunk(), arch=ARCH)
    return {"name": name, "seconds": round(time.time() - t0, 1), "wgmma": "wgmma" in src,
            "mma": "mma_sync" in src, "tma": "tma_load(" in src, "cp_async": "cp_async_gs" in src,
            "fp8_mma": "kFloat8_e4m3, tl::DataType::kFloat8_e4m3, tl::DataType::kFloat32, 16, 8, 32" in src,
            "vec16": "uint4" in src, "chars": len(src), "src": src}


_BODY_STARTS = ('extern "C"', "__global__", "template", "static", "namespace", "struct", "__device__")


def _unit(kernels: list[tuple[int, dict]]) -> tuple[str, list[tuple[int, int, str]]]:
    """One translation unit of several kernels' sources: the first one's preamble (every kernel's is the same up to
    its includes; other includes follow it), then each kernel in ``namespace k<i>`` with C++ linkage (two
    configurations of a kernel share its name). Returns the text and each kernel's line range, to name the kernel
    an nvcc error points into."""
    preamble: list[str] = []
    shared: list[str] | None = None
    body: list[str] = []
    ranges = []
    for i, r in kernels:
        lines = r["src"].splitlines()
        start = next(j for j, line in enumerate(lines) if line.startswith(_BODY_STARTS))
        rest = [line for line in lines[:start] if not line.startswith("#include")]
        if shared is None:
            shared, preamble = rest, lines[:start]
        assert rest == shared, f"{r['name']}: a preamble unlike the other kernels' ({rest[:5]})"
        preamble += [line for line in lines[:start] if line.startswith("#include") and line not in preamble]
        assert not any(line.lstrip().startswith("#") and not line.lstrip().startswith("#pragma")
                       for line in lines[start:]), f"{r['name']}: a preprocessor line in the kernel body"
        body.append(f"namespace k{i} {{  // {r['name']}")
        ranges.append((len(body), len(body) + len(lines) - start, r["name"]))
        body += [line.replace('extern "C" ', "", 1) if line.startswith('extern "C" ') else line
                 for line in lines[start:]]
        body.append(f"}}  // namespace k{i}")
    return "\n".join(preamble + body) + "\n", [(a + len(preamble), b + len(preamble), n) for a, b, n in ranges]


def _nvcc_unit(path: Path, ranges: list[tuple[int, int, str]]) -> str | None:
    """nvcc on one unit with the flags TileLang compiles a kernel with (``tilelang.cuda.backend``); None when it
    compiled, else its errors, each named by the kernel it points into."""
    from tilelang.env import CUTLASS_INCLUDE_DIR, TILELANG_TEMPLATE_PATH

    cubin = path.with_suffix(".cubin")
    cmd = [_nvcc(), "--cubin", "-O3", "-lineinfo", "-gencode", f"arch=compute_{ARCH[3:]},code={ARCH}",
           "-std=c++20", f"-I{TILELANG_TEMPLATE_PATH}", f"-I{CUTLASS_INCLUDE_DIR}", "-o", str(cubin), str(path)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode == 0 and cubin.stat().st_size > 0:
        return None
    errors = [line for line in out.stderr.splitlines() if " error" in line or "ptxas" in line]
    named = []
    for line in errors[:20]:
        at = line.split("(", 1)[1].split(")", 1)[0] if f"{path.name}(" in line else ""
        kernel = next((n for a, b, n in ranges if at.isdigit() and a < int(at) <= b), "?")
        named.append(f"[{kernel}] {line}")
    return f"nvcc failed on {path.name} (rc {out.returncode}):\n" + "\n".join(named or [out.stderr[-3000:]])


#: (module, index) -> its result, for each kernel this session compiled
_COMPILED: dict[tuple[str, int], dict] = {}


def _lower_and_compile(jobs: list[tuple[str, int]], workdir: Path) -> list[dict]:
    """Lowers ``jobs`` two at a time (fresh processes: no fork of one that imported torch), compiles them in
    ``UNITS`` translation units, two nvcc at a time, and checks that every kernel is in its unit's cubin. A kernel
    this session compiled already is not compiled again."""
    done = [_COMPILED[job] for job in jobs if job in _COMPILED]
    jobs = [job for job in jobs if job not in _COMPILED]
    if not jobs:
        return done
    ctx = multiprocessing.get_context("spawn")
    results, failures = [], []
    with cf.ProcessPoolExecutor(max_workers=max(1, min(2, os.cpu_count() or 1)), mp_context=ctx) as pool:
        futs = {pool.submit(_lower_one, mod, i): (mod, i) for mod, i in jobs}
        for fut in cf.as_completed(futs):
            try:
                results.append(fut.result() | {"job": futs[fut]})
            except Exception as exc:
                failures.append(f"{futs[fut]}: {type(exc).__name__}: {str(exc)[-2000:]}")
    assert not failures, "\n".join(failures)
    units: list[list[tuple[int, dict]]] = [[] for _ in range(min(UNITS, len(results)))]
    for i, r in sorted(enumerate(results), key=lambda ir: -ir[1]["chars"]):  # the longest first, to the lightest
        min(units, key=lambda u: sum(x["chars"] for _, x in u)).append((i, r))
    paths = []
    for u, kernels in enumerate(units):
        text, ranges = _unit(kernels)
        paths.append((workdir / f"unit{u}.cu", ranges, kernels))
        paths[-1][0].write_text(text)
    with cf.ThreadPoolExecutor(max_workers=2) as threads:
        errors = [e for e in threads.map(lambda p: _nvcc_unit(p[0], p[1]), paths) if e]
    assert not errors, "\n\n".join(errors)
    for path, _, kernels in paths:
        binary = path.with_suffix(".cubin").read_bytes()
        for i, r in kernels:  # C++ linkage: the entry's mangled name starts with its namespace
            assert f"_ZN{len(f'k{i}')}k{i}".encode() in binary, f"{r['name']}: not in {path.name}'s cubin"
    _COMPILED.update((r["job"], r) for r in results)
    return done + results


def test_import_is_light():
    code = "import sys, kernels_cuda; print('tilelang' in sys.modules, 'tvm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def _check_vec16(r: dict) -> None:
    if r["name"].startswith(("moe_up", "moe_down")):  # the weight-streaming MoE reads 16-byte vectors
        assert r["vec16"], f"{r['name']}: expected 16-byte vector loads, got {r}"


def test_every_kernel_compiles_for_sm90a(tmp_path):
    jobs = _kernel_names()
    assert len(jobs) >= 14
    results = _lower_and_compile(jobs, tmp_path)
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
    print("\n".join(f"{r['name']}: {r['seconds']} s" for r in sorted(results, key=lambda r: r["name"])))


@pytest.mark.parametrize("mod", ["moe_gemv", "moe_gemv_fp8"])
def test_module_compiles_for_sm90a(mod, tmp_path):
    """One module's kernels (``-k moe_gemv``: the weight-streaming MoE's, bf16 and FP8; compiled here when the
    whole test did not run first)."""
    for r in _lower_and_compile(_kernel_names([mod]), tmp_path):
        _check_vec16(r)

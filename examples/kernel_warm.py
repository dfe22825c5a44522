"""Compile every TileLang kernel that the GPU tests and ``kernel_bench.py`` use, without a GPU, into a
TileLang cache folder, and pack it (a GPU machine then starts with no compile time: it sets
``TILELANG_CACHE_DIR`` to the unpacked folder).

    python examples/kernel_warm.py [--cache .gpu/tlcache] [--pack .gpu/tlcache.tar.xz]
                                   [--engine-shapes v2-lite,v3-slice | --engine-shapes none]

``--engine-shapes`` (default v2-lite,v3-slice,v4-flash-slice,v4-graph-test) also compiles the kernels the
engine's bf16 forward (and its FP8-weight decode steps at 64 and 256 tokens) uses for those shapes
(``engine_warm.py``: the full-model suite of ``benchmark.py --suite h200``, and the random V4 of
``tests/test_v4_graphs.py``).
"""

import argparse
import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", default=str(ROOT / ".gpu" / "tlcache"))
    ap.add_argument("--pack", default=str(ROOT / ".gpu" / "tlcache.tar.xz"))
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--engine-shapes", default="v2-lite,v3-slice,v4-flash-slice,v4-graph-test",
                    help="model shapes, or 'none'")
    args = ap.parse_args()
    env = dict(os.environ, DEEPINFER_TL_DRYRUN="1", TILELANG_CACHE_DIR=args.cache, CUDA_VISIBLE_DEVICES="")
    if not args.skip_tests:
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        str(ROOT / "tests" / "test_kernels_cuda_gpu.py"),
                        str(ROOT / "tests" / "test_greedy_sample_gpu.py"),
                        str(ROOT / "tests" / "test_moe_gemv_gpu.py"),
                        str(ROOT / "tests" / "test_cuda_graphs_gpu.py"),
                        str(ROOT / "tests" / "test_kernels_cuda_v4_gpu.py"),
                        str(ROOT / "tests" / "test_fp8_gemm_gpu.py"),
                        # the decode FP8 GEMV and MoE (both up kernels: the test runs fma and mma)
                        str(ROOT / "tests" / "test_fp8_gemv_gpu.py")], env=env, cwd=ROOT, check=True)
    if not args.skip_bench:
        subprocess.run([sys.executable, str(ROOT / "examples" / "kernel_bench.py"), "--dry"], env=env, cwd=ROOT,
                       check=True)
        subprocess.run([sys.executable, str(ROOT / "examples" / "fp8_bench.py"), "--dry", "--out", os.devnull],
                       env=env, cwd=ROOT, check=True)
        subprocess.run([sys.executable, str(ROOT / "examples" / "moe_fp8_bench.py"), "--dry"], env=env, cwd=ROOT,
                       check=True)
    if args.engine_shapes != "none":
        subprocess.run([sys.executable, str(ROOT / "examples" / "engine_warm.py"), "--shapes", args.engine_shapes,
                        "--fp8-tokens", "64,256"], env=env, cwd=ROOT, check=True)
    if args.pack:
        with tarfile.open(args.pack, "w:xz") as tar:
            tar.add(args.cache, arcname="tlcache")
        print(f"packed {args.cache} -> {args.pack} ({Path(args.pack).stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()

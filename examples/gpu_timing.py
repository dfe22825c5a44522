"""Timing helpers and the measured ceilings shared by ``kernel_bench.py`` and the H200 suite of
``benchmark.py``.

The ceilings are what this device achieves, measured in the same run as the figures they scale:

* ``read_GBps``: a full read of a 4 GiB bf16 buffer (``sum``), the bandwidth decode is bound by;
* ``copy_GBps``: device-to-device copy, read + write bytes;
* ``matmul_TFLOPs``: a bf16 8192^3 matmul (cuBLAS), the compute peak prefill is bound by.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable

import torch


def timed(fn: Callable[[], object], warmup: int = 2, reps: int = 20, budget_s: float = 2.0) -> float:
    """Median milliseconds of ``fn()`` over up to ``reps`` CUDA-event-timed runs (fewer when each is slow)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    t_end = time.perf_counter() + budget_s
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
        if time.perf_counter() > t_end and len(times) >= 3:
            break
    return statistics.median(times)


def graphed(fn: Callable[[], object]) -> Callable[[], None]:
    """``fn`` captured once in a CUDA graph (after a warm-up call); returns the replay."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def measure_ceilings(device: str = "cuda", gib: float = 4.0, n: int = 8192) -> dict[str, float]:
    """Achievable read / copy bandwidth (GB/s) and bf16 matmul peak (TFLOP/s) on ``device``.

    On a CPU (the tiny CI configuration) the same operations are wall-clock timed, much smaller."""
    torch.backends.cuda.matmul.allow_tf32 = False
    if torch.device(device).type != "cuda":
        return _cpu_ceilings()
    elems = int(gib * 2**30) // 2
    src = torch.randn(elems // 1024, 1024, device=device).to(torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms = timed(functools.partial(dst.copy_, src), reps=10)
    read_ms = timed(functools.partial(src.sum, dtype=torch.float32), reps=10)
    del src, dst
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    mm_ms = timed(functools.partial(torch.matmul, a, b), reps=10)
    del a, b
    torch.cuda.empty_cache()
    nbytes = elems * 2
    return {"copy_GBps": round(2 * nbytes / copy_ms / 1e6, 1), "read_GBps": round(nbytes / read_ms / 1e6, 1),
            "matmul_TFLOPs": round(2 * n**3 / mm_ms / 1e9, 1)}


def _cpu_ceilings() -> dict[str, float]:
    def wall_ms(fn: Callable[[], object], reps: int = 5) -> float:
        fn()
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e3)
        return statistics.median(ts)

    src = torch.randn(8 * 2**20)
    dst = torch.empty_like(src)
    copy_ms = wall_ms(functools.partial(dst.copy_, src))
    read_ms = wall_ms(src.sum)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    mm_ms = wall_ms(functools.partial(torch.matmul, a, b))
    nbytes = src.numel() * 4
    return {"copy_GBps": round(2 * nbytes / copy_ms / 1e6, 1), "read_GBps": round(nbytes / read_ms / 1e6, 1),
            "matmul_TFLOPs": round(2 * 512**3 / mm_ms / 1e9, 4)}

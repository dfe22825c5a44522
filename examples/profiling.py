"""``PROFILE=1`` support of the benchmark: a torch.profiler trace (chrome JSON, gzipped) of a region and
its kernel breakdown (top kernels by device time, per step and as a share of the step's wall time)."""

from __future__ import annotations

import gzip
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


def kernel_breakdown(trace: dict, steps: int, wall_s: float, on_gpu: bool, top: int = 25) -> dict:
    """Device time by kernel name from a chrome trace (``cat`` kernel/memcpy/memset on a GPU; top-level
    ``cpu_op`` events on a CPU run), sorted by total time."""
    cats = {"kernel", "gpu_memcpy", "gpu_memset"} if on_gpu else {"cpu_op"}
    totals: dict[str, list[float]] = {}
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") == "X" and ev.get("cat") in cats:
            row = totals.setdefault(ev["name"], [0.0, 0])
            row[0] += float(ev.get("dur", 0.0))
            row[1] += 1
    busy_us = sum(t for t, _ in totals.values())
    step_us = wall_s * 1e6 / steps
    rows = [{"name": name[:120], "calls_per_step": n / steps, "us_per_step": t / steps,
             "share_of_busy": t / busy_us if busy_us else 0.0, "share_of_step": t / steps / step_us}
            for name, (t, n) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]]
    launches = sum(n for _, n in totals.values())
    return {"steps": steps, "step_ms": step_us / 1e3, "device_busy_ms_per_step": busy_us / steps / 1e3,
            "launches_per_step": launches / steps, "kernels": rows}


def profile_region(fn: Callable[[], object], steps: int, out_dir: Path, name: str, device: torch.device,
                   layers: int | None = None) -> dict:
    """Run ``fn`` (``steps`` engine steps) under the profiler; write ``{name}.trace.json.gz`` and
    ``{name}.kernels.txt`` to ``out_dir``; return the breakdown. ``layers``: the model's layer count, for
    ``launches_per_layer`` (all of a step's launches over its layers: embedding, LM head and sampling included)."""
    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    out_dir.mkdir(parents=True, exist_ok=True)
    raw = out_dir / f"{name}.trace.json"
    with profile(activities=activities) as prof:
        t = time.perf_counter()
        fn()
        if on_gpu:
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t
    prof.export_chrome_trace(str(raw))
    trace = json.loads(raw.read_text())
    with open(raw, "rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    table = kernel_breakdown(trace, steps, wall, on_gpu)
    per_layer = ""
    if layers:
        table["launches_per_layer"] = table["launches_per_step"] / layers
        per_layer = f" ({table['launches_per_layer']:.1f} per layer of {layers})"
    lines = [f"{name}: {steps} steps, {table['step_ms']:.3f} ms/step wall, "
             f"{table['device_busy_ms_per_step']:.3f} ms/step {'device' if on_gpu else 'cpu-op'} time, "
             f"{table['launches_per_step']:.0f} launches/step{per_layer}",
             f"{'us/step':>10} {'calls':>6} {'busy%':>6} {'step%':>6}  kernel"]
    for r in table["kernels"]:
        lines.append(f"{r['us_per_step']:>10.1f} {r['calls_per_step']:>6.1f} {r['share_of_busy'] * 100:>5.1f}% "
                     f"{r['share_of_step'] * 100:>5.1f}%  {r['name']}")
    text = "\n".join(lines)
    (out_dir / f"{name}.kernels.txt").write_text(text + "\n")
    print(text, flush=True)
    table["trace"] = f"{raw.name}.gz"
    return table

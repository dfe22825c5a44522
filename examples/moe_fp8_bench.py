"""FP8 fused MoE at decode and prefill batches: the pipeline (rows as the wgmma's M) against ``moe_stream_fp8``
(weights as the wgmma's M), per MoE layer, whole call and stage by stage, with each path's error.

    python examples/moe_fp8_bench.py --out moe_fp8.json [--shapes v2-lite,v3] [--batches 5,16,64,256,512,2048]
                                     [--variants 64,256]
    DEEPINFER_TL_DRYRUN=1 TILELANG_CACHE_DIR=... python examples/moe_fp8_bench.py --dry   # compile only

Shapes as the engine calls ``fused_moe_fp8`` with the shared experts folded in (``moe_small_bench.SHAPES``),
e4m3 weights with one scale per 128 x 128 tile. Routing is uniform random (``moe_small_bench.routing``). The bytes
of a call are the e4m3 weights of the distinct experts its ids touch plus their scales and the activations; the
figure is TB/s of those bytes against the read ceiling measured in the same run. Each timing replays, from one
CUDA graph, ``CALLS`` calls over up to ``LAYERS`` weight copies with fresh ids per call (so a call does not find
the previous call's experts in L2). ``dispatch`` in each row names the path ``fused_moe_fp8`` takes there (the stream
path where it applies, unless ``DEEPINFER_FP8_MOE_STREAM=0``).
``--variants T`` also times ``moe_stream_fp8``'s tile variants (``VARIANTS``) at T tokens.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_small_bench import CALLS, SHAPES, cycle, figure, routing  # noqa: E402

#: ``moe_stream_fp8`` tile variants (overrides of its ``CONFIG``)
VARIANTS = {
    "default": {},
    "stages 3": {"stages1": 3, "stages2": 3},
    "stages 6": {"stages1": 6, "stages2": 6},
    "gemm2 2 CTAs an SM": {"blocks2": 2},
    "16-row blocks": {"BT": 16},
    "32-row blocks": {"BT": 32},
    "64-row blocks": {"BT": 64},
}


def fp8_experts(E: int, n: int, k: int, dev: str, dry: bool):
    """e4m3 weights [E, n, k] (one expert at a time: V3's w13 is 7.5 GB) and float32 scales [E, n/128, k/128]."""
    if dry:
        return (torch.empty(E, n, k, dtype=torch.float8_e4m3fn, device="meta"),
                torch.empty(E, n // 128, k // 128, device="meta"))
    w = torch.empty(E, n, k, dtype=torch.float8_e4m3fn, device=dev)
    for e in range(E):
        w[e] = (torch.randn(n, k, device=dev) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = (torch.rand(E, n // 128, k // 128, device=dev) + 0.5) * (k ** -0.5 / 64)
    return w, s


def call_bytes(ids: torch.Tensor, E_all: int, C: int, I: int, T: int) -> float:
    experts = int(torch.unique(ids[(ids >= 0) & (ids < E_all)]).numel())
    return experts * 3 * I * C * (1 + 4 / 128 ** 2) + T * C * 2 * 2


def stage_us(step_lists: list) -> dict:
    from gpu_timing import graphed, timed

    res = {}
    for i, (name, _) in enumerate(step_lists[0]):
        only = graphed(cycle([s[i][1] for s in step_lists]))
        res[name] = round(timed(only, warmup=1, reps=10) / len(step_lists) * 1e3, 2)
    return res


def timed_call(calls, nbytes: float, read_GBps: float, fn) -> dict:
    """``fn`` over ``calls`` replayed from one graph: us a call, TB/s and % of the read ceiling."""
    from gpu_timing import graphed, timed

    g = graphed(cycle([functools.partial(fn, *a) for a in calls]))
    return figure(timed(g, warmup=1, reps=10) / len(calls), nbytes, read_GBps)


def run_steps(make_steps, *args, **kw) -> torch.Tensor:
    steps, finish = make_steps(*args, **kw)
    for _, step in steps:
        step()
    return finish()


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(f"{((got.double() - want.double()).norm() / want.double().norm()).item():.2e}")


def bench_shape(name: str, batches: list[int], read_GBps: float, dry: bool, variant_batches: tuple[int, ...]) -> dict:
    from kernels_cpu.fp8_ops import fused_moe_fp8 as ref
    from kernels_cuda import moe_stream_fp8
    from kernels_cuda.fp8_gemm import MOE_LARGE, MOE_SMALL, moe_fp8_steps

    E, S, C, I, k = SHAPES[name]
    dev = "cpu" if dry else "cuda"
    layer_bytes = (E + S) * 3 * I * C
    layers = 1 if dry else max(1, min(4, -(-int(3e9) // layer_bytes)))
    w13s = [fp8_experts(E + S, 2 * I, C, dev, dry) for _ in range(layers)]
    w2s = [fp8_experts(E + S, C, I, dev, dry) for _ in range(layers)]
    gen = torch.Generator().manual_seed(0)
    out: dict = {"experts": E, "shared": S, "hidden": C, "width": I, "top_k": k, "layers_cycled": layers}
    for T in batches:
        calls = []
        for c in range(CALLS):
            w, ids = routing(T, E, S, k, gen, dev)
            x = (torch.zeros(T, C) if dry else torch.randn(T, C, generator=gen)).to(dev, torch.bfloat16)
            (w13, s13), (w2, s2) = w13s[c % layers], w2s[c % layers]
            calls.append((x, w13, s13, w2, s2, w, ids))
        pipe_cfg = MOE_SMALL if T * (k + S) <= 48 * (E + S) else MOE_LARGE
        stream_ok = moe_stream_fp8.applies(*calls[0][:5], calls[0][6])
        if dry:
            moe_fp8_steps(*calls[0], cfg=pipe_cfg)
            if stream_ok:
                for over in (VARIANTS.values() if T in variant_batches else [{}]):
                    moe_stream_fp8.stream_steps(*calls[0], **over)
            continue
        nbytes = sum(call_bytes(a[6], E + S, C, I, T) for a in calls) / CALLS
        row: dict = {"MB_per_call": round(nbytes / 1e6, 1),
                     "dispatch": "stream" if stream_ok and moe_stream_fp8.enabled() else "pipeline"}

        whole = functools.partial(timed_call, calls, nbytes, read_GBps)
        run_pipeline = functools.partial(run_steps, moe_fp8_steps, cfg=pipe_cfg)
        run_stream = functools.partial(run_steps, moe_stream_fp8.stream_steps)
        x, w13, s13, w2, s2, w, ids = calls[0]
        uniq = torch.unique(ids)  # the reference over the touched experts only
        want = ref(x, w13[uniq], s13[uniq], w2[uniq], s2[uniq], w, torch.searchsorted(uniq, ids))
        row["pipeline"] = whole(run_pipeline)
        row["err_pipeline"] = rel_err(run_pipeline(*calls[0]), want)
        row["pipeline_stages_us"] = stage_us([moe_fp8_steps(*a, cfg=pipe_cfg)[0] for a in calls])
        line = (f"{name:>7} T={T:>4} {row['MB_per_call']:8.1f} MB | pipeline {row['pipeline']['us']:8.2f} us "
                f"{row['pipeline']['pct_read']:5.1f}% err {row['err_pipeline']:.1e}")
        if stream_ok:
            row["stream"] = whole(run_stream)
            row["err_stream"] = rel_err(run_stream(*calls[0]), want)
            row["stream_stages_us"] = stage_us([moe_stream_fp8.stream_steps(*a)[0] for a in calls])
            row["speedup_stream"] = round(row["pipeline"]["us"] / row["stream"]["us"], 2)
            p, q = row["pipeline_stages_us"], row["stream_stages_us"]
            line += (f" | stream {row['stream']['us']:8.2f} us {row['stream']['pct_read']:5.1f}% "
                     f"x{row['speedup_stream']:.2f} err {row['err_stream']:.1e}\n        "
                     + ", ".join(f"{n} {p[n]:.1f} -> {q[n]:.1f}" for n in p))
        print(line, flush=True)
        if stream_ok and T in variant_batches:
            row["variants"] = {}
            for tag, over in VARIANTS.items():
                fig = whole(functools.partial(run_stream, **over))
                row["variants"][tag] = fig
                print(f"          variant {tag:>22}: {fig['us']:8.2f} us {fig['pct_read']:5.1f}%", flush=True)
        out[f"T={T}"] = row
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="v2-lite,v3")
    ap.add_argument("--batches", default="5,9,16,32,64,128,256,512,1024,2048")
    ap.add_argument("--variants", default="64,256", help="batches at which to time the tile variants")
    ap.add_argument("--out", default=None)
    ap.add_argument("--dry", action="store_true", help="compile only (DEEPINFER_TL_DRYRUN=1, no GPU)")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    var = tuple(int(b) for b in args.variants.split(",") if b)
    read = 0.0
    res: dict = {}
    if not args.dry:
        from gpu_timing import measure_ceilings

        ceil = measure_ceilings("cuda")
        read = ceil["read_GBps"]
        res["ceilings"] = ceil
        res["device"] = torch.cuda.get_device_name()
    for name in args.shapes.split(","):
        res[name] = bench_shape(name, batches, read, args.dry, var)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

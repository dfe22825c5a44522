"""Fused MoE at decode batches: the tensor-core pipeline (align, gather, gemm1, gemm2, combine) against the
weight-streaming path (``kernels_cuda.moe_gemv``: two launches), per MoE layer.

    python examples/moe_small_bench.py --out moe_small.json [--shapes v2-lite,v3] [--batches 1,2,4,8,16,64,256]
                                       [--sweep] [--stream-variants 64,256]
    DEEPINFER_TL_DRYRUN=1 TILELANG_CACHE_DIR=... python examples/moe_small_bench.py --dry   # compile only

Shapes as the engine calls ``fused_moe`` with the shared experts folded in: V2-Lite 64 routed experts top-6 +
2 shared (hidden 2048, width 1408), V3 256 top-8 + 1 shared (hidden 7168, width 2048). Routing is uniform
random (distinct experts per token). The bytes of a call are the weights of the distinct experts its ids
touch (plus activations); the figure is TB/s of those bytes against the read ceiling measured in the same
run (``gpu_timing.measure_ceilings``: a 4 GiB ``sum``; the copy ceiling is reported beside it). Each timing
replays, from one CUDA graph, calls over ``LAYERS`` weight copies with fresh ids per call, so that a call
does not find the previous call's experts in the 50 MB L2 (as consecutive layers of the model). The
weight-streaming path runs only up to ``moe_gemv.MAX_TOKENS`` tokens in the engine; here it is timed up to
``--max-small`` so the crossover is visible. Each batch also times the down kernel alone in each of
``DOWN_VARIANTS`` ("loop": ``build_down``, a warp walks a column's K slots; "slots": ``moe_down_slots``, K warps a
CTA; TB/s of the W2 rows it reads), at a token per CTA and at the row bucket per CTA, and the error of the whole
path with each. ``--sweep`` times other CTA sizes of the two kernels at 1 token (``SWEEP``).

Above 8 tokens the engine takes ``kernels_cuda.moe_stream`` (tokens as the mma's N): each batch times it beside
the pipeline, whole and stage by stage (align, gather, gemm1, gemm2, combine; the GEMMs in TB/s of the weights
they read), and ``--stream-variants T`` times its tile variants (and the pipeline's GEMMs with two CTAs an SM) at
T tokens.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

#: name: (routed experts, shared experts, hidden, expert width, top-k)
SHAPES = {"v2-lite": (64, 2, 2048, 1408, 6), "v3": (256, 1, 7168, 2048, 8)}
CALLS = 8  # calls per timed graph (each with its own ids)
#: one-token variants (overrides of ``moe_gemv.CONFIG``): up kernel and its threads; the loop down kernel's threads
#: and the CTAs per SM its registers allow; the slots down kernel's columns per CTA and CTAs per SM
SWEEP = [dict(up=up, up_threads=ut, down="loop", down_threads=dt, down_blocks=db) for up, ut, dt, db in
         [("fma", 256, 128, 4), ("fma", 128, 128, 4), ("mma", 256, 128, 2), ("fma", 256, 128, 2),
          ("fma", 256, 256, 2), ("fma", 256, 128, 8), ("fma", 256, 64, 8)]]
SWEEP += [dict(up="fma", down="slots", down_cols=n, down_slot_blocks=b) for n, b in
          [(1, 2), (1, 3), (2, 2), (2, 3), (4, 1), (4, 2), (8, 1)]]
#: the down kernels timed alone at every batch (overrides of ``moe_gemv.CONFIG``)
DOWN_VARIANTS = {"loop": {"down": "loop"}, "slots": {"down": "slots"},
                 "slots_c1": {"down": "slots", "down_cols": 1}, "slots_c4": {"down": "slots", "down_cols": 4}}


def sweep_tag(kw: dict) -> str:
    if kw["down"] == "slots":
        return f"up_{kw['up']}_slots_c{kw['down_cols']}x{kw['down_slot_blocks']}"
    return f"up_{kw['up']}{kw['up_threads']}_down{kw['down_threads']}x{kw['down_blocks']}"


def routing(T: int, E: int, S: int, k: int, gen: torch.Generator, dev: str):
    routed = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    ids = torch.cat((routed, torch.arange(E, E + S).expand(T, S)), 1).to(dev)
    w = torch.cat((torch.rand(T, k, generator=gen), torch.ones(T, S)), 1).to(dev, torch.bfloat16)
    return w, ids


def call_bytes(ids: torch.Tensor, E_all: int, C: int, I: int, T: int) -> int:
    experts = int(torch.unique(ids[(ids >= 0) & (ids < E_all)]).numel())
    return experts * 3 * I * C * 2 + T * C * 2 * 2 + ids.numel() * I * 2 * 2


def cycle(fns):
    def run():
        for f in fns:
            f()
    return run


def figure(ms: float, nbytes: float, read_GBps: float) -> dict:
    tbps = nbytes / (ms * 1e-3) / 1e12
    return {"us": round(ms * 1e3, 2), "TBps": round(tbps, 3), "pct_read": round(100 * tbps * 1e3 / read_GBps, 1)}


def stage_us(step_lists: list, nbytes: dict, read_GBps: float) -> dict:
    """Each launch alone, graphed over the calls: us (and TB/s where ``nbytes`` names its bytes)."""
    from gpu_timing import graphed, timed

    res = {}
    for i, (name, _) in enumerate(step_lists[0]):
        only = graphed(cycle([s[i][1] for s in step_lists]))
        ms = timed(only, warmup=1, reps=10) / len(step_lists)
        res[name] = figure(ms, nbytes[name], read_GBps) if name in nbytes else {"us": round(ms * 1e3, 2)}
    return res


def gemm_bytes(calls, E_all: int, C: int, I: int) -> dict:
    hit = sum(int(torch.unique(a[4][(a[4] >= 0) & (a[4] < E_all)]).numel()) for a in calls) / len(calls)
    return {"gemm1": hit * 2 * I * C * 2, "gemm2": hit * C * I * 2}


def stream_row(row: dict, calls, read_GBps: float, E_all: int, C: int, I: int) -> str:
    """``moe_stream`` beside the pipeline: whole call, error against float32, both paths stage by stage."""
    from gpu_timing import graphed, timed

    from kernels_cpu import ops as ref
    from kernels_cuda import moe, moe_stream

    nbytes = sum(call_bytes(a[4], E_all, C, I, a[0].shape[0]) for a in calls) / len(calls)
    new = graphed(cycle([functools.partial(moe_stream.fused_moe_stream, *a) for a in calls]))
    row["stream"] = figure(timed(new, warmup=1, reps=10) / len(calls), nbytes, read_GBps)
    x, w13, w2, w, ids = calls[0]
    want = ref.fused_moe(x.float(), w13.float(), w2.float(), w.float(), ids)
    got = moe_stream.fused_moe_stream(x, w13, w2, w, ids).float()
    row["err_stream"] = float(f"{((got - want).abs().max() / want.abs().max()).item():.2e}")
    gb = gemm_bytes(calls, E_all, C, I)
    row["pipeline_stages"] = stage_us([moe.moe_steps(*a)[0] for a in calls], gb, read_GBps)
    row["stream_stages"] = stage_us([moe_stream.stream_steps(*a)[0] for a in calls], gb, read_GBps)
    row["speedup_stream"] = round(row["pipeline"]["us"] / row["stream"]["us"], 2)
    p, q = row["pipeline_stages"], row["stream_stages"]
    return (f" | stream {row['stream']['us']:8.2f} us {row['stream']['pct_read']:5.1f}% x{row['speedup_stream']:.2f}"
            f" err {row['err_stream']:.1e}\n        gemm1 {p['gemm1']['us']:.1f} -> {q['gemm1']['us']:.1f} us "
            f"({p['gemm1']['TBps']:.2f} -> {q['gemm1']['TBps']:.2f} TB/s), gemm2 {p['gemm2']['us']:.1f} -> "
            f"{q['gemm2']['us']:.1f} us ({p['gemm2']['TBps']:.2f} -> {q['gemm2']['TBps']:.2f} TB/s), align "
            f"{p['align']['us']:.1f}/{q['align']['us']:.1f} gather {p['gather']['us']:.1f}/"
            f"{q.get('gather', {'us': 0.0})['us']:.1f} "
            f"combine {p['combine']['us']:.1f}/{q['combine']['us']:.1f}")


#: ``moe_stream`` tile variants (overrides of ``CONFIG``) and the pipeline's GEMMs with 2 CTAs an SM
STREAM_VARIANTS = {
    "default (g1 BK128 s3 x2, g2 BK128 s3 x3)": {},
    "g1 BK64 s4 x2 | g2 BK64 s4 x3": {"BK1": 64, "stages1": 4, "BK2": 64, "stages2": 4},
    "16-row blocks": {"BT": 16},
    "32-row blocks": {"BT": 32},
    "64-row blocks": {"BT": 64},
}


def variants(calls, read_GBps: float, E_all: int, C: int, I: int, dry: bool = False) -> dict:
    from kernels_cuda import moe, moe_stream

    gb = gemm_bytes(calls, E_all, C, I) if not dry else {}
    res = {}
    for tag, over in STREAM_VARIANTS.items():
        if dry:
            moe_stream.fused_moe_stream(*calls[0], **over)
            continue
        st = stage_us([moe_stream.stream_steps(*a, **over)[0] for a in calls], gb, read_GBps)
        res[tag] = {**{k: st[k] for k in ("gemm1", "gemm2")}, "stages_us": round(sum(v["us"] for v in st.values()), 2)}
        print(f"    variant {tag:>44}: gemm1 {st['gemm1']['us']:7.2f} us {st['gemm1']['TBps']:.2f} TB/s, "
              f"gemm2 {st['gemm2']['us']:7.2f} us {st['gemm2']['TBps']:.2f} TB/s, all stages "
              f"{res[tag]['stages_us']:.1f} us", flush=True)
    occ = {**moe.SMALL, "blocks": 2}
    if dry:
        moe._fused(*calls[0], occ, None)
        return res
    st = stage_us([moe.moe_steps(*a, cfg=occ)[0] for a in calls], gb, read_GBps)
    res["pipeline x2"] = {k: st[k] for k in ("gemm1", "gemm2")}
    print(f"    variant {'pipeline SMALL, 2 CTAs an SM':>44}: gemm1 {st['gemm1']['us']:7.2f} us "
          f"{st['gemm1']['TBps']:.2f} TB/s, gemm2 {st['gemm2']['us']:7.2f} us {st['gemm2']['TBps']:.2f} TB/s",
          flush=True)
    return res


def bench_shape(name: str, batches: list[int], max_small: int, read_GBps: float, dry: bool, sweep: bool,
                stream_variants: tuple[int, ...] = ()) -> dict:
    from gpu_timing import graphed, timed

    from kernels_cpu import ops as ref
    from kernels_cuda import moe, moe_gemv, moe_stream

    E, S, C, I, k = SHAPES[name]
    dev = "cpu" if dry else "cuda"
    layer_bytes = (E + S) * 3 * I * C * 2
    layers = 1 if dry else max(1, min(4, -(-int(3e9) // layer_bytes)))  # >= ~3 GB of weights where cheap
    mk = torch.empty if dry else (lambda *s, **kw: torch.empty(*s, **kw).normal_(0, s[-1] ** -0.5))
    w13s = [mk(E + S, 2 * I, C, dtype=torch.bfloat16, device=dev) for _ in range(layers)]
    w2s = [mk(E + S, C, I, dtype=torch.bfloat16, device=dev) for _ in range(layers)]
    gen = torch.Generator().manual_seed(0)
    out: dict = {"experts": E, "shared": S, "hidden": C, "width": I, "top_k": k, "layers_cycled": layers}
    for T in batches:
        calls = []
        for c in range(CALLS):
            w, ids = routing(T, E, S, k, gen, dev)
            x = torch.randn(T, C, generator=gen).to(dev, torch.bfloat16)
            calls.append((x, w13s[c % layers], w2s[c % layers], w, ids))
        nbytes = sum(call_bytes(a[4], E + S, C, I, T) for a in calls) / CALLS
        small_ok = moe_gemv.applies(*calls[0], max_tokens=max_small)
        ups = ("fma", "mma") if moe_gemv.mma_fits(C) else ("fma",)
        if dry:
            moe._fused(*calls[0], None, None)
            moe_stream.fused_moe_stream(*calls[0])
            if T in stream_variants:
                variants(calls, read_GBps, E + S, C, I, dry=True)
            for up in ups if small_ok else ():
                for down_tokens in (1, 0):
                    for _, st in moe_gemv.small_steps(*calls[0], up=up, down_tokens=down_tokens)[0]:
                        st()
            for kw in DOWN_VARIANTS.values() if small_ok else ():
                for down_tokens in (1, 0):
                    moe_gemv.small_steps(*calls[0], down_tokens=down_tokens, **kw)[0][1][1]()
            continue
        row: dict = {"MB_per_call": round(nbytes / 1e6, 1)}
        old = graphed(cycle([functools.partial(moe._fused, *a, None, None) for a in calls]))
        row["pipeline"] = figure(timed(old, warmup=1, reps=10) / CALLS, nbytes, read_GBps)
        line = ""
        if small_ok:
            x, w13, w2, w, ids = calls[0]
            uniq = torch.unique(ids)  # the reference in float32 over the touched experts only (V3: 22 GB)
            want = ref.fused_moe(x.float(), w13[uniq].float(), w2[uniq].float(), w.float(),
                                 torch.searchsorted(uniq, ids))
            for up in ups:  # the whole path with either up kernel, then each kernel alone
                new = graphed(cycle([functools.partial(moe_gemv.fused_moe_small, *a, up=up) for a in calls]))
                row[f"streaming_{up}"] = figure(timed(new, warmup=1, reps=10) / CALLS, nbytes, read_GBps)
                got = moe_gemv.fused_moe_small(x, w13, w2, w, ids, up=up).float()
                row[f"err_{up}"] = float(f"{((got - want).abs().max() / want.abs().max()).item():.2e}")
                only = graphed(cycle([moe_gemv.small_steps(*a, up=up)[0][0][1] for a in calls]))
                row[f"up_{up}_us"] = round(timed(only, warmup=1, reps=10) / CALLS * 1e3, 2)
                line += (f" | {up} {row[f'streaming_{up}']['us']:7.2f} us {row[f'streaming_{up}']['pct_read']:5.1f}%"
                         f" (up {row[f'up_{up}_us']:.2f}) err {row[f'err_{up}']:.1e}")
            line += down_table(row, calls, T, read_GBps, E + S, C, I, want)
            best = min(row[f"streaming_{up}"]["us"] for up in ups)
            row["speedup_best"] = round(row["pipeline"]["us"] / best, 2)
            line += f" | x{row['speedup_best']:.2f}"
        if T > max_small or not small_ok:
            line += stream_row(row, calls, read_GBps, E + S, C, I)
        out[f"T={T}"] = row
        print(f"{name:>7} T={T:>3} {row['MB_per_call']:7.1f} MB | pipeline {row['pipeline']['us']:8.2f} us "
              f"{row['pipeline']['TBps']:5.2f} TB/s {row['pipeline']['pct_read']:5.1f}%" + line, flush=True)
        if T in stream_variants:
            out[f"variants_T={T}"] = variants(calls, read_GBps, E + S, C, I)
    if sweep:
        out["sweep_T1"] = sweep_T1(name, w13s, w2s, gen, dev, read_GBps, dry)
    return out


def down_table(row: dict, calls, T: int, read_GBps: float, E_all: int, C: int, I: int, want) -> str:
    """Each of ``DOWN_VARIANTS`` alone, a token per CTA and (T > 1) the row bucket per CTA: us and % of the read
    ceiling for the W2 rows it reads; and the whole path's error with it (the default up kernel)."""
    from gpu_timing import graphed, timed

    from kernels_cuda import moe_gemv

    dbytes = gemm_bytes(calls, E_all, C, I)["gemm2"]
    line, x, w13, w2, w, ids = "\n       ", *calls[0]
    for tag, kw in DOWN_VARIANTS.items():
        for down_tokens in (1, 0) if T > 1 else (1,):  # a token per CTA, or the row bucket per CTA
            only = graphed(cycle([moe_gemv.small_steps(*a, down_tokens=down_tokens, **kw)[0][1][1] for a in calls]))
            fig = figure(timed(only, warmup=1, reps=10) / CALLS, dbytes, read_GBps)
            row[f"down_{tag}_tokens{down_tokens}"] = fig
            line += f" {tag}/{down_tokens or 'bucket'} {fig['us']:.2f} us {fig['pct_read']:.0f}%"
        got = moe_gemv.fused_moe_small(x, w13, w2, w, ids, **kw).float()
        row[f"err_down_{tag}"] = float(f"{((got - want).abs().max() / want.abs().max()).item():.2e}")
        line += f" err {row[f'err_down_{tag}']:.1e} |"
    return line


def sweep_T1(name, w13s, w2s, gen, dev, read_GBps, dry) -> dict:
    """CTA sizes of the two kernels at one token (V2-Lite's decision at batch 1)."""
    from gpu_timing import graphed, timed

    from kernels_cuda import moe_gemv

    E, S, C, I, k = SHAPES[name]
    calls = []
    for c in range(CALLS):
        w, ids = routing(1, E, S, k, gen, dev)
        calls.append((torch.randn(1, C, generator=gen).to(dev, torch.bfloat16), w13s[c % len(w13s)],
                      w2s[c % len(w2s)], w, ids))
    res, dbytes = {}, (0 if dry else gemm_bytes(calls, E + S, C, I)["gemm2"])
    for kw in SWEEP:
        steps = [moe_gemv.small_steps(*a, **kw)[0] for a in calls]
        if dry:
            for s in steps[0]:
                s[1]()
            continue
        us = []
        for i in range(2):
            only = graphed(cycle([s[i][1] for s in steps]))
            us.append(round(timed(only, warmup=1, reps=10) / CALLS * 1e3, 2))
        tag = sweep_tag(kw)
        pct = figure(us[1] * 1e-3, dbytes, read_GBps)["pct_read"]
        res[tag] = {"up_us": us[0], "down_us": us[1], "down_pct_read": pct}
        print(f"{name:>7} T=1 sweep {tag}: up {us[0]:.2f} us, down {us[1]:.2f} us ({pct:.0f}% of read)", flush=True)
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="")
    ap.add_argument("--shapes", default="v2-lite,v3")
    ap.add_argument("--batches", default="1,2,4,8,16,64,256")
    ap.add_argument("--max-small", type=int, default=16, help="largest batch timed on the streaming path")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--stream-variants", default="", help="batches at which to time moe_stream's variants (64,256)")
    ap.add_argument("--dry", action="store_true", help="compile only (DEEPINFER_TL_DRYRUN=1, no GPU)")
    args = ap.parse_args(argv)
    if args.dry:
        os.environ["DEEPINFER_TL_DRYRUN"] = "1"
    batches = [int(b) for b in args.batches.split(",")]
    res: dict = {}
    if not args.dry:
        from gpu_timing import measure_ceilings

        res["device"] = torch.cuda.get_device_name()
        res["ceilings"] = measure_ceilings("cuda")
        print(f"read ceiling {res['ceilings']['read_GBps']:.0f} GB/s, copy {res['ceilings']['copy_GBps']:.0f} GB/s",
              flush=True)
    read = res.get("ceilings", {}).get("read_GBps", 1.0)
    for shape in args.shapes.split(","):
        res[shape] = bench_shape(shape, batches, args.max_small, read, args.dry, args.sweep and shape == "v2-lite",
                                 tuple(int(b) for b in args.stream_variants.split(",") if b) if shape == "v2-lite"
                                 else ())
        torch.cuda.empty_cache() if not args.dry else None
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

"""Decode FP8 kernels against the paths they replace, as CUDA-graph replays on weights that miss L2.

    python examples/fp8_gemv_bench.py --out fp8_gemv.json [--m 1,2,8] [--sweep] [--skip-moe]
    DEEPINFER_TL_DRYRUN=1 TILELANG_CACHE_DIR=... python examples/fp8_gemv_bench.py --dry   # compile only

Dense: ``fp8_gemv`` (one launch), the GEMM path it replaces at <= 8 rows (``act_quant`` + ``torch._scaled_mm``),
``_scaled_mm`` alone on pre-quantised activations, and the bf16 GEMV (``kernels_cuda.gemv.linear``) on a bf16
weight of the same shape (at one row). Each figure is GB/s of weight bytes read (e4m3 + scales, or bf16) and its
share of the measured read ceiling (``gpu_timing.measure_ceilings``) and of the 4.8 TB/s datasheet peak; every call of a
graph reads another copy of the weight (>= 256 MB of copies), so each reads HBM.
MoE (V2-Lite: 64 routed + 2 folded shared experts, 8 slots; V3 at one token): ``moe_gemv_fp8`` (two launches),
with its CUDA-core up kernel ("up fma") and its e4m3 tensor-core one ("up mma"), each also as the up launch alone,
against the six-launch tensor-core pipeline, 8 calls per graph with different routings; bytes are the selected
experts' e4m3 weights and scales (the up launch alone: their gate and up rows, 2/3). V2-Lite runs 1, 2, 4, 8 tokens
(``moe_gemv_fp8`` is the engine's path up to ``MAX_TOKENS``; above, the mma kernel's figures say whether it
should rise). Also the down kernel alone (bytes: W2's third).
"""

import argparse
import json
import math
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

DENSE = [("v2lite_q_kv_a", 3648, 2048), ("v2lite_o_proj", 2048, 2048), ("v3_q_a_kv_a", 2112, 7168),
         ("v3_q_b", 24576, 1536), ("v3_kv_a", 576, 7168), ("v3_o_proj", 7168, 16384), ("v3_shared_w13", 4096, 7168),
         ("v3_shared_w2", 7168, 2048), ("v3_dense_w13", 36864, 7168)]
MOE = [("v2lite", 66, 2048, 1408, 6, 2, (1, 2, 4, 8)), ("v3", 257, 7168, 2048, 8, 1, (1,))]
UPS = ("fma", "mma")  # moe_gemv_fp8's up kernels, each timed (explicitly: $DEEPINFER_FP8_MOE_UP does not apply)
PEAK_GBPS = 4800.0
CALLS = 8


def _weights(N: int, K: int, n: int, dev: str):
    out = []
    for _ in range(n):
        w = (torch.randn(N, K, device=dev) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        s = torch.rand(-(-N // 128), K // 128, device=dev) * (K ** -0.5 / 64) + 1e-4
        out.append((w, s))
    return out


def _time(fns, dry: bool) -> float:
    """Microseconds per call of the graph-replayed cycle over ``fns``."""
    from gpu_timing import graphed, timed

    if dry:
        for f in fns:
            f()
        return 0.0

    def run():
        for f in fns:
            f()

    return timed(graphed(run), reps=10) / len(fns) * 1e3


def _fig(us: float, nbytes: int, read_GBps: float) -> dict:
    gbps = nbytes / (us * 1e-6) / 1e9 if us else 0.0
    return {"us": round(us, 2), "GBps": round(gbps), "pct_read": round(100 * gbps / read_GBps, 1) if read_GBps else 0,
            "pct_peak": round(100 * gbps / PEAK_GBPS, 1)}


def bench_dense(Ms: list[int], dry: bool, read_GBps: float) -> dict:
    from kernels_cuda import fp8_gemm
    from kernels_cuda.fp8_gemv import fp8_gemv
    from kernels_cuda.gemv import linear

    dev = "cpu" if dry else "cuda"
    res = {}
    for name, N, K in DENSE:
        nbytes = N * K + 4 * -(-N // 128) * (K // 128)
        copies = 1 if dry else max(2, math.ceil((256 << 20) / nbytes))
        ws = _weights(N, K, 1 if dry else copies, dev)
        nb = max(2, math.ceil((256 << 20) / (2 * N * K)))
        wb = [torch.empty(N, K, dtype=torch.bfloat16)] if dry else [
            torch.randn(N, K, device=dev).to(torch.bfloat16) for _ in range(nb)]
        for M in Ms:
            x = (torch.randn(M, K, device=dev)).to(torch.bfloat16)
            row = {"gemv": _fig(_time([partial(fp8_gemv, x, w, s) for w, s in ws], dry), nbytes, read_GBps)}
            if not dry and fp8_gemm.scaled_mm_blockwise(x.device):
                row["act_quant+scaled_mm"] = _fig(_time([partial(fp8_gemm.linear_scaled_mm, x, w, s)
                                                         for w, s in ws], dry), nbytes, read_GBps)
                q, sq = fp8_gemm.quantize_t(x, (M + 3) // 4 * 4)
                alone = [partial(torch._scaled_mm, q, w.t(), sq.t(), s.t(), out_dtype=torch.bfloat16) for w, s in ws]
                row["scaled_mm_alone"] = _fig(_time(alone, dry), nbytes, read_GBps)
            elif dry:
                fp8_gemm.quantize_t(x, (M + 3) // 4 * 4)
            if M == 1:  # (the bf16 decode projection: the GEMV at one row)
                row["bf16_gemv_path"] = _fig(_time([partial(linear, x, w) for w in wb], dry), 2 * N * K, read_GBps)
            res[f"{name} M={M}"] = row
            print(f"{name:>15} M={M}: " + " | ".join(f"{k} {v['us']} us {v['GBps']} GB/s {v['pct_peak']}%"
                                                     for k, v in row.items()), flush=True)
        del ws, wb
    return res


#: fp8_gemv tile configurations tried by --sweep at one row: (RN, KS, CH); BNW = 8 / KS warps along N
SWEEP = [(4, 4, 2), (8, 4, 1), (16, 1, 1), (16, 2, 1), (16, 4, 1), (16, 8, 1)]
SWEEP_SHAPES = ("v2lite_q_kv_a", "v2lite_o_proj", "v3_q_b", "v3_o_proj", "v3_shared_w13", "v3_dense_w13")


def bench_sweep(dry: bool, read_GBps: float) -> dict:
    from kernels_cuda.fp8_gemv import Fp8GemvConfig, fp8_gemv

    dev = "cpu" if dry else "cuda"
    res = {}
    for name, N, K in (d for d in DENSE if d[0] in SWEEP_SHAPES):
        nbytes = N * K + 4 * -(-N // 128) * (K // 128)
        ws = _weights(N, K, 1 if dry else max(2, math.ceil((256 << 20) / nbytes)), dev)
        x = torch.randn(1, K, device=dev).to(torch.bfloat16)
        row = {}
        for RN, KS, CH in SWEEP:
            cfg = Fp8GemvConfig(RN, KS, 8 // KS, CH)
            row[f"RN{RN} KS{KS} CH{CH}"] = _fig(_time([partial(fp8_gemv, x, w, s, cfg) for w, s in ws], dry), nbytes,
                                               read_GBps)
        res[name] = row
        print(f"sweep {name:>15} M=1: " + " | ".join(f"{k} {v['us']} us {v['pct_peak']}%" for k, v in row.items()),
              flush=True)
        del ws
    return res


def bench_moe(dry: bool, read_GBps: float) -> dict:
    from kernels_cuda import fp8_gemm, moe_gemv_fp8

    dev = "cpu" if dry else "cuda"
    res = {}
    gen = torch.Generator().manual_seed(0)
    for name, E, C, I, k, S, Ts in MOE:
        if dry:
            w13 = torch.empty(E, 2 * I, C, dtype=torch.float8_e4m3fn, device="meta")
            w2 = torch.empty(E, C, I, dtype=torch.float8_e4m3fn, device="meta")
        else:
            w13 = (torch.randn(E, 2 * I, C, device=dev) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
            w2 = (torch.randn(E, C, I, device=dev) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        s13 = torch.rand(E, 2 * I // 128, C // 128, device=w13.device if not dry else dev) * 1e-3 + 1e-5
        s2 = torch.rand(E, C // 128, I // 128, device=w13.device if not dry else dev) * 1e-3 + 1e-5
        if dry:
            s13, s2 = s13.to("meta"), s2.to("meta")
        for T in Ts:
            calls = []
            nbytes = 0
            for _ in range(1 if dry else CALLS):
                routed = torch.stack([torch.randperm(E - S, generator=gen)[:k] for _ in range(T)])
                ids = torch.cat((routed, torch.arange(E - S, E).expand(T, S)), 1).to(dev)
                wts = torch.rand(T, k + S, generator=gen).to(dev, torch.bfloat16)
                x = torch.randn(T, C, device=dev).to(torch.bfloat16)
                calls.append((x, wts, ids))
                nbytes += int(torch.unique(ids).numel()) * (3 * I * C + 4 * (3 * I * C) // (128 * 128))
            nbytes //= len(calls)
            row = {}
            for up in UPS:  # the two launches with the CUDA-core or the e4m3 tensor-core up kernel
                new = [partial(moe_gemv_fp8.fused_moe_fp8_small, c[0], w13, s13, w2, s2, c[1], c[2], up=up)
                       for c in calls]
                row[f"moe_gemv_fp8 up {up}"] = _fig(_time(new, dry), nbytes, read_GBps)
                # the up launch alone (its gate and up rows: 2/3 of the bytes)
                ups = [moe_gemv_fp8.moe_fp8_small_steps(c[0], w13, s13, w2, s2, c[1], c[2], up=up)[0][0][1]
                       for c in calls]
                row[f"up_fp8 {up} alone"] = _fig(_time(ups, dry), nbytes * 2 // 3, read_GBps)
            if T <= moe_gemv_fp8.MAX_TOKENS and name == "v2lite":  # a variant: 4 CTAs per SM's registers
                var = [partial(moe_gemv_fp8.fused_moe_fp8_small, c[0], w13, s13, w2, s2, c[1], c[2], 4, up="fma")
                       for c in calls]
                row["moe_gemv_fp8 min_blocks 4"] = _fig(_time(var, dry), nbytes, read_GBps)
            # the down launch alone (W2 and its scales: a third of the bytes)
            only = [moe_gemv_fp8.moe_fp8_small_steps(c[0], w13, s13, w2, s2, c[1], c[2])[0][1][1] for c in calls]
            row["down_fp8 alone"] = _fig(_time(only, dry), nbytes // 3, read_GBps)

            steps = [fp8_gemm.moe_fp8_steps(c[0], w13, s13, w2, s2, c[1], c[2])[0] for c in calls]
            row["tensor_core_pipeline"] = _fig(_time([f for st in steps for _, f in st], dry) * len(steps[0]),
                                               nbytes, read_GBps)
            res[f"{name} T={T}"] = row
            print(f"moe {name:>7} T={T}: " + " | ".join(f"{k_} {v['us']} us {v['GBps']} GB/s {v['pct_peak']}%"
                                                         for k_, v in row.items()), flush=True)
        del w13, w2
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--m", default="1,2,8")
    ap.add_argument("--dry", action="store_true")
    ap.add_argument("--skip-moe", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also fp8_gemv tile configurations at one row")
    args = ap.parse_args()
    read_GBps = 0.0
    if not args.dry:
        from gpu_timing import measure_ceilings

        read_GBps = measure_ceilings()["read_GBps"]
        print(f"read ceiling {read_GBps:.0f} GB/s", flush=True)
    out = {"read_GBps": read_GBps, "peak_GBps": PEAK_GBPS,
           "dense": bench_dense([int(m) for m in args.m.split(",")], args.dry, read_GBps)}
    if not args.skip_moe:
        out["moe"] = bench_moe(args.dry, read_GBps)
    if args.sweep:
        out["sweep"] = bench_sweep(args.dry, read_GBps)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

"""Small-M projections (``kernels_cuda.gemv``, ``gemv_rows``) against cuBLAS, and ``mla_kv_write`` against its
unfused ops.

    python examples/gemv_bench.py --out gemv.json [--shapes v2-lite,v3] [--m 1,2,4,8] [--sweep]
    DEEPINFER_TL_DRYRUN=1 TILELANG_CACHE_DIR=... python examples/gemv_bench.py --dry   # compile only

Each projection of a decode step reads its whole weight once, so its figure is GB/s of weight against
the measured read ceiling (``gpu_timing.measure_ceilings``, a 4 GiB ``sum``). The weights of one layer
fit in the H200's 50 MB L2, so every timing cycles through enough copies of the weight (>= 256 MB) that
each call reads HBM, all calls of a cycle replayed from one CUDA graph (no launch gaps from the host:
as the engine runs decode). The router's gate is float32 (as the model keeps it) with float32 logits;
cuBLAS runs it as the reference does (``x.float() @ w.T``). ``head_linear`` (MLA's absorbed W_UK / W_UV, one
GEMV per head) is timed against the reference's einsum. ``floor`` is one launch of the router's GEMV (262 KB):
the per-launch cost inside a graph that no kernel goes below, so a weight of B bytes can at best reach
B / (floor + B / ceiling). At one row the GEMV is also timed chained with programmatic dependent launch
(each launch streams its weight while the previous one finishes). ``--sweep`` also times ``gemv_rows`` tile
configurations at 2 and 8 rows.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

#: (name, N, K, weight dtype) of each decode projection per shape
SHAPES = {
    "v2-lite": [("q+kv_a", 16 * 192 + 576, 2048, "bf16"), ("o", 2048, 16 * 128, "bf16"),
                ("kv_b", 16 * 256, 512, "bf16"), ("shared w13", 2 * 2816, 2048, "bf16"),
                ("shared w2", 2048, 2816, "bf16"), ("dense w13", 2 * 10944, 2048, "bf16"),
                ("dense w2", 2048, 10944, "bf16"), ("router", 64, 2048, "f32"), ("lm_head", 102400, 2048, "bf16")],
    "v3": [("q_a+kv_a", 1536 + 576, 7168, "bf16"), ("q_b", 128 * 192, 1536, "bf16"), ("o", 7168, 128 * 128, "bf16"),
           ("shared w13", 2 * 2048, 7168, "bf16"), ("shared w2", 7168, 2048, "bf16"), ("router", 256, 7168, "f32")],
}
_DT = {"bf16": torch.bfloat16, "f32": torch.float32}
#: (name, H, N, K) of MLA's per-head products at decode: W_UK [H, L, N_nope], W_UV [H, V, L]
HEAD_SHAPES = {"v2-lite": [("W_UK", 16, 512, 128), ("W_UV", 16, 128, 512)],
               "v3": [("W_UK", 128, 512, 128), ("W_UV", 128, 128, 512)]}
#: gemv_rows tile configurations tried by --sweep: (RN, KS, CH); RT and BNW follow from K and KS
SWEEP = [(4, 1, 4), (4, 2, 4), (4, 4, 2), (8, 1, 2)]
SWEEP_SHAPES = ("q+kv_a", "o", "shared w2", "dense w2", "q_a+kv_a")


def _cycle(fn, args_list):
    def run():
        for a in args_list:
            fn(*a)
    return run


def bench_projection(name: str, N: int, K: int, wdt: str, Ms: list[int], dry: bool, read_GBps: float) -> dict:
    from gpu_timing import graphed, timed

    from kernels_cuda.gemv import linear, linear_f32

    dev = "cpu" if dry else "cuda"
    w_dtype = _DT[wdt]
    nbytes = N * K * w_dtype.itemsize
    copies = _copies(nbytes, dry)
    ws = [torch.empty(N, K, dtype=w_dtype, device=dev).normal_(0, K**-0.5) for _ in range(copies)]
    ours_fn = linear_f32 if wdt == "f32" else linear
    out = {"N": N, "K": K, "weight_MB": round(nbytes / 1e6, 2)}
    for M in Ms:
        x = torch.randn(M, K, device=dev).to(torch.bfloat16)
        if dry:
            ours_fn(x, ws[0])
            if M == 1 and wdt == "bf16":
                _pdl_gemv(N, K)(x, ws[0])
            if M > 1 and wdt == "bf16" and _mma(x, ws[0]) is not None:
                _mma(x, ws[0])(x, ws[0])
            continue
        cublas = (lambda a, w: torch.nn.functional.linear(a.float(), w)) if wdt == "f32" else torch.nn.functional.linear
        pdl = _pdl_gemv(N, K) if M == 1 and wdt == "bf16" else None
        mma = _mma(x, ws[0]) if M > 1 and wdt == "bf16" else None
        ms_ours = timed(graphed(_cycle(ours_fn, [(x, w) for w in ws])), warmup=1, reps=5) / copies
        ms_ref = timed(graphed(_cycle(cublas, [(x, w) for w in ws])), warmup=1, reps=5) / copies
        want = cublas(x, ws[0]).float()
        err = (ours_fn(x, ws[0]).float() - want).abs().max().item() / want.abs().max().clamp_min(1e-6).item()
        row = {"us": round(ms_ours * 1e3, 2), "GBps": round(nbytes / ms_ours / 1e6),
               "cublas_us": round(ms_ref * 1e3, 2), "cublas_GBps": round(nbytes / ms_ref / 1e6),
               "rel_err": float(f"{err:.2e}")}
        row["fraction"] = round(row["GBps"] / read_GBps, 3)
        row["cublas_fraction"] = round(row["cublas_GBps"] / read_GBps, 3)
        if mma is not None:  # the tensor-core GEMV (kernels_cuda/gemv_mma.py)
            ms_mma = timed(graphed(_cycle(mma, [(x, w) for w in ws])), warmup=1, reps=5) / copies
            row["mma_us"] = round(ms_mma * 1e3, 2)
            row["mma_fraction"] = round(nbytes / ms_mma / 1e6 / read_GBps, 3)
            err_m = (mma(x, ws[0]).float() - want).abs().max().item() / want.abs().max().clamp_min(1e-6).item()
            print(f"{'':>12} tensor cores: {row['mma_us']:8.2f} us ({row['mma_fraction'] * 100:4.1f}% of read), "
                  f"rel err {err_m:.1e}", flush=True)
        if pdl is not None:  # the same kernel chained with programmatic dependent launch
            ms_pdl = timed(graphed(_cycle(pdl, [(x, w) for w in ws])), warmup=1, reps=5) / copies
            row["pdl_us"] = round(ms_pdl * 1e3, 2)
            row["pdl_fraction"] = round(nbytes / ms_pdl / 1e6 / read_GBps, 3)
            err_p = (pdl(x, ws[0]).float() - want).abs().max().item() / want.abs().max().clamp_min(1e-6).item()
            print(f"{'':>12} PDL chain: {row['pdl_us']:8.2f} us ({row['pdl_fraction'] * 100:4.1f}% of read), "
                  f"rel err {err_p:.1e}", flush=True)
        out[f"M={M}"] = row
        print(f"{name:>12} N={N:>6} K={K:>5} M={M}: {row['us']:8.2f} us {row['GBps']:5d} GB/s "
              f"({row['fraction'] * 100:4.1f}% of read) | cuBLAS {row['cublas_us']:8.2f} us "
              f"{row['cublas_GBps']:5d} GB/s "
              f"({row['cublas_fraction'] * 100:4.1f}%) | rel err {row['rel_err']:.1e}", flush=True)
    del ws
    return out


def _pdl_gemv(N: int, K: int):
    """``gemv``'s one-row kernel built with programmatic dependent launch (``build_gemv(pdl=True)``)."""
    from kernels_cuda import _tl
    from kernels_cuda.gemv import _kernel, tile_config

    bn, rt = tile_config(N, K, _tl.num_sms())
    kernel = _kernel(N, K, 1, bn, rt, "bfloat16", "bfloat16", "bfloat16", True)

    def run(x, w):
        y = torch.empty(1, N, dtype=x.dtype, device=x.device)
        kernel(x, w, y)
        return y

    return run


def _mma(x, w):
    """``gemv_mma`` where it takes these shapes, else None."""
    from kernels_cuda.gemv_mma import applies, gemv_mma

    return gemv_mma if applies(x, w) else None


def _copies(nbytes: int, dry: bool) -> int:
    return 1 if dry else max(2, math.ceil(256e6 / nbytes))


def bench_heads(name: str, H: int, N: int, K: int, Ms: list[int], dry: bool, read_GBps: float) -> dict:
    """``head_linear`` through the GEMV against the reference's einsum (cuBLAS batched GEMM + its copies)."""
    from gpu_timing import graphed, timed

    from kernels_cpu.ops import head_linear as reference
    from kernels_cuda.gemv_rows import head_linear

    dev = "cpu" if dry else "cuda"
    nbytes = H * N * K * 2
    copies = _copies(nbytes, dry)
    ws = [torch.empty(H, N, K, dtype=torch.bfloat16, device=dev).normal_(0, K**-0.5) for _ in range(copies)]
    out = {"H": H, "N": N, "K": K, "weight_MB": round(nbytes / 1e6, 2)}
    for M in Ms:
        x = torch.randn(M, H, K + 64, device=dev).to(torch.bfloat16)[..., :K]  # a strided view, as q_nope is
        if dry:
            head_linear(x, ws[0])
            continue
        ms = timed(graphed(_cycle(head_linear, [(x, w) for w in ws])), warmup=1, reps=5) / copies
        ms_ref = timed(graphed(_cycle(reference, [(x, w) for w in ws])), warmup=1, reps=5) / copies
        want = reference(x.float(), ws[0].float())
        err = (head_linear(x, ws[0]).float() - want).abs().max().item() / want.abs().max().item()
        row = {"us": round(ms * 1e3, 2), "fraction": round(nbytes / ms / 1e6 / read_GBps, 3),
               "cublas_us": round(ms_ref * 1e3, 2), "rel_err": float(f"{err:.2e}")}
        out[f"M={M}"] = row
        print(f"{name:>12} H={H:>4} N={N:>4} K={K:>4} M={M}: {row['us']:8.2f} us ({row['fraction'] * 100:4.1f}% of "
              f"read) | einsum {row['cublas_us']:8.2f} us | rel err {err:.1e}", flush=True)
    return out


def bench_sweep(name: str, N: int, K: int, Ms: list[int], dry: bool, read_GBps: float) -> dict:
    """``gemv_rows`` at each configuration of SWEEP (those that fit K) and the default pick."""
    from gpu_timing import graphed, timed

    from kernels_cuda import _tl
    from kernels_cuda.gemv_rows import VEC, RowsConfig, gemv_rows, m_bucket, rows_config

    dev = "cpu" if dry else "cuda"
    nbytes = N * K * 2
    copies = _copies(nbytes, dry)
    ws = [torch.empty(1, N, K, dtype=torch.bfloat16, device=dev).normal_(0, K**-0.5) for _ in range(copies)]
    out = {}
    for M in Ms:
        x = torch.randn(M, 1, K, device=dev).to(torch.bfloat16)
        default = rows_config(1, N, K, m_bucket(M), _tl.num_sms())
        cfgs = {"default": default}
        for rn, ks, ch in SWEEP:
            if ks * 32 * VEC <= K:
                cfgs[f"RN{rn} KS{ks} CH{ch}"] = RowsConfig(rn, 32, ks, max(1, 8 // ks), ch)
        row = {}
        for label, cfg in cfgs.items():
            fn = functools.partial(gemv_rows, cfg=cfg)
            if dry:
                fn(x, ws[0])
                continue
            ms = timed(graphed(_cycle(fn, [(x, w) for w in ws])), warmup=1, reps=5) / copies
            row[label] = round(nbytes / ms / 1e6 / read_GBps, 3)
        if not dry:
            best = max(row, key=row.get)
            out[f"M={M}"] = row
            print(f"sweep {name:>10} M={M}: default {default} {row['default'] * 100:4.1f}% | best {best} "
                  f"{row[best] * 100:4.1f}% | " + " ".join(f"{k}:{v * 100:.0f}" for k, v in row.items()), flush=True)
    return out


def bench_floor(dry: bool) -> float:
    """Microseconds of one launch of the router's GEMV (64 x 2048 float32 gate) replayed from a graph."""
    from gpu_timing import graphed, timed

    from kernels_cuda.gemv import linear_f32

    dev = "cpu" if dry else "cuda"
    w = torch.randn(64, 2048, device=dev)
    x = torch.randn(1, 2048, device=dev).to(torch.bfloat16)
    if dry:
        linear_f32(x, w)
        return 0.0
    us = timed(graphed(_cycle(linear_f32, [(x, w)] * 200)), reps=5) / 200 * 1e3
    print(f"floor: one small GEMV launch in a graph {us:.2f} us", flush=True)
    return round(us, 2)


def bench_kv_write(dry: bool) -> dict:
    """V2-Lite's cache entry (L 512, R 64, pages of 64) from a column slice of the fused projection output."""
    from gpu_timing import graphed, timed

    from kernels_cpu.fused import mla_kv_write as reference
    from kernels_cuda.elementwise import rope
    from kernels_cuda.kv_cache import paged_kv_write
    from kernels_cuda.mla_kv_write import mla_kv_write
    from kernels_cuda.norm import rms_norm

    dev = "cpu" if dry else "cuda"
    L, R, BS, width = 512, 64, 64, 16 * 192 + 576
    out = {}
    for T in (1, 64):
        xa = torch.randn(T, width, device=dev).to(torch.bfloat16)
        kv_a = xa[:, width - L - R:]
        w = torch.ones(L, dtype=torch.bfloat16, device=dev)
        pos = torch.arange(T, device=dev)
        cs = torch.randn(4096, R, device=dev)
        cache = torch.zeros(64, BS, L + R, dtype=torch.bfloat16, device=dev)
        slots = torch.randperm(64 * BS, device=dev)[:T]
        fused = functools.partial(mla_kv_write, kv_a, w, 1e-6, pos, cs, cache, slots)

        def unfused(kv_a=kv_a, w=w, pos=pos, cs=cs, cache=cache, slots=slots):
            latent, k_pe = kv_a.split([L, R], dim=-1)
            entry = torch.cat((rms_norm(latent, w, 1e-6), rope(k_pe[:, None], pos, cs)[:, 0]), -1)
            paged_kv_write(cache, slots, entry)
            return entry

        if dry:
            fused()
            unfused()
            continue
        ref_cache = cache.clone()
        ref_entry = reference(kv_a, w, 1e-6, pos, cs, ref_cache, slots)
        entry = fused()
        err = max((entry.float() - ref_entry.float()).abs().max().item(),
                  (cache.float() - ref_cache.float()).abs().max().item())
        a, b = timed(graphed(fused), reps=20), timed(graphed(unfused), reps=20)
        out[f"T={T}"] = {"fused_us": round(a * 1e3, 2), "unfused_us": round(b * 1e3, 2), "max_abs_err": err}
        print(f"mla_kv_write T={T}: fused {a * 1e3:.2f} us, unfused (4 ops + slice) {b * 1e3:.2f} us, "
              f"max abs err {err:.1e}", flush=True)
    return out


def bench_bn_sweep(name: str, N: int, K: int, dry: bool, read_GBps: float) -> dict:
    """The one-row GEMV (``gemv.build_gemv``) with BN = 8, 4, 2 weight rows per CTA (a warp each): how the CTA
    count per SM (a last partial wave) moves it; the default pick (``tile_config``) is marked."""
    from gpu_timing import graphed, timed

    from kernels_cuda import _tl
    from kernels_cuda.gemv import _kernel, tile_config

    dev = "cpu" if dry else "cuda"
    nbytes = N * K * 2
    copies = _copies(nbytes, dry)
    ws = [torch.empty(N, K, dtype=torch.bfloat16, device=dev).normal_(0, K**-0.5) for _ in range(copies)]
    x = torch.randn(1, K, device=dev).to(torch.bfloat16)
    default = tile_config(N, K, _tl.num_sms())
    row = {}
    for bn in (8, 4, 2):
        if default[1] != 32:
            break  # one row per CTA with split K: not this sweep's subject
        kernel = _kernel(N, K, 1, bn, 32, "bfloat16", "bfloat16", "bfloat16")

        def run(w, _k=kernel):
            y = torch.empty(1, N, dtype=torch.bfloat16, device=dev)
            _k(x, w, y)
            return y

        if dry:
            run(ws[0])
            continue
        ms = timed(graphed(_cycle(run, [(w,) for w in ws])), warmup=1, reps=5) / copies
        row[f"BN{bn}"] = {"us": round(ms * 1e3, 2), "fraction": round(nbytes / ms / 1e6 / read_GBps, 3),
                          "ctas_per_sm": round(-(-N // bn) / _tl.num_sms(), 2), "default": bn == default[0]}
    if row:
        cells = [f"{k}{'*' if v['default'] else ''} {v['us']:.2f} us {v['fraction'] * 100:.1f}% "
                 f"({v['ctas_per_sm']}/SM)" for k, v in row.items()]
        print(f"{name:>12} N={N} K={K} M=1 BN sweep: " + ", ".join(cells), flush=True)
    return row


def bench_norm_gemv(name: str, N: int, K: int, dry: bool, read_GBps: float) -> dict:
    """The layer's input norm + its projection at one row: ``add_rms_norm_linear`` (one launch, the norm in the
    GEMV's prologue) against ``add_rms_norm`` + ``linear`` (two launches), each call on another weight copy."""
    from gpu_timing import graphed, timed

    from kernels_cuda.gemv import linear
    from kernels_cuda.norm import add_rms_norm
    from kernels_cuda.norm_gemv import add_rms_norm_linear

    dev = "cpu" if dry else "cuda"
    nbytes = N * K * 2
    copies = _copies(nbytes, dry)
    ws = [torch.empty(N, K, dtype=torch.bfloat16, device=dev).normal_(0, K**-0.5) for _ in range(copies)]
    x, r = (torch.randn(1, K, device=dev).to(torch.bfloat16) for _ in range(2))
    nw = torch.ones(K, dtype=torch.bfloat16, device=dev)

    def fused(w):
        return add_rms_norm_linear(x, r, nw, 1e-6, w)

    def unfused(w):
        normed, res = add_rms_norm(x, r, nw, 1e-6)
        return linear(normed, w), res

    if dry:
        fused(ws[0])
        unfused(ws[0])
        return {}
    ms_f = timed(graphed(_cycle(fused, [(w,) for w in ws])), warmup=1, reps=5) / copies
    ms_u = timed(graphed(_cycle(unfused, [(w,) for w in ws])), warmup=1, reps=5) / copies
    err = (fused(ws[0])[0].float() - unfused(ws[0])[0].float()).abs().max().item()
    row = {"fused_us": round(ms_f * 1e3, 2), "unfused_us": round(ms_u * 1e3, 2),
           "fused_fraction": round(nbytes / ms_f / 1e6 / read_GBps, 3), "max_abs_diff": err}
    print(f"{name:>12} norm+GEMV N={N} K={K} M=1: fused {row['fused_us']:.2f} us ({row['fused_fraction'] * 100:.1f}% "
          f"of read) | add_rms_norm + GEMV {row['unfused_us']:.2f} us | max abs diff {err:.1e}", flush=True)
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="")
    ap.add_argument("--shapes", default="v2-lite,v3")
    ap.add_argument("--m", default="1,2,4,8", help="activation rows")
    ap.add_argument("--sweep", action="store_true", help="gemv_rows tile configurations at 2 and 8 rows")
    ap.add_argument("--no-kv-write", action="store_true")
    ap.add_argument("--bn-sweep", action="store_true", help="the one-row GEMV at 8, 4, 2 weight rows per CTA")
    ap.add_argument("--dry", action="store_true", help="compile only (DEEPINFER_TL_DRYRUN=1, no GPU)")
    args = ap.parse_args(argv)
    if args.dry:
        os.environ["DEEPINFER_TL_DRYRUN"] = "1"
    Ms = [int(m) for m in args.m.split(",")]
    res: dict = {}
    if not args.dry:
        from gpu_timing import measure_ceilings

        res["device"] = torch.cuda.get_device_name()
        res["ceilings"] = measure_ceilings("cuda")
        print(f"read ceiling {res['ceilings']['read_GBps']:.0f} GB/s", flush=True)
    read = res.get("ceilings", {}).get("read_GBps", 1.0)
    res["floor_us"] = bench_floor(args.dry)
    for shape in args.shapes.split(","):
        res[shape] = {name: bench_projection(name, N, K, wdt, Ms, args.dry, read) for name, N, K, wdt in SHAPES[shape]}
        res[shape].update({f"head {name}": bench_heads(name, H, N, K, Ms, args.dry, read)
                           for name, H, N, K in HEAD_SHAPES[shape]})
        name, N, K, _ = SHAPES[shape][0]  # the input projection (q(_a) + kv_a) after the layer's input norm
        res[shape]["norm " + name] = bench_norm_gemv(name, N, K, args.dry, read)
        if args.bn_sweep:
            res[shape]["bn_sweep"] = {name: bench_bn_sweep(name, N, K, args.dry, read)
                                      for name, N, K, wdt in SHAPES[shape] if wdt == "bf16" and name != "lm_head"}
        if args.sweep:
            res[shape]["sweep"] = {name: bench_sweep(name, N, K, [2, 8], args.dry, read)
                                   for name, N, K, wdt in SHAPES[shape] if name in SWEEP_SHAPES}
    if not args.no_kv_write:
        res["mla_kv_write"] = bench_kv_write(args.dry)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

"""Benchmarks of the TileLang kernels (``kernels_cuda``) on one GPU, against measured ceilings.

    python examples/kernel_bench.py --out bench.json [--only hbm,mla,moe,prefill,misc]

(a) ceilings: device-to-device copy and a full read (sum) of a 4 GiB buffer, bf16 8192^3 matmul;
(b) MLA decode, batch 64 x 8192 context, kv_lora 512 + rope 64, 128 heads (V3) and 16 (V2-Lite),
    block size 64 (and 16): GB/s of cache + query + output traffic, and its fraction of the measured
    read bandwidth;
(c) fused MoE against the per-expert loop (the reference op, on the GPU) at 1 ... 8192 tokens for
    V2-Lite (C 2048, I 1408, 64 experts, top-6) and V3 (C 7168, I 2048, 256 experts, top-8) shapes;
(d) prefill attention (192/128, causal) TFLOP/s at 8k;
(e) norms, router and sampling against the reference ops.

Times are medians of CUDA-event timings after warm-up. ``--dry`` (no GPU needed, with
``DEEPINFER_TL_DRYRUN=1``) only compiles the kernels these shapes use, to fill TileLang's cache.
"""

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_timing  # noqa: E402
from gpu_timing import graphed, measure_ceilings  # noqa: E402

from kernels_cpu import ops as ref  # noqa: E402
from kernels_cuda.mla_decode import mla_decode  # noqa: E402
from kernels_cuda.mla_prefill import mla_prefill  # noqa: E402
from kernels_cuda.moe import fused_moe, moe_steps  # noqa: E402
from kernels_cuda.moe_route import moe_route  # noqa: E402
from kernels_cuda.norm import add_rms_norm, rms_norm  # noqa: E402
from kernels_cuda.sampling import sample  # noqa: E402

DRY = False
DEV = "cuda"
RESULTS: dict = {}


def timed(fn, warmup: int = 2, reps: int = 20, budget_s: float = 2.0) -> float:
    """Median milliseconds of ``fn()`` (``gpu_timing.timed``); in ``--dry`` mode one call and NaN."""
    if DRY:
        fn()
        return float("nan")
    return gpu_timing.timed(fn, warmup, reps, budget_s)


def rand(*shape, dtype=torch.bfloat16, scale=1.0):
    if DRY:
        return torch.empty(*shape, dtype=dtype, device=DEV)
    return (torch.randn(*shape, device=DEV, dtype=torch.float32) * scale).to(dtype)


def log(section: str, key: str, value) -> None:
    RESULTS.setdefault(section, {})[key] = value
    print(f"[{section}] {key}: {value}", flush=True)


# ---- (a) ceilings ---------------------------------------------------------------------------------
def bench_hbm():
    if DRY:
        return
    c = measure_ceilings(DEV)
    log("hbm", "copy_read+write_GBps", c["copy_GBps"])
    log("hbm", "sum_read_GBps", c["read_GBps"])
    log("hbm", "matmul_bf16_8192_TFLOPs", c["matmul_TFLOPs"])


# ---- (b) MLA decode -------------------------------------------------------------------------------
#: (heads, block size, n_split (None: automatic), tile config (None: default)) per measured variant
WS = {"kernel": "ws", "BH": 64, "BN": 64}
#: (heads, block size, n_split (None: automatic), tile config (None: default)) per measured variant
T256 = {"BH": 16, "BN": 64, "stages": 2, "threads": 256}
MLA_VARIANTS = [
    (16, 64, None, None), (16, 64, None, T256), (16, 64, 1, T256), (16, 64, 4, T256),
    (128, 64, None, None), (128, 64, None, {"BH": 64, "BN": 64, "stages": 2, "threads": 256}),
    (16, 64, None, None), (16, 64, None, WS),
    (128, 16, None, None), (16, 16, None, None), (16, 16, None, WS),
]


def bench_mla():
    B, ctx, L, R = 64, 8192, 512, 64
    read_bw = RESULTS.get("hbm", {}).get("sum_read_GBps")
    made = {}
    for H, bs, ns, cfg in MLA_VARIANTS:
        if (H, bs) not in made:
            made.clear()
            nb = B * ctx // bs
            cache = rand(nb + 8, bs, L + R)
            perm = torch.randperm(nb, device=DEV) if not DRY else torch.arange(nb, device=DEV)
            tables = perm.view(B, ctx // bs).to(torch.int32)
            q = rand(B, H, L + R)
            made[(H, bs)] = (cache, tables, q)
        cache, tables, q = made[(H, bs)]
        cu = torch.arange(B + 1, device=DEV)
        sl = torch.full((B,), ctx, device=DEV, dtype=torch.int64)
        nbytes = B * ctx * (L + R) * 2 + q.numel() * 2 + B * H * L * 2
        flops = 2 * B * H * ctx * (L + R + L)
        ms = timed(functools.partial(mla_decode, q, cache, tables, cu, sl, 0.1, L, n_split=ns, cfg=cfg))
        gbs = nbytes / ms / 1e6
        frac = f", {gbs / read_bw:.0%} of the measured read bandwidth" if read_bw else ""
        key = f"H{H} bs{bs} split={ns or 'auto'} cfg={cfg or 'default'}"
        log("mla_decode", key, f"{ms * 1e3:.1f} us, {gbs:.0f} GB/s{frac}, {flops / ms / 1e9:.0f} TFLOP/s")
        RESULTS["mla_decode"][key + " GBps"] = round(gbs, 1)
        if H == 16 and bs == 64 and ns is None and not DRY:  # the reference (torch einsum), for scale
            ms = timed(functools.partial(ref.mla_decode, q, cache, tables, cu, sl, 0.1, L), reps=5)
            log("mla_decode", f"H{H} bs{bs} reference torch", f"{ms * 1e3:.1f} us")
    made.clear()


# ---- (c) fused MoE --------------------------------------------------------------------------------
def bench_moe():
    for name, E, C, I, k in (("V2-Lite", 64, 2048, 1408, 6), ("V3", 256, 7168, 2048, 8)):
        w13 = rand(E, 2 * I, C, scale=C**-0.5)
        w2 = rand(E, C, I, scale=I**-0.5)
        for T in (1, 8, 64, 256, 1024, 8192):
            x = rand(T, C)
            if DRY:
                ids = torch.zeros(T, k, dtype=torch.int64, device=DEV)
            else:
                ids = torch.rand(T, E, device=DEV).topk(k, dim=-1).indices
            w = torch.rand(T, k, device=DEV).to(torch.bfloat16)
            ms = timed(functools.partial(fused_moe, x, w13, w2, w, ids), reps=20)
            if DRY:
                continue
            loop = timed(functools.partial(ref.fused_moe, x, w13, w2, w, ids), reps=10)
            experts = int(ids.unique().numel())
            wbytes = experts * 3 * I * C * 2
            flops = 2 * T * k * 3 * I * C
            log("fused_moe", f"{name} T={T}",
                f"fused {ms:.3f} ms, loop {loop:.3f} ms, x{loop / ms:.2f}; "
                f"{wbytes / ms / 1e6:.0f} GB/s of expert weights ({experts} experts), {flops / ms / 1e9:.0f} TFLOP/s")
            RESULTS["fused_moe"][f"{name} T={T} ms"] = {"fused": round(ms, 4), "loop": round(loop, 4),
                                                        "weights_GBps": round(wbytes / ms / 1e6, 1),
                                                        "TFLOPs": round(flops / ms / 1e9, 1)}
            if T <= 64:  # without the host's launch overhead: the same call replayed from a CUDA graph
                graph_ms = timed(graphed(functools.partial(fused_moe, x, w13, w2, w, ids)), reps=20)
                log("fused_moe", f"{name} T={T} CUDA-graph replay", f"{graph_ms:.3f} ms, "
                    f"{wbytes / graph_ms / 1e6:.0f} GB/s of expert weights, x{loop / graph_ms:.1f} vs the loop")
                RESULTS["fused_moe"][f"{name} T={T} ms"]["graph"] = round(graph_ms, 4)
            if T in (1, 64, 8192):  # where the time goes, launch by launch
                steps, _ = moe_steps(x, w13, w2, w, ids)
                parts = {n: round(timed(fn, reps=10), 4) for n, fn in steps}
                log("fused_moe", f"{name} T={T} stages ms", parts)
        del w13, w2


# ---- (d) prefill ----------------------------------------------------------------------------------
def bench_prefill():
    for H, q_len, k_len in ((16, 8192, 8192), (128, 8192, 8192), (128, 2048, 8192)):
        q = rand(q_len, H, 192)
        k = rand(k_len, H, 192)
        v = rand(k_len, H, 128)
        cq = torch.tensor([0, q_len], device=DEV)
        ck = torch.tensor([0, k_len], device=DEV)
        ms = timed(functools.partial(mla_prefill, q, k, v, cq, ck, 192**-0.5), reps=10)
        if DRY:
            continue
        off = k_len - q_len  # query j sees off + j + 1 keys
        pairs = q_len * off + q_len * (q_len + 1) / 2
        flops = 2 * H * (192 + 128) * pairs
        refms = timed(functools.partial(ref.mla_prefill, q, k, v, cq, ck, 192**-0.5), reps=5)
        log("mla_prefill", f"H{H} q{q_len} k{k_len}",
            f"{ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s (reference SDPA {refms:.3f} ms)")
        RESULTS["mla_prefill"][f"H{H} q{q_len} k{k_len} TFLOPs"] = round(flops / ms / 1e9, 1)


# ---- (e) small ops --------------------------------------------------------------------------------
def bench_misc():
    x = rand(8192, 7168)
    r = rand(8192, 7168)
    wn = rand(7168)
    ms = timed(functools.partial(rms_norm, x, wn, 1e-6))
    rms = timed(functools.partial(ref.rms_norm, x, wn, 1e-6)) if not DRY else float("nan")
    log("misc", "rms_norm 8192x7168", f"{ms * 1e3:.1f} us ({3 * x.numel() * 2 / ms / 1e6:.0f} GB/s), "
        f"reference {rms * 1e3:.1f} us")
    ms = timed(functools.partial(add_rms_norm, x, r, wn, 1e-6))
    rms = timed(functools.partial(ref.add_rms_norm, x, r, wn, 1e-6)) if not DRY else float("nan")
    log("misc", "add_rms_norm 8192x7168", f"{ms * 1e3:.1f} us, reference {rms * 1e3:.1f} us")
    for T in (64, 8192):
        logits = rand(T, 256, dtype=torch.float32)
        bias = rand(256, dtype=torch.float32, scale=0.05)
        args = (logits, bias, 8, "sigmoid", 8, 4, "top2sum", True, 2.5)
        ms = timed(functools.partial(moe_route, *args))
        rms = timed(functools.partial(ref.moe_route, *args)) if not DRY else float("nan")
        log("misc", f"moe_route V3 T={T}", f"{ms * 1e3:.1f} us, reference {rms * 1e3:.1f} us")
    for B in (1, 64, 256):
        V = 129280
        logits = rand(B, V, dtype=torch.float32, scale=3.0)
        t = torch.full((B,), 0.8, device=DEV)
        kk = torch.full((B,), 50, device=DEV, dtype=torch.int64)
        p = torch.full((B,), 0.9, device=DEV)
        mp = torch.zeros(B, device=DEV)
        s = torch.arange(B, device=DEV, dtype=torch.int64)
        o = torch.zeros(B, device=DEV, dtype=torch.int64)
        args = (logits, t, kk, p, mp, s, o)
        ms = timed(functools.partial(sample, *args))
        rms = timed(functools.partial(ref.sample, *args), reps=5) if not DRY else float("nan")
        log("misc", f"sample top-k 50 top-p 0.9 B={B} V={V}", f"{ms * 1e3:.1f} us, reference {rms * 1e3:.1f} us")
        p2 = torch.ones(B, device=DEV)
        k2 = torch.zeros(B, device=DEV, dtype=torch.int64)
        args = (logits, t, k2, p2, mp, s, o)
        ms = timed(functools.partial(sample, *args))
        log("misc", f"sample plain B={B} V={V}", f"{ms * 1e3:.1f} us")


def main() -> None:
    global DRY, DEV
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--only", default="hbm,mla,moe,prefill,misc")
    ap.add_argument("--dry", action="store_true", help="compile the kernels only (no GPU needed)")
    args = ap.parse_args()
    DRY = args.dry
    if DRY:
        os.environ["DEEPINFER_TL_DRYRUN"] = "1"
        DEV = "cpu"
    else:
        torch.backends.cuda.matmul.allow_tf32 = False
        log("device", "name", torch.cuda.get_device_name())
    for part in args.only.split(","):
        t0 = time.time()
        {"hbm": bench_hbm, "mla": bench_mla, "moe": bench_moe, "prefill": bench_prefill, "misc": bench_misc}[part]()
        print(f"-- {part} took {time.time() - t0:.0f} s", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(RESULTS, indent=1))


if __name__ == "__main__":
    main()

"""FP8 block-scaled GEMM on the GPU: TFLOP/s of ``kernels_cuda.fp8_gemm`` (with and without its on-the-fly
activation quantisation) against ``torch._scaled_mm`` and bf16 cuBLAS, on DeepSeek-V3's projection shapes.

    python examples/fp8_bench.py --out fp8_gemm.json [--m 64,512,4096] [--dry]

``torch._scaled_mm`` is asked for the same 1x128 / 128x128 block scaling first; where this torch or its
cuBLAS refuses that, it falls back to row-wise, then tensor-wise scaling, and each row says which ran
(``scaled_mm_mode``). FP8 peak for the fraction: the H200's dense FP8 datasheet rate (1979 TFLOP/s).
``--dry`` (no GPU, ``DEEPINFER_TL_DRYRUN=1``) only compiles the kernels (``kernel_warm.py``).
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

FP8_PEAK_TFLOPS = 1979.0
#: (name, N, K): V3's GEMM weights (q_a, the fused q_a + kv_a the engine runs, q_b, kv_a, o_proj, dense MLP,
#: one routed expert's w13 / w2)
SHAPES = [("q_a", 1536, 7168), ("q_a+kv_a", 2112, 7168), ("q_b", 24576, 1536), ("kv_a", 576, 7168),
          ("o_proj", 7168, 16384), ("dense_w13", 36864, 7168), ("dense_w2", 7168, 18432),
          ("expert_w13", 4096, 7168), ("expert_w2", 7168, 2048)]


def _scaled_mm(q, s, w, ws):
    """(mode, thunk) for torch._scaled_mm on these operands, the most faithful scaling this torch takes."""
    b = w.t()  # [K, N] column-major, as _scaled_mm wants
    N = w.shape[0]
    tries = [
        ("blockwise 1x128/128x128", s.t().contiguous().t(), ws.t()),
        ("rowwise", s[:, :1].contiguous(), torch.ones(1, N, device=q.device)),
        ("tensorwise", torch.ones((), device=q.device), torch.ones((), device=q.device)),
    ]
    for mode, sa, sb in tries:
        try:
            torch._scaled_mm(q, b, sa, sb, out_dtype=torch.bfloat16)
            torch.cuda.synchronize()
            return mode, (lambda sa=sa, sb=sb: torch._scaled_mm(q, b, sa, sb, out_dtype=torch.bfloat16))
        except Exception as exc:  # noqa: BLE001 (record and try the next scaling)
            last = f"{type(exc).__name__}: {str(exc)[:200]}"
    return f"none ({last})", None


def measure(M: int, name: str, N: int, K: int, dev: str) -> dict:
    from gpu_timing import graphed, timed

    from kernels_cpu.fp8_ops import fp8_linear as ref
    from kernels_cuda import fp8_gemm as F

    c = F.gemm_config(M, N)
    g = torch.Generator(device=dev).manual_seed(M + N)
    x = torch.randn(M, K, generator=g, device=dev).to(torch.bfloat16)
    w = (torch.randn(N, K, generator=g, device=dev) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    ws = (torch.rand(-(-N // 128), K // 128, generator=g, device=dev) + 0.5) * (K ** -0.5 / 64)
    out = F.fp8_linear(x, w, ws)
    truth = ref(x, w, ws).double()
    rel = ((out.double() - truth).norm() / truth.norm()).item()
    mp = -(-M // c["BM"]) * c["BM"]
    q, s = F.quantize(x, mp)
    y = torch.empty(mp, N, dtype=torch.bfloat16, device=dev)
    kern = F._gemm(N, K, c["BM"], c["BN"], c["stages"], c["threads"], "bfloat16")
    flops = 2 * M * N * K
    # CUDA-graph replays, as the engine runs them (no host launch overhead in the figures)
    t_all = timed(graphed(lambda: F.fp8_linear(x, w, ws)), reps=50)
    t_tl = timed(graphed(lambda: F.linear_tilelang(x, w, ws)), reps=50)
    t_gemm = timed(graphed(lambda: kern(q, s, w, ws, y)), reps=50)
    mode, sm = _scaled_mm(q[:M], s[:M], w, ws)
    t_sm = timed(graphed(sm), reps=50) if sm else None
    wb = torch.randn(N, K, generator=g, device=dev).to(torch.bfloat16)
    t_bf16 = timed(graphed(lambda: x @ wb.t()), reps=50)
    path = "scaled_mm" if F.scaled_mm_blockwise(x.device) else "tilelang"
    row = {"shape": name, "M": M, "N": N, "K": K, "fp8_linear_path": path, "config": c,
           "rel_err_vs_reference": rel, "fp8_linear_ms": t_all, "fp8_linear_TFLOPs": flops / t_all / 1e9,
           "tilelang_TFLOPs": flops / t_tl / 1e9, "tilelang_gemm_only_TFLOPs": flops / t_gemm / 1e9,
           "scaled_mm_mode": mode, "scaled_mm_TFLOPs": flops / t_sm / 1e9 if t_sm else None,
           "bf16_cublas_TFLOPs": flops / t_bf16 / 1e9,
           "weight_GBps": (N * K + N * K // 16384 * 4) / t_all / 1e6}
    row["fraction_of_fp8_peak"] = row["fp8_linear_TFLOPs"] / FP8_PEAK_TFLOPS
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--m", default="64,512,4096")
    ap.add_argument("--dry", action="store_true")
    ap.add_argument("--repeats", type=int, default=2, help="independent runs of the whole table (figures need two)")
    args = ap.parse_args()
    if args.dry:
        os.environ["DEEPINFER_TL_DRYRUN"] = "1"
    from kernels_cuda import fp8_gemm as F

    rows = []
    for run, M in [(r, m) for r in range(1 if args.dry else args.repeats) for m in map(int, args.m.split(","))]:
        for name, N, K in SHAPES:
            if args.dry:
                c = F.gemm_config(M, N)
                F._gemm(N, K, c["BM"], c["BN"], c["stages"], c["threads"], "bfloat16")
                F._act_quant(K, "bfloat16")
                F._act_quant(K, "bfloat16", True)
                continue
            r = {"run": run + 1} | measure(M, name, N, K, "cuda")
            rows.append(r)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # after each row: a timeout keeps the rest
            Path(args.out).write_text(json.dumps({"fp8_peak_TFLOPs": FP8_PEAK_TFLOPS, "rows": rows}, indent=1))
            print(f"run {run + 1} M={M:5d} {name:11s} fp8_linear[{r['fp8_linear_path']}] {r['fp8_linear_TFLOPs']:7.1f} "
                  f"tilelang {r['tilelang_TFLOPs']:7.1f} (gemm {r['tilelang_gemm_only_TFLOPs']:7.1f}) "
                  f"scaled_mm[{r['scaled_mm_mode'].split()[0]}] {r['scaled_mm_TFLOPs'] or 0:7.1f} "
                  f"bf16 {r['bf16_cublas_TFLOPs']:7.1f} TFLOP/s {r['weight_GBps']:6.0f} GB/s "
                  f"rel {r['rel_err_vs_reference']:.1e}", flush=True)


if __name__ == "__main__":
    main()

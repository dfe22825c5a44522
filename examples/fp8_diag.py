"""Where the FP8 GEMMs (``kernels_cuda.fp8_gemm``) differ from the reference (``kernels_cpu.fp8_ops``), and why.

    python examples/fp8_diag.py --out fp8_diag.json [--skip-moe] [--skip-perf]

Linear cases (the conformance test's shapes and inputs): the activation quantisation compared bit for bit,
then every output against a float64 truth built from the reference's quantised operands:

* the reference itself at float32 and after its bf16 rounding (how much of the test's bound its own
  rounding uses), ``torch._scaled_mm`` blockwise (cuBLAS's FP8 tensor-core accumulation, the baseline for
  what the hardware gives), the kernel at bf16 and at float32 out, and the kernel promoting to float32
  every 32 k (one wgmma) instead of every 128;
* error maps of the kernel: mean |err| / rms(truth) per row within the M tile, per column within the
  128-column scale block, per M tile and per N tile (an indexing bug shows as one hot row/column/tile),
  the fit of err on truth (a systematic shrink shows as a negative slope) and the worst elements.

MoE cases: each launch checked on its own against the reference given the kernel's own inputs (gather +
quantise, gemm1 -> hidden, hidden quantisation, gemm2 -> per-slot rows, combine), plus the end-to-end
error and the reference's own sensitivity (the reference at float32 activations against it at bf16).

Perf: CUDA-graph replays of the dense path variants against ``torch._scaled_mm`` at M = 64, 512, 4096.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "tests"))  # fp8_moe_stages: the launch-by-launch check

DEV = "cuda"
LINEAR = [("q_b", 64, 24576, 1536), ("q_b", 200, 24576, 1536), ("v2lite_q", 200, 3072, 2048),
          ("dense_w13", 200, 36864, 7168), ("q_a", 200, 1536, 7168), ("o_proj", 64, 7168, 16384)]


def fp8_weight(g, *shape):
    *lead, n, k = shape
    w = (torch.randn(*shape, generator=g, device=DEV) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = (torch.rand(*lead, -(-n // 128), -(-k // 128), generator=g, device=DEV) + 0.5) * (k ** -0.5 / 64)
    return w, s


def ratio(out: torch.Tensor, truth: torch.Tensor, rtol: float = 2e-2) -> float:
    """max |out - truth| over the conformance bound rtol * (|truth| + rms(truth))."""
    o, r = out.double(), truth.double()
    return ((o - r).abs() / (rtol * (r.abs() + r.pow(2).mean().sqrt()))).max().item()


def stats(out: torch.Tensor, truth: torch.Tensor) -> dict:
    o, r = out.double(), truth.double()
    e = o - r
    rms = r.pow(2).mean().sqrt()
    return {"bound_ratio": round(ratio(o, r), 4), "rel_l2": (e.norm() / r.norm()).item(),
            "max_err_over_rms": (e.abs().max() / rms).item(), "slope": ((e * r).sum() / (r * r).sum()).item()}


def error_maps(out: torch.Tensor, truth: torch.Tensor, BM: int) -> dict:
    e = (out.double() - truth.double()).abs() / truth.double().pow(2).mean().sqrt()
    M, N = e.shape
    rows = torch.zeros(BM, device=e.device, dtype=torch.float64).index_add_(0, torch.arange(M, device=e.device) % BM,
                                                                           e.mean(1))
    rows = rows / torch.bincount(torch.arange(M, device=e.device) % BM, minlength=BM).clamp_min(1)
    cols = e.mean(0)[: N // 128 * 128].view(-1, 128).mean(0)
    mt = torch.stack([e[i:i + BM].mean() for i in range(0, M, BM)])
    nt = e.mean(0)[: N // 128 * 128].view(-1, 128).mean(1)
    r3 = lambda t: [round(v, 5) for v in t.tolist()]  # noqa: E731
    flat = e.flatten().topk(5)
    worst = [{"row": int(i) // N, "col": int(i) % N, "err_over_rms": round(v, 4)} for v, i in
             zip(flat.values.tolist(), flat.indices.tolist())]
    return {"per_row_in_tile": r3(rows), "per_col_in_block": r3(cols), "per_m_tile": r3(mt),
            "n_tile_min_max": [nt.min().item(), nt.max().item()], "worst": worst}


def scaled_mm(q, s, w, ws, dtype):
    try:
        return torch._scaled_mm(q, w.t(), s.t().contiguous().t(), ws.t(), out_dtype=dtype)
    except Exception as exc:  # noqa: BLE001 (recorded: this torch/cuBLAS may refuse a mode)
        return f"{type(exc).__name__}: {str(exc)[:160]}"


def linear_case(name: str, M: int, N: int, K: int) -> dict:
    from kernels_cpu.fp8_ops import GROUP, dequantize_blocks, quantize_act_fp8
    from kernels_cpu.fp8_ops import fp8_linear as ref
    from kernels_cuda import fp8_gemm as F

    g = torch.Generator(device=DEV).manual_seed(M * 7 + N)  # the conformance test's inputs
    x = torch.randn(M, K, generator=g, device=DEV).to(torch.bfloat16)
    w, ws = fp8_weight(g, N, K)
    res = {"case": f"{name} M={M}", "M": M, "N": N, "K": K}
    q_ref, s_ref = quantize_act_fp8(x)
    c = F.gemm_config(M, N)
    mp = -(-M // c["BM"]) * c["BM"]
    q, s = F.quantize(x, mp)
    res["quant_q_mismatches"] = int((q[:M].view(torch.uint8) != q_ref.view(torch.uint8)).sum())
    res["quant_scale_max_rel"] = ((s[:M] - s_ref) / s_ref).abs().max().item()
    res["pad_rows_zero"] = bool((q[M:].view(torch.uint8) == 0).all()) if mp > M else True
    a = dequantize_blocks(q_ref, s_ref, 1, GROUP).double()
    b = dequantize_blocks(w, ws, GROUP, GROUP).double()
    truth = a @ b.t()
    ref32 = dequantize_blocks(q_ref, s_ref, 1, GROUP) @ dequantize_blocks(w, ws, GROUP, GROUP).t()
    outs = {"reference_fp32": ref32, "reference_bf16": ref(x, w, ws), "kernel_bf16": F.linear_tilelang(x, w, ws),
            "dispatch_bf16": F.fp8_linear(x, w, ws)}
    args = (c["BM"], c["BN"], c["stages"], c["threads"])
    for label, bk in (("kernel_fp32_promote128", 128), ("kernel_fp32_promote32", 32)):
        y = torch.empty(mp, N, dtype=torch.float32, device=DEV)
        F._gemm(N, K, *args, "float32", bk)(q, s, w, ws, y)
        outs[label] = y[:M]
    for label, dt in (("scaled_mm_bf16", torch.bfloat16), ("scaled_mm_fp32", torch.float32)):
        o = scaled_mm(q_ref, s_ref, w, ws, dt)
        if isinstance(o, str):
            res[label] = o
        else:
            outs[label] = o
    res["vs_truth64"] = {k: stats(v, truth) for k, v in outs.items()}
    res["kernel_bf16_vs_reference_bf16"] = stats(outs["kernel_bf16"], outs["reference_bf16"])
    res["kernel_bf16_bits_equal_reference"] = float((outs["kernel_bf16"] == outs["reference_bf16"]).float().mean())
    r = outs["reference_bf16"].double()
    worst = ((outs["kernel_bf16"].double() - r).abs() / (2e-2 * (r.abs() + r.pow(2).mean().sqrt()))).flatten().topk(8)
    res["worst_kernel_bf16_vs_reference_bf16"] = [
        {"row": int(i) // N, "col": int(i) % N, "ratio": round(v, 3), "truth64": truth.flatten()[i].item()}
        | {k: o.flatten()[i].item() for k, o in outs.items()}
        for v, i in zip(worst.values.tolist(), worst.indices.tolist())]
    res["maps_kernel_fp32_vs_truth"] = error_maps(outs["kernel_fp32_promote128"], truth, c["BM"])
    res["maps_kernel_bf16_vs_reference_bf16"] = error_maps(outs["kernel_bf16"], outs["reference_bf16"], c["BM"])
    return res


def moe_case(name: str, T: int, E: int, C: int, I: int, k: int) -> dict:
    from fp8_moe_stages import moe_fp8_stages

    from kernels_cpu.fp8_ops import fused_moe_fp8 as ref_moe

    g = torch.Generator(device=DEV).manual_seed(T + E)  # the conformance test's inputs
    x = torch.randn(T, C, generator=g, device=DEV).to(torch.bfloat16)
    w13, s13 = fp8_weight(g, E, 2 * I, C)
    w2, s2 = fp8_weight(g, E, C, I)
    ids = torch.stack([torch.randperm(E + 4, generator=torch.Generator().manual_seed(t))[:k] - 2
                       for t in range(T)]).to(DEV)
    weights = torch.rand(T, k, device=DEV).to(torch.bfloat16)
    st = moe_fp8_stages(x, w13, s13, w2, s2, weights, ids)
    res = {"case": name, "T": T, "E": E, "C": C, "I": I, "k": k, "rows_vs_valid_slots": list(st["rows"])}
    for stage, v in st.items():
        if isinstance(v, tuple) and len(v) == 3:
            kind, out, want = v
            res[stage] = ({"mismatches": int((out != want).sum())} if kind == "exact"
                          else stats(out, want) | {"bits_equal": float((out == want).float().mean())})
    ref_out = ref_moe(x, w13, s13, w2, s2, weights, ids)
    res["end_to_end"] = stats(st["out"], ref_out)
    res["reference_fp32_acts_vs_reference_bf16"] = stats(ref_moe(x.float(), w13, s13, w2, s2, weights.float(), ids),
                                                         ref_out)
    return res


def quant_scaled_mm(x, w, ws):
    from kernels_cuda import fp8_gemm as F

    q, s = F.quantize_t(x, x.shape[0])
    return torch._scaled_mm(q, w.t(), s.t(), ws.t(), out_dtype=torch.bfloat16)


def perf_row(M: int, name: str, N: int, K: int) -> dict:
    from gpu_timing import graphed, timed

    from kernels_cuda import fp8_gemm as F

    g = torch.Generator(device=DEV).manual_seed(M + N)
    x = torch.randn(M, K, generator=g, device=DEV).to(torch.bfloat16)
    w, ws = fp8_weight(g, N, K)
    c = F.gemm_config(M, N)
    args = (c["BM"], c["BN"], c["stages"], c["threads"])
    mp = -(-M // c["BM"]) * c["BM"]
    q, s = F.quantize(x, mp)
    qt, st = F.quantize_t(x, M)
    y = torch.empty(mp, N, dtype=torch.bfloat16, device=DEV)
    cand = {
        "ours_linear": lambda: F.linear_tilelang(x, w, ws),
        "dispatch": lambda: F.fp8_linear(x, w, ws),
        "ours_gemm": lambda: F._gemm(N, K, *args, "bfloat16")(q, s, w, ws, y),
        "ours_quant": lambda: F.quantize(x, mp),
        "quant_t": lambda: F.quantize_t(x, M),
        "scaled_mm": lambda: torch._scaled_mm(qt, w.t(), st.t(), ws.t(), out_dtype=torch.bfloat16),
        "quant_t+scaled_mm": lambda: quant_scaled_mm(x, w, ws),
    }
    row = {"M": M, "shape": name, "N": N, "K": K, "config": c}
    flops = 2 * M * N * K
    for label, fn in cand.items():
        try:
            ms = timed(graphed(fn), reps=30)
            row[label + "_us"] = round(ms * 1e3, 2)
            row[label + "_TFLOPs"] = round(flops / ms / 1e9, 1)
        except Exception as exc:  # noqa: BLE001 (one variant failing keeps the others)
            row[label + "_error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
    return row


PERF_SHAPES = [("q_b", 24576, 1536), ("o_proj", 7168, 16384), ("dense_w13", 36864, 7168), ("expert_w2", 7168, 2048),
               ("q_a+kv_a", 2112, 7168)]


def perf() -> list[dict]:
    rows = []
    for M in (64, 512, 4096):
        for name, N, K in PERF_SHAPES:
            rows.append(perf_row(M, name, N, K))
            print(json.dumps(rows[-1]), flush=True)
    return rows


MOE = [("V2-Lite b64", 64, 64, 2048, 1408, 6), ("V3 b256", 256, 256, 7168, 2048, 8),
       ("kit-like 120 tokens", 120, 6, 256, 128, 3)]


def warm() -> None:
    """Compile (``DEEPINFER_TL_DRYRUN=1``, no GPU) every kernel this script runs."""
    from kernels_cuda import fp8_gemm as F

    for _, M, N, K in LINEAR:
        c = F.gemm_config(M, N)
        args = (c["BM"], c["BN"], c["stages"], c["threads"])
        F._act_quant(K, "bfloat16")
        F._act_quant(K, "bfloat16", True)
        F._gemm(N, K, *args, "bfloat16")
        F._gemm(N, K, *args, "float32", 128)
        F._gemm(N, K, *args, "float32", 32)
    for _, T, E, C, I, k in MOE:
        z = lambda *shape, dt=torch.bfloat16: torch.empty(*shape, dtype=dt, device="meta")  # noqa: E731
        F.moe_fp8_steps(z(T, C), z(E, 2 * I, C, dt=torch.float8_e4m3fn), z(E, 2 * I // 128, C // 128, dt=torch.float32),
                        z(E, C, I, dt=torch.float8_e4m3fn), z(E, C // 128, I // 128, dt=torch.float32), z(T, k),
                        z(T, k, dt=torch.int64))
    for M in (64, 512, 4096):
        for _, N, K in PERF_SHAPES:
            c = F.gemm_config(M, N)
            args = (c["BM"], c["BN"], c["stages"], c["threads"])
            F._act_quant(K, "bfloat16")
            F._act_quant(K, "bfloat16", True)
            F._gemm(N, K, *args, "bfloat16")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--skip-linear", action="store_true")
    ap.add_argument("--skip-moe", action="store_true")
    ap.add_argument("--skip-perf", action="store_true")
    ap.add_argument("--dry", action="store_true", help="only compile the kernels (DEEPINFER_TL_DRYRUN=1, no GPU)")
    args = ap.parse_args()
    if args.dry:
        os.environ["DEEPINFER_TL_DRYRUN"] = "1"
        return warm()
    result: dict = {"torch": torch.__version__, "allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                    "float32_matmul_precision": torch.get_float32_matmul_precision()}
    path = Path(args.out)

    def save():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))

    for key, fn, cases in (("linear", linear_case, [] if args.skip_linear else LINEAR),
                           ("moe", moe_case, [] if args.skip_moe else MOE)):
        for case in cases:
            try:
                r = fn(*case)
            except Exception as exc:  # noqa: BLE001 (one case failing keeps the others)
                r = {"case": str(case), "error": f"{type(exc).__name__}: {str(exc)[:400]}"}
            result.setdefault(key, []).append(r)
            print(json.dumps(r)[:3000], flush=True)
            save()
            torch.cuda.empty_cache()
    if not args.skip_perf:
        result["perf"] = perf()
        save()


if __name__ == "__main__":
    main()

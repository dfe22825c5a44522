"""``moe_gemm2`` tile and pipeline variants at V2-Lite widths (K = I = 1408: 22 k-steps of 64), timed stage by
stage (``kernels_cuda.moe.moe_steps``) from CUDA-graph replays, at 1 and 64 tokens with the shared experts
folded in (top-6 + 2 always-selected of 64 + 2 experts).

    python examples/moe_gemm2_sweep.py [--out sweep.json]
    DEEPINFER_TL_DRYRUN=1 TILELANG_CACHE_DIR=... python examples/moe_gemm2_sweep.py --dry
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

#: overrides of the SMALL configuration's gemm2 (BN2, BK2, stages2)
VARIANTS = {"current (128, 64, 4)": {}, "stages 2": {"stages2": 2}, "BK 128 stages 2": {"BK2": 128, "stages2": 2},
            "BK 128 stages 3": {"BK2": 128, "stages2": 3}, "BN 64": {"BN2": 64}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="")
    ap.add_argument("--dry", action="store_true")
    args = ap.parse_args(argv)
    if args.dry:
        os.environ["DEEPINFER_TL_DRYRUN"] = "1"
    from kernels_cuda.moe import SMALL, moe_steps

    dev = "cpu" if args.dry else "cuda"
    E, S, C, I, k = 64, 2, 2048, 1408, 6
    w13 = torch.randn(E + S, 2 * I, C, device=dev).to(torch.bfloat16) * C**-0.5 if not args.dry else \
        torch.empty(E + S, 2 * I, C, dtype=torch.bfloat16)
    w2 = torch.randn(E + S, C, I, device=dev).to(torch.bfloat16) * I**-0.5 if not args.dry else \
        torch.empty(E + S, C, I, dtype=torch.bfloat16)
    res: dict = {}
    for T in (1, 64):
        x = torch.randn(T, C, device=dev).to(torch.bfloat16)
        routed = torch.rand(T, E, device=dev).topk(k, dim=-1).indices
        ids = torch.cat((routed, torch.arange(E, E + S, device=dev).expand(T, S)), 1)
        w = torch.rand(T, k + S, device=dev).to(torch.bfloat16)
        hit = int(ids.unique().numel())
        w2_bytes = hit * C * I * 2
        for name, over in VARIANTS.items():
            steps, finish = moe_steps(x, w13, w2, w, ids, cfg={**SMALL, **over})
            if args.dry:
                for _, fn in steps:
                    fn()
                continue
            from gpu_timing import graphed, timed

            for _, fn in steps:
                fn()
            gemm2 = dict(steps)["gemm2"]
            ms = timed(graphed(gemm2), warmup=2, reps=20)
            out = finish().float()
            res[f"T={T} {name}"] = {"gemm2_us": round(ms * 1e3, 2), "GBps": round(w2_bytes / ms / 1e6)}
            print(f"T={T:>3} {name:>22}: gemm2 {ms * 1e3:7.2f} us, {w2_bytes / ms / 1e6:6.0f} GB/s of w2 "
                  f"({hit} experts), out checksum {out.abs().sum().item():.4e}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

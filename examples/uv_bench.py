"""MLA decode + W_UV at decode batches, fused (``mla_decode_uv``) and not (``mla_decode`` + ``head_linear``), on
one GPU: the device time of one call of each, CUDA-graph replays (so launch gaps count as in the engine).

    python examples/uv_bench.py [--heads 16] [--ctx 2048] [--batches 1,2,4]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    from mla_decode_bench import graph_us  # noqa: PLC0415  (examples/, on the path as this script's folder)

    from kernels_cuda.gemv_rows import head_linear
    from kernels_cuda.mla_decode import mla_decode
    from kernels_cuda.mla_decode_uv import mla_decode_uv

    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--batches", default="1,2,4")
    ap.add_argument("--bs", type=int, default=64)
    args = ap.parse_args()
    H, L, R, V, bs = args.heads, 512, 64, 128, args.bs
    for B in map(int, args.batches.split(",")):
        per = -(-args.ctx // bs)
        cache = torch.randn(B * per + 1, bs, L + R, device="cuda").to(torch.bfloat16)
        tables = torch.arange(B * per, device="cuda", dtype=torch.int32).view(B, per)
        q = torch.randn(B, H, L + R, device="cuda").to(torch.bfloat16)
        w_uv = (torch.randn(H, V, L, device="cuda") * L**-0.5).to(torch.bfloat16)
        cu, sl = torch.arange(B + 1, device="cuda"), torch.full((B,), args.ctx, device="cuda")
        a = (q, cache, tables, cu, sl, 192**-0.5, L)
        t_att = graph_us(lambda a=a: mla_decode(*a), 10, 200)
        t_two = graph_us(lambda a=a, w=w_uv: head_linear(mla_decode(*a), w), 10, 200)
        t_uv = graph_us(lambda a=a, w=w_uv: mla_decode_uv(*a, w), 10, 200)
        print(f"H={H} ctx={args.ctx} B={B}: mla_decode {t_att:.2f} us, mla_decode + head_linear {t_two:.2f} us, "
              f"mla_decode_uv {t_uv:.2f} us ({t_two - t_uv:+.2f} us)")


if __name__ == "__main__":
    main()

"""A few launches of the decode FP8 MoE (V2-Lite, one token) for ``ncu`` (docs/h200/s10):

    ncu --clock-control none -k regex:moe_ --launch-skip 4 --launch-count 2 --section SpeedOfLight \
        python3 examples/device/moe_fp8_ncu.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernels_cuda.moe_gemv_fp8 import fused_moe_fp8_small  # noqa: E402

E, C, I, k, S = 66, 2048, 1408, 6, 2
w13 = (torch.randn(E, 2 * I, C, device="cuda") * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
w2 = (torch.randn(E, C, I, device="cuda") * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
s13 = torch.rand(E, 2 * I // 128, C // 128, device="cuda") * 1e-3
s2 = torch.rand(E, C // 128, I // 128, device="cuda") * 1e-3
for _ in range(4):
    ids = torch.cat((torch.randperm(E - S)[:k], torch.arange(E - S, E))).view(1, -1).cuda()
    x = torch.randn(1, C, device="cuda").to(torch.bfloat16)
    fused_moe_fp8_small(x, w13, s13, w2, s2, torch.rand(1, k + S, device="cuda").to(torch.bfloat16), ids)
torch.cuda.synchronize()

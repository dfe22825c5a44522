"""The FP8 fused MoE of ``kernels_cuda.fp8_gemm`` launch by launch, each against the reference given that
launch's own inputs (``tests/test_fp8_gemm_gpu.py``, ``examples/fp8_diag.py``).

End to end, the output is compared norm-wise (the hidden is re-quantised to e4m3, see
``deepinfer_core/testing/kernels.py``); per launch every input is identical, so each is held to the
elementwise bound (GEMMs) or to bit equality (quantisation, routing)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_fp8_stages(x, w13, s13, w2, s2, weights, ids, cfg: dict | None = None) -> dict:
    """Run the kernel's launches; returns ``{stage: (kind, out, ref)}`` with kind ``"exact"`` (bit-equal
    expected) or ``"close"`` (the elementwise bound), plus ``"rows"``: (rows written, valid slots)."""
    from kernels_cpu.fp8_ops import fp8_linear, quantize_act_fp8
    from kernels_cuda.fp8_gemm import moe_fp8_steps

    bufs: dict = {}
    steps, finish = moe_fp8_steps(x, w13, s13, w2, s2, weights, ids, cfg=cfg, buffers=bufs)
    for _, step in steps:
        step()
    out = finish()
    E, I, K, BM = w13.shape[0], w13.shape[1] // 2, ids.shape[1], bufs["BM"]
    row_slot, block_expert = bufs["row_slot"].long(), bufs["block_expert"].long()
    rows = torch.arange(row_slot.numel(), device=x.device)
    expert = block_expert[rows // BM]
    valid = (expert >= 0) & (row_slot >= 0)
    R, slot, e = rows[valid], row_slot[valid], expert[valid]
    tok = slot // K
    ok = (ids >= 0) & (ids < E)
    res: dict = {"rows": (int(R.numel()), int(ok.sum())),
                 "align": ("exact", ids.reshape(-1)[slot].to(torch.int64), e),
                 "slots": ("exact", slot.sort().values, ok.reshape(-1).nonzero()[:, 0])}
    q_ref, s_ref = quantize_act_fp8(x[tok])
    res["gather_q"] = ("exact", bufs["xq"][R].view(torch.uint8), q_ref.view(torch.uint8))
    res["gather_scale"] = ("exact", bufs["sx"][R], s_ref)
    hs = bufs["hs"][R]
    h_ref = torch.empty_like(hs)
    y_ref = torch.empty(R.numel(), x.shape[1], dtype=x.dtype, device=x.device)
    for ex in e.unique().tolist():
        m = e == ex
        gu = fp8_linear(x[tok[m]], w13[ex], s13[ex])
        h_ref[m] = (F.silu(gu[:, :I].float()) * gu[:, I:].float()).to(x.dtype)
        y_ref[m] = fp8_linear(hs[m], w2[ex], s2[ex])  # gemm2's reference from the kernel's own hidden
    res["gemm1_hidden"] = ("close", hs, h_ref)
    hq_ref, sh_ref = quantize_act_fp8(hs)
    res["hidden_q"] = ("exact", bufs["hq"][R].view(torch.uint8), hq_ref.view(torch.uint8))
    res["hidden_scale"] = ("exact", bufs["sh"][R], sh_ref)
    y = bufs["y"][slot]
    res["gemm2"] = ("close", y, y_ref)
    y_full = torch.zeros(ids.numel(), x.shape[1], dtype=torch.float32, device=x.device)
    y_full[slot] = y.float()
    comb = (y_full.view(*ids.shape, -1) * (weights.float() * ok)[..., None]).sum(1).to(x.dtype)
    res["combine"] = ("close", out, comb)
    res["out"] = out
    return res

#!/usr/bin/env python
"""One layer's MLA decode at long context: the bf16 kernel over a bf16 cache against the FP8-row kernel
over FP8 rows, each at its own batch (default: the H200's max batch at 32k, 86 and 151), and the FP8
kernel at other tile configurations. Prints us per call, KV bytes read per second and us per 1k keys.

    python examples/kv_fp8_decode_bench.py --context 32768 --bf16-batch 86 --fp8-batch 151
"""

from __future__ import annotations

import argparse
import json

import torch


def _time(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1e3  # us


#: FP8 tile configurations to compare: None is the default (64-key tiles, 8 consumer warps); then the
#: previous default (64-key tiles, 4 warps), 32-key tiles, the warp-specialised kernel (heads padded to 64),
#: and the default tiles with f16 tiles and tensor cores
FP8_CONFIGS = [None, {"BH": 16, "BN": 64, "stages": 2, "threads": 128},
               {"BH": 16, "BN": 32, "stages": 2, "threads": 128}, {"kernel": "ws", "BH": 64, "BN": 64},
               {"BH": 16, "BN": 64, "stages": 2, "threads": 256, "mma": "float16"}]


def bench(kind: str, B: int, ctx: int, H: int, bs: int, reps: int) -> list[dict]:
    import functools

    from kernels_cpu.kv_fp8 import quantize_latent_rows
    from kernels_cuda.mla_decode import mla_decode

    dev, L, R = ("cuda" if torch.cuda.is_available() else "cpu"), 512, 64  # cpu: --dry
    nb = B * (ctx // bs)
    tables = torch.randperm(nb, device=dev, dtype=torch.int32).view(B, ctx // bs)
    q = torch.randn(B, H, L + R, device=dev, dtype=torch.bfloat16)
    args = (tables, torch.arange(B + 1, device=dev), torch.full((B,), ctx, device=dev), 0.1, L)
    if kind == "bf16":
        cache = torch.randn(nb, bs, L + R, device=dev, dtype=torch.bfloat16)
        calls, width = [(None, functools.partial(mla_decode, q, cache, *args))], (L + R) * 2
    else:
        cache = torch.empty(nb, bs, 656, device=dev, dtype=torch.uint8)
        for i in range(0, nb, 4096):  # quantise in chunks (the reference, on the device)
            n = min(4096, nb - i)
            cache[i:i + n] = quantize_latent_rows(torch.randn(n * bs, L + R, device=dev), 656).view(n, bs, 656)
        cfgs = FP8_CONFIGS if H == 16 else [None]  # the tile alternatives are 16-head tiles
        calls = [(c, functools.partial(mla_decode, q, cache, *args, cfg=c)) for c in cfgs]
        width = 656
    rows = []
    for cfg, fn in calls:
        if dev == "cpu":  # --dry: compile only
            fn()
            continue
        us = _time(fn, reps)
        keys = B * ctx
        rows.append({"kind": kind, "heads": H, "batch": B, "cfg": cfg, "us": us, "kv_TBps": keys * width / us / 1e6,
                     "us_per_1k_keys": us / keys * 1e3})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--bf16-batch", type=int, default=86)
    ap.add_argument("--fp8-batch", type=int, default=151)
    ap.add_argument("--heads", default="16", help="comma-separated head counts (128: V3's)")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--dry", action="store_true", help="compile the kernels only (no GPU; fills TileLang's cache)")
    a = ap.parse_args()
    if a.dry:
        import os

        os.environ["DEEPINFER_TL_DRYRUN"] = "1"
        a.context = a.block_size
    rows = []
    for H in (int(h) for h in a.heads.split(",")):
        for kind, B in (("bf16", a.bf16_batch), ("fp8", a.fp8_batch)):
            rows += bench(kind, B, a.context, H, a.block_size, a.reps)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

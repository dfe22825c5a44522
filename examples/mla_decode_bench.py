#!/usr/bin/env python
"""MLA decode attention time per layer at small batches, as a decode step runs it: ``--layers`` calls
captured in one CUDA graph (each call the decode kernel and, when it splits, the combine), replayed, so
launch gaps inside the graph count and host overhead does not. For each (heads, batch, context):

* ``before``: the previous design, reproduced: at least 64 keys per split and the serial combine (one
  dependent load per split);
* ``after``: the defaults (``SPLIT_KEYS`` keys per split at least, the pipelined combine);
* ``keys=N``: the default combine with at least N keys per split (the sweep behind ``SPLIT_KEYS``).

    python examples/mla_decode_bench.py --json out.json [--heads 16] [--batches 1,8] [--contexts 512,2048,8192]
"""

import argparse
import json

import torch


def legacy_combine(H: int, DV: int, dtype: str = "bfloat16"):
    """The combine before this change (for the ``before`` rows): a serial loop over all splits."""
    from kernels_cuda import _tl
    from kernels_cuda.mla_decode import MAX_SPLIT

    T = _tl.language()
    NT, n_split = T.dynamic("NT"), T.dynamic("NSPLIT")
    S, accum = MAX_SPLIT, "float32"

    @T.prim_func
    def mla_decode_combine_serial(OPart: T.Tensor((NT, H, n_split, DV), accum),
                                  LsePart: T.Tensor((NT, H, n_split), accum), Out: T.Tensor((NT, H, DV), dtype)):
        with T.Kernel(H, NT, threads=128) as (h, t):
            lse = T.alloc_fragment((1, S), accum)
            wts = T.alloc_fragment((1, S), accum)
            mx = T.alloc_fragment((1,), accum)
            total = T.alloc_fragment((1,), accum)
            w_s = T.alloc_shared((S,), accum)
            o = T.alloc_fragment((DV,), accum)
            for i, s in T.Parallel(1, S):
                lse[i, s] = T.if_then_else(s < n_split, LsePart[t, h, T.min(s, n_split - 1)], -T.infinity(accum))
            T.reduce_max(lse, mx, dim=1)
            for i, s in T.Parallel(1, S):
                wts[i, s] = T.if_then_else(lse[i, s] > -T.infinity(accum), T.exp2(lse[i, s] - mx[i]), 0.0)
            T.reduce_sum(wts, total, dim=1)
            for i, s in T.Parallel(1, S):
                w_s[s] = wts[i, s] / total[i]
            T.fill(o, 0)
            for s in T.serial(n_split):
                if w_s[s] > 0:
                    for i in T.Parallel(DV):
                        o[i] += w_s[s] * OPart[t, h, s, i]
            T.copy(o, Out[t, h, :])

    return mla_decode_combine_serial


def _legacy_kernel(H: int, DV: int, dtype: str, *_):  # *_: the new combine's chunk and stages
    from kernels_cuda import _tl

    global _LEGACY
    if _LEGACY is None:
        _LEGACY = _tl.kernel_cache(legacy_combine)
    return _LEGACY(H, DV, dtype)


_LEGACY = None


def graph_us(fn, layers: int, reps: int) -> float:
    """us per call of ``fn`` captured ``layers`` times in one graph, replayed ``reps`` times."""
    fn()
    if not torch.cuda.is_available():  # --dry: compile only
        return float("nan")
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(layers):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * layers)


def run_point(H: int, B: int, ctx: int, bs: int, keys: list[int], layers: int, reps: int) -> list[dict]:
    from kernels_cuda import _tl
    from kernels_cuda import mla_decode as m

    dev, L, R = ("cuda" if torch.cuda.is_available() else "cpu"), 512, 64
    per = -(-ctx // bs)
    nb = B * per
    tables = torch.randperm(nb, device=dev, dtype=torch.int32).view(B, per)
    cache = torch.randn(nb, bs, L + R, device=dev, dtype=torch.bfloat16)
    q = torch.randn(B, H, L + R, device=dev, dtype=torch.bfloat16)
    cu, sl = torch.arange(B + 1, device=dev), torch.full((B,), ctx, device=dev)
    rows = []
    variants = [("before", 64, True), ("after", m.SPLIT_KEYS, False)] + [(f"keys={k}", k, False) for k in keys]
    new_combine = m._combine_kernel
    for name, k, legacy in variants:
        m._combine_kernel = _legacy_kernel if legacy else new_combine
        try:
            us = graph_us(lambda k=k: m.mla_decode(q, cache, tables, cu, sl, 0.1, L, split_keys=k), layers, reps)
        finally:
            m._combine_kernel = new_combine
        c = m.config(H, L + R, L, bs)
        n_split = m.choose_split((max(H, c["BH"]) // c["BH"]) * B, _tl.num_sms(0))
        if not torch.cuda.is_available():
            continue
        rows.append({"heads": H, "batch": B, "context": ctx, "variant": name, "split_keys": k, "n_split": n_split,
                     "us_per_layer": round(us, 2), "kv_GBps": round(B * ctx * (L + R) * 2 / us / 1e3, 1)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="16")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--contexts", default="512,2048,8192")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--keys", default="64,128,512,1024", help="split_keys values to sweep besides the default")
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--dry", action="store_true", help="compile the kernels only (no GPU; fills TileLang's cache)")
    a = ap.parse_args()
    if a.dry:
        import os

        os.environ["DEEPINFER_TL_DRYRUN"] = "1"
    keys = [int(k) for k in a.keys.split(",") if k]
    rows = []
    for H in (int(h) for h in a.heads.split(",")):
        for B in (int(b) for b in a.batches.split(",")):
            for ctx in (int(c) for c in a.contexts.split(",")):
                rows += run_point(H, B, ctx, a.block_size, keys, a.layers, a.reps)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""The speculative step-time curve of a random-weight DeepSeek shape: one target forward over B decode
requests with r rows each (the query token plus r - 1 draft tokens verified), against the plain decode
step (r = 1) and against the bandwidth roofline. This is the curve DSpark's length policy reads
(``plugins/dspark/policy.py``): a verify row pays when its expected accepted tokens outweigh the step
time it adds.

    python examples/spec_step_curve.py --shape v2-lite --out DIR            # on the H200 (about 1 minute)
    python examples/spec_step_curve.py --shape v2-lite --scale tiny         # CPU, seconds

Per point: ``--reps`` timed forwards (after a warm-up), median kept. The forwards go through the
engine's ``probe_forward`` (inputs prepared as a real step prepares them, LM head over every verified
row, nothing sampled) on synthetic requests of ``--context`` cached tokens whose KV blocks are taken
from the pool. Where the engine captures graphs, they are captured for verify steps too (as an engine
with speculative draft length ``max(rows) - 1`` does: ``graph_buckets``), and every point is timed
twice: replaying its graph (``step_ms[r]``) and eagerly (``step_ms[r_eager]``), so the launch cost and
the kernels' cost can be told apart. ``verify_capture_s``: seconds to capture every graph.

Printed per B: step ms at each r (graph, then eager); the extra time of r rows over the plain step
(graph over graph); and the idle share ``1 - roofline_s / step_s``, where ``roofline_s`` is the bytes
the step must read (weights of the experts its B * r tokens hit under uniform routing, the KV of B
requests read once) over the measured read bandwidth.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from h200_suite import FULL, SMALL, build_llm, suite_config  # noqa: E402
from random_checkpoint import SHAPES, write_config  # noqa: E402
from roofline import decode_step_bytes, expected_distinct_experts  # noqa: E402

from deepinfer_core.engine.sequence import Sequence  # noqa: E402
from deepinfer_core.models.config import ModelConfig  # noqa: E402
from deepinfer_core.sampling_params import SamplingParams  # noqa: E402
from deepinfer_core.scheduler import ScheduledSeq, SchedulerOutput  # noqa: E402


def synthetic_requests(engine, n: int, context: int, rows: int, vocab: int, rng: random.Random) -> list[Sequence]:
    """``n`` requests of ``context`` computed tokens plus the slots of ``rows`` new ones, blocks from the pool."""
    seqs = []
    for i in range(n):
        s = Sequence(f"__curve_{i}", None, [rng.randrange(2, vocab) for _ in range(context + 1)],
                     SamplingParams(max_tokens=1), 0, [])
        if not engine.blocks.can_allocate(s, context + rows):
            raise RuntimeError(f"KV pool too small for {n} requests of {context + rows} tokens")
        engine.blocks.allocate(s, context + rows)
        s.num_computed_tokens = context
        seqs.append(s)
    return seqs


def time_forward(engine, out: SchedulerOutput, drafts: dict | None, reps: int, eager: bool) -> tuple[float, bool]:
    """(median seconds of one target forward over ``out`` with ``drafts`` verified, whether it replayed
    a graph)."""
    runner = engine.runner
    graphs = runner.graphs
    replayed = not eager and graphs is not None and graphs.accepts(runner.prepare(out, drafts))

    def once() -> float:
        engine.platform.synchronize()
        t = time.perf_counter()
        engine.probe_forward(out, drafts)
        engine.platform.synchronize()
        return time.perf_counter() - t

    if eager:
        runner.graphs = None
    try:
        for _ in range(3):
            once()
        return statistics.median(once() for _ in range(reps)), replayed
    finally:
        runner.graphs = graphs


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="v2-lite", choices=sorted(SHAPES))
    ap.add_argument("--scale", default="full", choices=["full", "tiny"])
    ap.add_argument("--batches", default="1,4,16,32,64")
    ap.add_argument("--rows", default="1,2,4", help="rows per request: 1 (plain decode) + verified drafts")
    ap.add_argument("--context", type=int, default=None, help="cached tokens per request (full: 1024)")
    ap.add_argument("--reps", type=int, default=None, help="timed forwards per point (full: 20)")
    ap.add_argument("--accelerator", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="directory for curve.json")
    args = ap.parse_args(argv)
    full = args.scale == "full"
    opts = dict(FULL if full else SMALL)
    batches = [int(b) for b in args.batches.split(",")]
    rows = sorted({int(r) for r in args.rows.split(",")} | {1})
    ctx = args.context or (1024 if full else 48)
    reps = args.reps or (20 if full else 3)
    opts.update(context=ctx, decode_batches=args.batches, warmup=0, window=0)
    cfg = suite_config(args.shape, args.scale, None)
    mc = ModelConfig.from_dict(cfg)
    tmp = tempfile.TemporaryDirectory()
    model_dir = write_config(Path(tmp.name) / args.shape, cfg)
    t0 = time.perf_counter()
    llm = build_llm(model_dir, opts, batches, [ctx + max(rows)], args.accelerator, args.seed)
    engine = llm.engine
    graphs = getattr(engine.runner, "graphs", None) is not None
    capture_s = None
    if graphs and max(rows) > 1:  # the graphs an engine with draft length max(rows) - 1 captures
        engine.runner.setup_graphs(engine.platform, engine.cfg, engine.max_model_len, spec_k=max(rows) - 1)
        capture_s = engine.runner.graphs.capture_seconds
        print(f"captured {len(engine.runner.graphs.graphs)} graphs (verify rows "
              f"{dict(engine.runner.graphs.verify_sizes)}) in {capture_s:.2f} s", flush=True)
    build_s = time.perf_counter() - t0
    dev = engine.device
    if dev.type == "cuda":
        from gpu_timing import measure_ceilings

        read_gbps = measure_ceilings(str(dev), gib=2.0, n=4096)["read_GBps"]
    else:
        read_gbps = None
    print(f"{args.shape} ({args.scale}) on {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}: "
          f"built in {build_s:.1f} s, decode graphs {'on' if graphs else 'off'}, context {ctx}, "
          f"read bandwidth {read_gbps and round(read_gbps)} GB/s", flush=True)
    rng = random.Random(args.seed)
    seqs = synthetic_requests(engine, max(batches), ctx, max(rows), mc.vocab_size, rng)
    E, k = mc.n_routed_experts or 0, mc.num_experts_per_tok
    points = []
    try:
        with torch.inference_mode():
            for B in batches:
                out = SchedulerOutput(decodes=[ScheduledSeq(s, 1) for s in seqs[:B]])
                row = {"batch": B, "step_ms": {}, "graph": {}}
                for r in rows:
                    drafts = {s.request_id: [rng.randrange(2, mc.vocab_size) for _ in range(r - 1)]
                              for s in seqs[:B]} if r > 1 else None
                    t, row["graph"][str(r)] = time_forward(engine, out, drafts, reps, eager=False)
                    row["step_ms"][str(r)] = 1e3 * t
                    row["step_ms"][f"{r}_eager"] = 1e3 * time_forward(engine, out, drafts, reps, eager=True)[0]
                base = row["step_ms"]["1"]
                row["extra_vs_plain"] = {str(r): row["step_ms"][str(r)] / base - 1 for r in rows if r > 1}
                if read_gbps:
                    row["idle_share"] = {}
                    for r in rows:
                        hits = expected_distinct_experts(E, k, B * r) if E else 0.0
                        roof_ms = 1e3 * decode_step_bytes(mc, B, ctx, hits, engine.dtype.itemsize)["total"] \
                            / (read_gbps * 1e9)
                        row["idle_share"][str(r)] = 1 - roof_ms / row["step_ms"][str(r)]
                    row["roofline_ms_r1"] = row["step_ms"]["1"] * (1 - row["idle_share"]["1"])
                points.append(row)
                ms = row["step_ms"]
                idle = row.get("idle_share", {})
                print(f"B={B:>3}  " + "  ".join(
                      f"r={r}: {ms[str(r)]:7.3f} ms{' graph' if row['graph'][str(r)] else ' (no graph)'}" + (
                          f" (idle {idle[str(r)] * 100:4.1f}%)" if idle else "") + f" / {ms[f'{r}_eager']:7.3f} eager"
                      for r in rows)
                      + "  extra over plain: "
                      + ", ".join(f"r={r} {v * 100:+.1f}%" for r, v in row["extra_vs_plain"].items()), flush=True)
    finally:
        for s in seqs:
            engine.blocks.release(s)
    res = {"shape": args.shape, "scale": args.scale, "context": ctx, "reps": reps, "dtype": str(engine.dtype),
           "device": str(dev), "decode_graphs": graphs, "verify_capture_s": capture_s, "read_GBps": read_gbps,
           "points": points}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "curve.json").write_text(json.dumps(res, indent=1))
    llm.shutdown()
    return res


if __name__ == "__main__":
    main()

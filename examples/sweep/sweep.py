"""Decode batch sweep of one model shape: steady-state tokens/s at each batch (2k context by default),
each with its bandwidth roofline, written as JSON for ``plot.py``.

    python examples/sweep/sweep.py --shape v2-lite --out sweep.json                  # on the GPU
    python examples/sweep/sweep.py --shape v2-lite --scale tiny --accelerator cpu --out sweep.json
    python examples/sweep/plot.py sweep.json --out pareto.png

The measurement is ``h200_suite.decode_sweep`` (the same as ``benchmark.py --suite h200``, whose
results.json ``plot.py`` reads too): all requests prefilled first, then per batch (largest first,
surplus requests aborted) warm-up steps and a timed window with no prefill in it.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_timing import measure_ceilings  # noqa: E402
from h200_suite import FULL, SMALL, ExpertCounter, build_llm, decode_sweep, suite_config  # noqa: E402
from random_checkpoint import SHAPES, write_config  # noqa: E402

from deepinfer_core.models.config import ModelConfig  # noqa: E402

BATCHES = "1,2,4,8,16,24,32,48,64,96,128,160,192,224,256"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="v2-lite", choices=sorted(SHAPES))
    ap.add_argument("--scale", default="full", choices=["full", "tiny"])
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--accelerator", default=None)
    ap.add_argument("--batches", default=None, help=f"default: {BATCHES} (tiny: 1,2,4,8)")
    ap.add_argument("--context", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--window", type=int, default=None)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="JSON file")
    args = ap.parse_args(argv)
    opts = dict(FULL if args.scale == "full" else SMALL)
    for key in ("context", "warmup", "window"):
        if getattr(args, key) is not None:
            opts[key] = getattr(args, key)
    batches = [int(b) for b in (args.batches or (BATCHES if args.scale == "full" else "1,2,4,8")).split(",")]
    cfg = suite_config(args.shape, args.scale, args.layers)
    mc = ModelConfig.from_dict(cfg)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_config(Path(tmp) / args.shape, cfg)
        extra = {"enforce_eager": True} if args.enforce_eager else {}
        llm = build_llm(model_dir, opts, batches, [16], args.accelerator, args.seed, **extra)
        ceil = measure_ceilings(str(llm.engine.device))
        rows = decode_sweep(llm, mc, batches, opts["context"], opts["warmup"], opts["window"], ceil,
                            ExpertCounter(llm.engine.runner), random.Random(args.seed))
        llm.shutdown()
    res = {"shape": args.shape, "scale": args.scale, "options": opts, "ceilings": ceil, "decode": rows,
           "enforce_eager": args.enforce_eager, "seconds": time.perf_counter() - t0}
    Path(args.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()

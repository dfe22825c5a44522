#!/usr/bin/env python
"""CPU decode with the platform's K-major GEMM weights against plain row-major ones, side by side.

Two engines on the same checkpoint: one as loaded (``CpuPlatform.linear_weight_layout``), one with
every parameter made contiguous again. They alternate round by round, so a shared machine's noise
hits both alike; the ratio per round is what to read.

    python examples/weight_layout_ab.py --shape v3-tiny --batch 1 --threads 2
    python examples/weight_layout_ab.py --shape embedded --batch 1 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from random_checkpoint import SHAPES, make_random_checkpoint, shape_config  # noqa: E402

from deepinfer_core import LLM, SamplingParams  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="v3-tiny", choices=["embedded", *sorted(SHAPES)])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = None
    if args.shape != "embedded":
        model = str(make_random_checkpoint(Path(tempfile.mkdtemp()) / args.shape, shape_config(args.shape), 0))
    engines = {n: LLM(model, max_num_seqs=args.batch, enable_prefix_caching=False) for n in ("k_major", "row_major")}
    for p in engines["row_major"].engine.runner.model.parameters():
        p.data = p.data.contiguous()
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    prompts = [{"prompt_token_ids": [(7 * i + j) % 4000 + 5 for j in range(128)]} for i in range(args.batch)]
    rates: dict[str, list[float]] = {n: [] for n in engines}
    outs = {}
    for r in range(args.rounds):
        for name in (list(engines) if r % 2 == 0 else list(reversed(engines))):
            t = time.perf_counter()
            outs[name] = engines[name].generate(prompts, params, use_tqdm=False)
            rates[name].append(args.tokens * args.batch / (time.perf_counter() - t))
    same = all(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(outs["k_major"], outs["row_major"]))
    ratio = statistics.median(a / b for a, b in zip(rates["k_major"], rates["row_major"]))
    print(f"{args.shape}, batch {args.batch}, {args.threads} thread(s): K-major "
          f"{statistics.median(rates['k_major']):.1f} tok/s, row-major {statistics.median(rates['row_major']):.1f} "
          f"tok/s, ratio {ratio:.3f} (median per round), greedy outputs identical: {same}")
    return {"ratio": ratio, "same": same}


if __name__ == "__main__":
    main()

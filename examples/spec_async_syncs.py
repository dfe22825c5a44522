#!/usr/bin/env python
"""Where an engine's steps make the host wait for the GPU: runs greedy requests through an engine
with ``torch.cuda.set_sync_debug_mode("warn")`` and counts the synchronising calls by the deepinfer
source line that made them (the innermost deepinfer frames of each warning's stack), plus the host
seconds per step of each phase-less run. GPU only.

    python examples/spec_async_syncs.py                          # ngram, async speculation
    python examples/spec_async_syncs.py --speculative none       # plain async decoding
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dspark_bench import heldout_prompts  # noqa: E402

from deepinfer_core import LLM, SamplingParams  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--speculative", default="ngram", help="a proposer name, or 'none'")
    ap.add_argument("--async-scheduling", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--cprofile", action="store_true",
                    help="instead: host seconds by engine function (cProfile, cumulative) over one more run")
    args = ap.parse_args(argv)
    spec = None if args.speculative == "none" else {"proposer": args.speculative, "k": args.k}
    llm = LLM(async_scheduling=bool(args.async_scheduling), speculative=spec, max_num_seqs=args.concurrency,
              enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": p} for p in heldout_prompts(llm.tokenizer, args.concurrency, 0)]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts, greedy, use_tqdm=False)  # warm-up (kernels compiled, graphs captured)
    where: collections.Counter = collections.Counter()

    def note(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "/deepinfer_core/" in f.filename
                  or "/plugins/" in f.filename or "/kernels_" in f.filename]
        key = " <- ".join(f"{Path(f.filename).name}:{f.lineno}({f.name})" for f in frames[-3:][::-1])
        where[(str(message)[:60], key)] += 1

    warnings.showwarning = note
    warnings.simplefilter("always")
    steps0 = llm.engine.stats.steps
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    t = time.perf_counter()
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    torch.cuda.set_sync_debug_mode(0)
    steps = llm.engine.stats.steps - steps0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"speculative={args.speculative} async={bool(args.async_scheduling)} c={args.concurrency}: {steps} steps, "
          f"{tokens} tokens, {wall:.3f} s, {1000 * wall / max(steps, 1):.2f} ms/step, "
          f"{sum(where.values())} synchronising calls")
    for (msg, key), n in where.most_common(25):
        print(f"{n:6d}  {msg:<60}  {key}")
    m = llm.metrics()
    print({k: m[k] for k in ("overlapped_steps", "spec_verified", "spec_accepted", "spec_verify_budget",
                             "spec_draft_slots") if k in m})
    if args.cprofile:
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        llm.generate(prompts, greedy, use_tqdm=False)
        torch.cuda.synchronize()
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumtime").print_stats(
            r"(spec_async|speculative|pipeline|model_runner|graph_runner|ngram|rejection|engine|deepseek|ops)\.py", 40)
        print(out.getvalue())


if __name__ == "__main__":
    main()

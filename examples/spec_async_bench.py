#!/usr/bin/env python
"""Speculative decoding with and without async scheduling, on the embedded model.

Three engines: plain decoding (async scheduling on), the ``ngram`` proposer with synchronous
speculative steps (``async_scheduling = false``), and the same proposer with async scheduling on,
where it proposes on the device and speculative steps overlap (``engine/spec_async.py``).

1. Greedy outputs of all three are compared token by token.
2. Decode tokens/s at each concurrency (steady state after each wave's prefill), the engines
   alternating wave by wave so that a shared machine's noise hits all alike; ``--rounds`` repeats.

    python examples/spec_async_bench.py --num-prompts 32 --concurrency 1,32 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dspark_bench import decode_rate, generate, heldout_prompts  # noqa: E402

from deepinfer_core import LLM, SamplingParams  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--proposer", default="ngram", help="a deepinfer.proposers name that proposes on the device")
    ap.add_argument("--rate-prompts", type=int, default=4, help="requests per decode-rate round at concurrency 1")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--measure-idle", action="store_true", help="device idle share between steps (a GPU)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    concs = [int(c) for c in args.concurrency.split(",")]
    common = dict(max_num_seqs=max(concs), enable_prefix_caching=False, measure_device_idle=args.measure_idle)
    spec = {"proposer": args.proposer, "k": args.k}
    engines = {
        "plain_async": LLM(async_scheduling=True, **common),
        "spec_sync": LLM(async_scheduling=False, speculative=spec, **common),
        # (ngram drafts on the host where the forward runs inline unless told otherwise: device = "on")
        "spec_async": LLM(async_scheduling=True, speculative={**spec, **({"device": "on"} if args.proposer == "ngram"
                                                                         else {})}, **common),
    }
    assert engines["spec_async"].engine.spec.on_device is not None, "the proposer does not propose on the device"
    prompts = heldout_prompts(engines["plain_async"].tokenizer, args.num_prompts, args.seed)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    results: dict = {"prompts": len(prompts), "max_tokens": args.max_tokens, "k": args.k, "proposer": args.proposer,
                     "threads": torch.get_num_threads(), "equivalence": {}, "speculation": {}, "decode_tok_s": {}}
    for c in concs:
        ps = prompts if c > 1 else prompts[: args.rate_prompts]
        outs = {n: [o.outputs[0].token_ids for o in generate(llm, ps, greedy, c)] for n, llm in engines.items()}
        results["equivalence"][f"c{c}"] = {n: f"{sum(a == b for a, b in zip(outs['plain_async'], outs[n]))}/{len(ps)}"
                                           for n in ("spec_sync", "spec_async")}
    for name in ("spec_sync", "spec_async"):
        m = engines[name].metrics()
        results["speculation"][name] = {k: round(m[k], 3) if isinstance(m[k], float) else m[k]
                                        for k in ("spec_accept_rate", "spec_accepted_per_step", "spec_steps",
                                                  "overlapped_steps", "steps")}
    for c in concs:
        ps = prompts[: args.rate_prompts] if c == 1 else prompts[:c]
        per_round = {n: [] for n in engines}
        for r in range(args.rounds):
            tot = {n: [0, 0.0] for n in engines}
            for w in range(0, len(ps), c):
                order = list(engines) if (r + w // c) % 2 == 0 else list(reversed(engines))
                for name in order:
                    n, s = decode_rate(engines[name], ps[w : w + c], greedy, c)
                    tot[name][0] += n
                    tot[name][1] += s
            for name, (n, s) in tot.items():
                per_round[name].append(n / s)
        med = {n: statistics.median(v) for n, v in per_round.items()}
        results["decode_tok_s"][f"c{c}"] = {
            "median": {n: round(v, 1) for n, v in med.items()},
            "rounds": {n: [round(x, 1) for x in v] for n, v in per_round.items()},
            "async_over_sync_median_round": round(statistics.median(
                a / b for a, b in zip(per_round["spec_async"], per_round["spec_sync"])), 3),
            "async_over_plain_median_round": round(statistics.median(
                a / b for a, b in zip(per_round["spec_async"], per_round["plain_async"])), 3),
        }
    if args.measure_idle:
        results["device_idle_share"] = {n: round(llm.metrics().get("device_idle_share", 0.0), 4)
                                        for n, llm in engines.items()}
    print(json.dumps(results, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

"""What keeping dormant steps' hidden rows buys the MTP draft (``Proposer.step_passed_dormant``): DSpark's
acceptance on the embedded model with its shipped MTP layer, async scheduling on, the drafts on the device path,
dormancy forced in cycles (``--active`` speculative steps, then ``--dormant`` plain ones), with the hook against
without it (the dormant steps' positions then stay holes in the MTP layer's KV). Greedy outputs must be the same
either way; the accepted drafts per verified one are what differs.

    python examples/dspark_dormant_keep.py --prompts 8 --tokens 96 --active 4 --dormant 12
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dspark_bench import heldout_prompts  # noqa: E402

from deepinfer_core import LLM, SamplingParams  # noqa: E402


def run(keep: bool, args) -> dict:
    llm = LLM(features=["dspark"], dspark={"k": 3, "budget_policy": "fixed", "host_steps_below": 0},
              async_scheduling=True, max_num_seqs=args.prompts)
    feat = next(f for f in llm.engine.features if f.name == "dspark")
    cycle = itertools.cycle([True] * args.active + [False] * args.dormant)
    feat.active = lambda engine: next(cycle)  # the forced dormancy pattern (a measurement harness)
    if not keep:
        feat.step_passed_dormant = lambda engine, batch: None
    prompts = heldout_prompts(llm.tokenizer, args.prompts, args.seed)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    m = llm.metrics()
    llm.shutdown()
    return {"tokens": [o.outputs[0].token_ids for o in outs], "verified": m["dspark_verified"],
            "accepted": m["spec_accepted"], "accept_rate": round(m["dspark_accept_rate"], 4),
            "dormant_steps": m["spec_dormant_steps"], "spec_steps": m["spec_steps"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--active", type=int, default=4, help="speculative steps in each cycle")
    ap.add_argument("--dormant", type=int, default=12, help="dormant (plain) steps in each cycle")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with_hook, without = run(True, args), run(False, args)
    assert with_hook["tokens"] == without["tokens"], "greedy outputs differ"
    for r in (with_hook, without):
        del r["tokens"]
    print(json.dumps({"kept": with_hook, "not_kept": without, "args": vars(args)}, indent=1))


if __name__ == "__main__":
    main()

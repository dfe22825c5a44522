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
import random
import sysconfig
import zlib
from pathlib import Path

from deepinfer_core import LLM, SamplingParams


def heldout_prompts(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    """40-line slices of stdlib files the draft was not trained on (as the DSpark tests pick them)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in sorted(root.rglob("*.py")) if zlib.crc32(p.relative_to(root).as_posix().encode()) % 20 == 0
             and "test" not in p.relative_to(root).parts[:-1] and p.stat().st_size < 200_000]
    rng, out = random.Random(seed), []
    while len(out) < n:
        lines = rng.choice(files).read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
        if len(lines) < 10:
            continue
        s = rng.randrange(len(lines) - 8)
        ids = tokenizer.encode("".join(lines[s : s + 40]))
        if len(ids) >= 48:
            out.append(ids[:256])
    return out


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

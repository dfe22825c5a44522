#!/usr/bin/env python
"""Offline replay of DSpark's variable-length trade on many verifications: DSpark runs fixed k = 5
greedy on held-out prompts (the same split as ``dspark_bench.py``) and logs every verification; each
confidence head given is then applied to the logged features, and the drafts are cut where the
cumulative confidence P_j = c_1 ... c_j falls below a threshold. Greedy verification of a kept prefix
accepts exactly min(accepted, kept), so the replay is exact: for the threshold that verifies 25%
fewer drafts it prints how many fewer accepted drafts that costs (the issue's target: at most 5%),
with each head's decile calibration.

    python examples/dspark_confidence_replay.py --prompts 384 \\
        --heads deepinfer_core/assets/default_mtp/confidence_head.safetensors other/confidence_head.safetensors
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dspark_bench import heldout_prompts  # noqa: E402

from deepinfer_core import LLM, SamplingParams  # noqa: E402
from plugins.dspark.confidence import ConfidenceHead  # noqa: E402
from plugins.dspark.head_fit import calibration, cut_trade, outcomes, predict  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default="auto", help="[dspark] draft whose drafts are logged")
    ap.add_argument("--prompts", type=int, default=384)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=100)
    ap.add_argument("--heads", nargs="*", default=[], help="confidence head files (default: the draft's own)")
    ap.add_argument("--cut", type=float, default=0.25, help="fraction fewer verified drafts")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    llm = LLM(features=["dspark"], dspark={"draft": args.draft, "k": 5, "budget_policy": "fixed"}, max_num_seqs=64,
              enable_prefix_caching=False)
    feat = next(f for f in llm.engine.features if f.name == "dspark")
    feat.outcome_log = []
    prompts = heldout_prompts(llm.tokenizer, args.prompts, args.seed)
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True), use_tqdm=False)
    o = outcomes(feat.outcome_log)
    print(f"{len(feat.outcome_log)} fixed-k verifications, {len(o.y)} verified drafts, {int(o.y.sum())} accepted")
    heads = {str(h): ConfidenceHead.load(Path(h), feat.source.hidden_size, 1.0) for h in args.heads} or \
        {"the draft's head": feat.head}
    res = {}
    for name, head in heads.items():
        trade = cut_trade(predict(head, o), o, args.cut)
        cal = calibration(head, o)
        res[name] = {**trade, "max_decile_gap": cal["max_decile_gap"], "ece": cal["ece"]}
        print(f"{name}: at -{args.cut * 100:.0f}% verified drafts (P_j >= {trade['threshold']}), accepted drafts "
              f"-{trade['accepted_drop'] * 100:.2f}%; calibration max decile gap {cal['max_decile_gap']}, "
              f"ECE {cal['ece']}")
    llm.shutdown()
    return res


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Offline replay of DSpark's variable-length trade on many verifications: DSpark runs fixed k = 5
greedy on held-out prompts (the same split as ``dspark_bench.py``) and logs every verification; each
confidence head given is then applied to the logged features, and the drafts are cut where the
cumulative confidence P_j = c_1 ... c_j falls below a threshold. Greedy verification of a kept prefix
accepts exactly min(accepted, kept), so the replay is exact: for the threshold that verifies 25%
fewer drafts it prints how many fewer accepted drafts that costs (the issue's target: at most 5%),
with each head's decile calibration.

``--fit-calibration OUT`` also fits per-depth isotonic calibration (``plugins.dspark.calibration``) of
the first head on these verifications and writes it to OUT (JSON; ship it beside the head as
``confidence_calibration.json``). Fitted on half the prompts, it is checked on the other half
first (the trade and calibration with and without it), then refitted on all of them.

    python examples/dspark_confidence_replay.py --prompts 384 \\
        --heads deepinfer_core/assets/default_mtp/confidence_head.safetensors other/confidence_head.safetensors
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dspark_bench import heldout_prompts  # noqa: E402

from deepinfer_core import LLM, SamplingParams  # noqa: E402
from plugins.dspark.calibration import Calibration  # noqa: E402
from plugins.dspark.confidence import ConfidenceHead  # noqa: E402
from plugins.dspark.head_fit import calibration, cut_trade, outcomes, predict  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default="auto", help="[dspark] draft whose drafts are logged")
    ap.add_argument("--prompts", type=int, default=384)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=100)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--heads", nargs="*", default=[], help="confidence head files (default: the draft's own)")
    ap.add_argument("--cut", type=float, default=0.25, help="fraction fewer verified drafts")
    ap.add_argument("--fit-calibration", default=None, metavar="OUT", help="fit per-depth calibration, write OUT")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    llm = LLM(features=["dspark"], dspark={"draft": args.draft, "k": args.k, "budget_policy": "fixed"}, max_num_seqs=64,
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
    if args.fit_calibration:
        res["calibration"] = fit_calibration(next(iter(heads.values())), o, args, Path(args.fit_calibration))
    llm.shutdown()
    return res


def fit_calibration(head: ConfidenceHead, o, args, out: Path) -> dict:
    """Fit on the first half of the verifications, check on the second, refit on all and save."""
    raw = predict(head, o)
    half = o.step < int(o.step.max()) // 2 + 1
    report = {}
    for name, fit_on, test_on in (("fit first half, check second", half, ~half),
                                  ("fit second half, check first", ~half, half)):
        d = fit_on & o.decided
        cal = Calibration.fit(raw[d], o.y[d], o.depth[d], args.k)
        test = o.subset(test_on)
        r_raw, r_cal = raw[test_on], calibrated(cal, raw[test_on], test.depth)
        report[name] = {"raw": {**cut_trade(r_raw, test, args.cut), **_cal_stats(r_raw, test)},
                        "calibrated": {**cut_trade(r_cal, test, args.cut), **_cal_stats(r_cal, test)}}
        print(f"{name}: at -{args.cut * 100:.0f}% verified, accepted drafts raw "
              f"-{report[name]['raw']['accepted_drop'] * 100:.2f}% / calibrated "
              f"-{report[name]['calibrated']['accepted_drop'] * 100:.2f}%; ECE raw {report[name]['raw']['ece']} / "
              f"calibrated {report[name]['calibrated']['ece']}")
    d = o.decided
    cal = Calibration.fit(raw[d], o.y[d], o.depth[d], args.k, prompts=args.prompts, prompt_seed=args.seed,
                          max_tokens=args.max_tokens, draft=args.draft, k=args.k,
                          verifications=int(o.step.max()) + 1, command=shlex.join(["python", *sys.argv]))
    cal.save(out)
    print(f"calibration ({int(d.sum())} decided positions) written to {out}")
    return report


def calibrated(cal: Calibration, conf: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    out = conf.clone().float()
    for j in depth.unique().tolist():
        m = depth == j
        out[m] = cal.apply(conf[m], j + 1)
    return out


def _cal_stats(pred: torch.Tensor, o, bins: int = 10) -> dict:
    """Decile calibration of given predictions on the decided positions (``head_fit.calibration``'s)."""
    p, y = pred[o.decided].float(), o.y[o.decided]
    rows = [(float(p[c].mean()), float(y[c].mean()), len(c)) for c in p.argsort().chunk(bins)]
    return {"ece": round(sum(abs(a - b) * n for a, b, n in rows) / max(len(y), 1), 4),
            "max_decile_gap": round(max(abs(a - b) for a, b, _ in rows), 4)}


if __name__ == "__main__":
    main()

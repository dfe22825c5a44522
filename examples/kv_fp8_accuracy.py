#!/usr/bin/env python
"""Accuracy of the FP8 latent KV cache (``kv_cache_dtype = "fp8"``) against the unquantised cache.

Runs the same prompts through two engines that differ only in ``kv_cache_dtype`` and reports:

* **prefill drift**: per prompt token, |logprob under fp8 - logprob under the reference| of the actual
  next token (``prompt_logprobs``: the prefill path, which reads the context back from the FP8 cache);
* **decode drift**: the same for generated tokens while both engines' greedy outputs agree (the
  absorbed decode path, ``mla_decode`` over FP8 rows);
* **greedy agreement**: the share of generated tokens before the first divergence, and of sequences
  generated identically.

Default: the embedded tiny model (trained, ``deepinfer_core/assets/default_model``) on a fixed set of
Python prompts, CPU, float32 reference cache::

    python examples/kv_fp8_accuracy.py --max-tokens 64 --json out.json
    python examples/kv_fp8_accuracy.py --max-tokens 64 --candidate bf16    # a bfloat16 cache, for scale
"""

from __future__ import annotations

import argparse
import json
import statistics

PROMPTS = [
    "def fibonacci(n):\n", "import os\n", "class Stack:\n    def __init__(self):\n", "def read_file(path):\n",
    "for i in range(10):\n", "import json\n\ndef load(path):\n", "def is_prime(n):\n    if n < 2:\n",
    "try:\n    import numpy as np\nexcept ImportError:\n", "def merge(a, b):\n    result = []\n",
    "class Config(object):\n    \"\"\"", "if __name__ == '__main__':\n", "def __repr__(self):\n        return ",
    "import sys\nimport re\n\n", "    def test_basic(self):\n        self.assertEqual(", "with open(filename) as f:\n",
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(",
]


def measure(reference, fp8, prompts: list[str], max_tokens: int) -> dict:
    """Drift and agreement of engine ``fp8`` against ``reference`` (two ``LLM``s) over ``prompts``."""
    from deepinfer_core import SamplingParams

    gen = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=0, ignore_eos=True)
    ref_out = reference.generate(prompts, gen, use_tqdm=False)
    fp8_out = fp8.generate(prompts, gen, use_tqdm=False)
    decode_drift, agree, same = [], 0, 0
    for r, f in zip(ref_out, fp8_out):
        rt, ft = r.outputs[0].token_ids, f.outputs[0].token_ids
        n = next((i for i, (a, b) in enumerate(zip(rt, ft)) if a != b), len(rt))
        agree += n
        same += n == len(rt)
        # the token at the first divergence is still scored on the same context by both
        for i in range(min(n + 1, len(rt))):
            tok = rt[i]
            if tok in f.outputs[0].logprobs[i]:
                decode_drift.append(abs(r.outputs[0].logprobs[i][tok].logprob - f.outputs[0].logprobs[i][tok].logprob))
    # teacher-forced: each prompt followed by the reference's continuation, scored by both (prefill path)
    scored = [{"prompt_token_ids": list(r.prompt_token_ids) + list(r.outputs[0].token_ids)} for r in ref_out]
    score = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    prefill_drift = []
    for r, f, s in zip(reference.generate(scored, score, use_tqdm=False), fp8.generate(scored, score, use_tqdm=False),
                       scored):
        for pos, tok in enumerate(s["prompt_token_ids"][1:], start=1):
            prefill_drift.append(abs(r.prompt_logprobs[pos][tok].logprob - f.prompt_logprobs[pos][tok].logprob))
    total = sum(len(r.outputs[0].token_ids) for r in ref_out)
    return {
        "prompts": len(prompts), "generated_tokens": total,
        "greedy_agreement_tokens": agree / total, "greedy_identical_sequences": same / len(prompts),
        "prefill_drift_mean": statistics.fmean(prefill_drift), "prefill_drift_max": max(prefill_drift),
        "prefill_tokens": len(prefill_drift),
        "decode_drift_mean": statistics.fmean(decode_drift), "decode_drift_max": max(decode_drift),
        "decode_tokens": len(decode_drift),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the embedded tiny model)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--reference", default="auto", choices=["auto", "bf16"], help="the reference kv_cache_dtype")
    ap.add_argument("--candidate", default="fp8", choices=["fp8", "bf16"],
                    help="the kv_cache_dtype measured (bf16 against a float32 reference: the baseline drift)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from deepinfer_core import LLM

    common = dict(model=args.model, dtype=args.dtype, enable_prefix_caching=False)
    ref = LLM(kv_cache_dtype=args.reference, **common)
    cand = LLM(kv_cache_dtype=args.candidate, **common)
    res = {"reference": args.reference, "candidate": args.candidate, "dtype": str(ref.engine.dtype),
           **measure(ref, cand, PROMPTS, args.max_tokens)}
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
